"""What each pytest-xdist worker owns, so that no two tests running at once collide.

Loaded with ``-p tests.parallel`` (``pyproject.toml``), before pytest-django reads the
settings: the settings take ``MIRBAD_*`` from the environment once, at import, so each
worker's values must be in place before that. A worker ``gw<k>`` gets:

- its own Redis databases on the configured server: ``FIRST_DB + 2k`` for the suite
  (status cache, throttles, channel layer, the fair queue) and the next one for the
  e2e stacks that run on the configured server (``STACK_REDIS_URL``). Redis keeps 16
  databases unless told otherwise, so at most ``MAX_WORKERS`` workers;
- its own data directory, ``$MIRBAD_DATA_PATH/gw<k>`` (pytest-django gives it its own
  test database: ``test_<name>_gw<k>``);
- its own block of TCP ports, below the kernel's ephemeral range (``free_port``): a port
  handed out is never handed out again in this run by any worker, and one that an
  outgoing connection took meanwhile is not free, so it is skipped. The top
  ``ENGINE_PORTS`` of the block are its agents' engine ports (``engine_port_range``;
  ``engine_port_env`` for an agent process).

Without xdist (``-n 0``) the process is worker 0 of one.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# Databases 0-3 are left to people and to the benches (bench/fleet.py --quick uses 3).
FIRST_DB = 4
MAX_WORKERS = 6
# Ports 10000-31999, split in equal blocks; the kernel's ephemeral ports start at 32768.
PORT_LOW, PORT_HIGH = 10_000, 32_000


def worker_index() -> int:
    """0 for ``gw0`` or a run without xdist, k for ``gw<k>``."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    try:
        return int(name.removeprefix("gw"))
    except ValueError:
        raise RuntimeError(f"PYTEST_XDIST_WORKER={name!r}: expected gw<number>") from None


def _with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss"):
        return urlunsplit(parts._replace(path=f"/{db}"))
    # unix:///path/redis.sock?db=N is redis-py's way to pick a database over a socket.
    # Built by hand: urlunsplit drops the empty host and writes unix:/path.
    query = "&".join(p for p in parts.query.split("&") if p and not p.startswith("db="))
    base = url.split("?", 1)[0].split("#", 1)[0]
    return f"{base}?{query}&db={db}" if query else f"{base}?db={db}"


def _apply() -> None:
    index = worker_index()
    if index >= MAX_WORKERS:
        raise RuntimeError(
            f"worker gw{index}: the suite has Redis databases for {MAX_WORKERS} workers; "
            f"run with -n {MAX_WORKERS} or fewer"
        )
    url = os.environ.get("MIRBAD_REDIS_URL")
    if url and "PYTEST_XDIST_WORKER" in os.environ:
        os.environ["MIRBAD_REDIS_URL"] = _with_db(url, FIRST_DB + 2 * index)
        os.environ["MIRBAD_TEST_STACK_REDIS_URL"] = _with_db(url, FIRST_DB + 2 * index + 1)
    elif url:
        os.environ.setdefault("MIRBAD_TEST_STACK_REDIS_URL", _with_db(url, 2))
    data = os.environ.get("MIRBAD_DATA_PATH")
    if data and "PYTEST_XDIST_WORKER" in os.environ:
        path = Path(data) / f"gw{index}"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["MIRBAD_DATA_PATH"] = str(path)


_apply()


def stack_redis_url() -> str | None:
    """The Redis database of this worker's e2e stacks on the configured server."""
    return os.environ.get("MIRBAD_TEST_STACK_REDIS_URL")


# The top of each worker's block is its agents' engine ports (PortRangeStart..End):
# every agent on a worker, in this process or started by an e2e stack, takes its engine
# ports from there, so two workers' engines never race for the same free port.
ENGINE_PORTS = 600
_span = (PORT_HIGH - PORT_LOW) // MAX_WORKERS
_start = PORT_LOW + worker_index() * _span
_block = range(_start, _start + _span - ENGINE_PORTS)
_engine_block = range(_block.stop, _start + _span)
_next = itertools.cycle(_block)
_lock = threading.Lock()


def _bindable(port: int) -> bool:
    # 0.0.0.0 fails when any address holds the port: 127.0.0.1, 127.0.0.x, a namespace's.
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port of this worker's block that nothing holds now; never the same twice
    until the block (thousands of ports) wraps around."""
    with _lock:
        for _ in range(len(_block)):
            port = next(_next)
            if _bindable(port):
                return port
    raise RuntimeError(f"no free port in {_block.start}-{_block.stop - 1}")


def engine_port_range() -> tuple[int, int]:
    """This worker's agents' PortRangeStart and PortRangeEnd (both included)."""
    return _engine_block.start, _engine_block.stop - 1


def engine_port_env() -> dict[str, str]:
    """The same range as the agent's environment overrides, for an agent process."""
    start, end = engine_port_range()
    return {"MIRBAD_AGENT_PORT_RANGE_START": str(start), "MIRBAD_AGENT_PORT_RANGE_END": str(end)}
