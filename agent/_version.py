"""The agent's version and the protocol versions of docs/agent-api.md it speaks."""

__version__ = "0.1.0"
PROTOCOL_VERSIONS: tuple[int, ...] = (1,)
