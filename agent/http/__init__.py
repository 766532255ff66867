"""The agent's HTTP side: the mTLS control API, the lean proxy front and the proxy.

``AgentServer`` (``_server``) is the composition root: it builds every other room's
parts and serves docs/agent-api.md. ``_front`` serves proxy requests on a lean protocol
and hands everything else to aiohttp (docs/decisions.md D32); ``_proxy`` holds the relay
rules both stacks share; ``_refusals`` rate-limits the log of refused handshakes.
"""

from agent.http._server import AgentServer

__all__ = ["AgentServer"]
