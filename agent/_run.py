"""Running the agent as a service: logging, identity (bootstrap), serve until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import logging.handlers
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from agent._config import AgentConfig
from agent._errors import AgentError
from agent.http import AgentServer
from agent.identity import Identity, bootstrap_enroll, ensure_state_directory
from agent.telemetry import install_agent_log

__all__ = ["CappedFileHandler", "configure_logging", "run_agent", "serve"]

log = logging.getLogger("mirbad.agent")


class CappedFileHandler(logging.handlers.RotatingFileHandler):
    """The agent's log file (LogFile): rotated at LogMaxBytes, LogFiles old ones kept.

    A record that cannot be written (a full disk) is dropped; stderr gets one line per
    streak of failures instead of a traceback per record, and the agent carries on.
    """

    def __init__(self, path: Path, *, max_bytes: int, files: int) -> None:
        super().__init__(path, maxBytes=max_bytes, backupCount=files, encoding="utf-8")
        self.failing = False
        self._written = True

    def emit(self, record: logging.LogRecord) -> None:
        self._written = True
        super().emit(record)  # calls handleError when the write failed
        if self._written and self.failing:
            self.failing = False
            print(f"agent: the log file {self.baseFilename} is written again", file=sys.stderr)

    def handleError(self, record: logging.LogRecord) -> None:
        self._written = False
        if not self.failing:
            self.failing = True
            error = sys.exc_info()[1]
            print(f"agent: cannot write the log file {self.baseFilename}: {error}", file=sys.stderr)


def configure_logging(level: str, config: AgentConfig | None = None) -> None:
    """One line per record on stderr (journald and Docker collect it from there), or in
    ``config.log_file``, rotated, when it is set (docs/agent.md, "Logs and disk space")."""
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if config is not None and config.log_file is not None:
        config.log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handler = CappedFileHandler(
            config.log_file, max_bytes=config.log_max_bytes, files=config.log_files
        )
    handler.setFormatter(formatter)
    root = logging.getLogger("mirbad")
    for old in root.handlers:
        old.close()
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
    try:
        configure_logging(config.log_level, config)
    except OSError as exc:
        print(f"agent: LogFile {config.log_file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
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
