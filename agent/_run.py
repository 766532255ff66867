"""Running the agent as a service: logging, identity (bootstrap), serve until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Callable

from agent._config import AgentConfig
from agent._errors import AgentError
from agent.http import AgentServer
from agent.identity import Identity, bootstrap_enroll, ensure_state_directory
from agent.telemetry import install_agent_log

__all__ = ["configure_logging", "run_agent", "serve"]

log = logging.getLogger("mirbad.agent")


def configure_logging(level: str) -> None:
    """One line per record on stderr (journald and Docker collect it from there)."""
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger("mirbad")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # The same lines, the last 2,000, for the console's log panel (docs/decisions.md D62).
    install_agent_log(formatter)


async def serve(
    config: AgentConfig, identity: Identity, *, stop: asyncio.Event | None = None
) -> None:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    server = AgentServer(config=config, identity=identity)
    try:
        await server.start()
        gc.freeze()  # what start-up loaded stays; collections walk only what requests make
        await stop.wait()
        log.info("Stopping (signal received)")
    finally:
        await server.stop()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (Linux, macOS): the proxy hop costs about half.

    Windows has no uvloop; asyncio's own loop is the fallback everywhere else too.
    """
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_agent(config: AgentConfig) -> int:
    """``python -m agent run``: returns the process exit code."""
    configure_logging(config.log_level)
    try:
        ensure_state_directory(config.state_directory)
        identity = bootstrap_enroll(config)
    except AgentError as exc:
        log.error("%s", exc)
        print(f"agent: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"agent: {config.state_directory}: {exc}", file=sys.stderr)
        return 1
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(config, identity))
    except OSError as exc:
        # Typically the port is taken; say which one.
        print(
            f"agent: cannot listen on {config.listen_address}:{config.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    return 0
