"""One listener with its default limits, alone in a process, for the memory checks.

``python tests/limits_server.py web|web-unlimited|enroll|agent`` listens on a free
loopback port, prints ``port N`` and serves until SIGTERM. ``web-unlimited`` is plain
uvicorn (no limits), to show what the attack does without them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A tiny ASGI app: reads the whole body, answers its length."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


async def _until_term() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


async def web(limited: bool) -> None:
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from mirbad_site.http_limits import LimitedHttpToolsProtocol
    from protocol.http_limits import HttpLimits

    class Defaults(LimitedHttpToolsProtocol):
        limits = HttpLimits()

    sock = _socket()
    config = uvicorn.Config(
        echo_app,
        http=Defaults if limited else HttpToolsProtocol,
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    print(f"port {sock.getsockname()[1]}", flush=True)
    await server.serve(sockets=[sock])


async def enroll() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mirbad_site.settings")
    os.environ.setdefault("MIRBAD_DATA_PATH", tempfile.mkdtemp(prefix="mirbad-limits-"))
    import django

    django.setup()
    from django.conf import settings

    from nodes.enroll_listener import serve

    loop = asyncio.get_running_loop()
    started: asyncio.Future[int] = loop.create_future()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    task = asyncio.create_task(
        serve("127.0.0.1", 0, None, settings.MIRBAD.http_limits, started=started, stop=stop)
    )
    print(f"port {await started}", flush=True)
    await task


async def agent() -> None:
    from aiohttp import web as aioweb

    from agent.http._front import FrontListener
    from agent.http._proxy import Proxy, Upstream
    from protocol.http_limits import HttpLimits

    def resolve(instance_id: str) -> Upstream:
        return Upstream(port=9, key="k", served_name="demo")

    proxy = Proxy(resolve=resolve, max_in_flight=8, idle_timeout_seconds=5)
    await proxy.start()
    runner = aioweb.AppRunner(aioweb.Application())
    await runner.setup()
    front = FrontListener(
        proxy=proxy, fallback=runner.server, verdict=lambda _: None, limits=HttpLimits()
    )
    port = await front.start("127.0.0.1", 0)
    print(f"port {port}", flush=True)
    await _until_term()
    await front.close(1.0)
    await runner.cleanup()
    await proxy.close()


def main() -> None:
    kind = sys.argv[1]
    if kind in ("web", "web-unlimited"):
        asyncio.run(web(kind == "web"))
    elif kind == "enroll":
        asyncio.run(enroll())
    elif kind == "agent":
        asyncio.run(agent())
    else:
        raise SystemExit(f"unknown kind {kind!r}")


if __name__ == "__main__":
    main()
