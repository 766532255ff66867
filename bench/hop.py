"""A minimal aiohttp reverse proxy: the floor of one Python hop in our own runtime.

``python bench/hop.py --port 9001 --upstream http://127.0.0.1:9000`` forwards every
request to the upstream with one pooled keep-alive client session and streams the
answer back chunk by chunk (``iter_any``), the shape of the agent's proxy without its
checks. Two of these in a chain are the floor for MirbadLLM's two hops (router and agent
proxy). ``--loop asyncio`` (the default: aiohttp's own, and the agent's) or
``--loop uvloop`` picks the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
from aiohttp import web

_DROP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def build_app(upstream: str) -> web.Application:
    base = upstream.rstrip("/")
    app = web.Application()

    async def startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        body = await request.read() if request.body_exists else None
        async with session.request(
            request.method, base + request.path_qs, headers=headers, data=body
        ) as response:
            out = web.StreamResponse(status=response.status, reason=response.reason)
            for name, value in response.headers.items():
                if name.lower() not in _DROP:
                    out.headers.add(name, value)
            if response.headers.get("Content-Length") is not None and not response.headers.get(
                "Transfer-Encoding"
            ):
                out.content_length = int(response.headers["Content-Length"])
            try:
                await out.prepare(request)
                async for chunk in response.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:
                pass  # the client left (wrk closes its connections at the end of a run)
            return out

    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-hop")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="asyncio")
    args = parser.parse_args(argv)
    loop = None
    if args.loop == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    web.run_app(
        build_app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
        loop=loop,
        backlog=1024,
        handle_signals=True,
        shutdown_timeout=2.0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
