"""The enroll listener: ``POST /enroll`` and ``GET /ca`` over TLS on MIRBAD_ENROLL_PORT.

It is a separate small aiohttp server rather than a Django view, because it
needs its own TLS certificate (issued by the CA, which the agent checks
against the CA hash it was given) and must not share the console's port.
Anyone who can reach the port may talk to it, so every connection passes the
listener limits first (``MIRBAD_HTTP_*``, docs/operator-guide.md "Limits"): a
TLS handshake and a request head have the head deadline, and a guard in front
of aiohttp's protocol bounds head size, header count, body idleness and the
number of open connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import signal
import ssl
from typing import Any

from aiohttp import web
from asgiref.sync import sync_to_async

from nodes import master_store, pki, services
from protocol.http_limits import ConnectionGate, GuardedProtocol, HttpLimits, aiohttp_handler_limits

log = logging.getLogger("mirbad.enroll")

MAX_BODY = 64 * 1024


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


async def handle_ca(request: web.Request) -> web.Response:
    mp = await sync_to_async(services.master_pki)()
    return web.json_response({"caCertPem": mp.ca.cert_pem, "caSpkiSha256": mp.ca.spki_sha256})


async def handle_enroll(request: web.Request) -> web.Response:
    try:
        body: Any = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return _error(400, "invalid_request", "The body must be a JSON object.")
    if not isinstance(body, dict):
        return _error(400, "invalid_request", "The body must be a JSON object.")
    for field in ("token", "nodeId", "csrPem"):
        if not isinstance(body.get(field), str) or not body[field]:
            return _error(400, "invalid_request", f"{field}: required string.")
    addresses = body.get("addresses") or []
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        return _error(400, "invalid_request", "addresses: must be a list of strings.")
    try:
        result = await sync_to_async(services.enroll)(
            token=body["token"],
            node_id=body["nodeId"],
            csr_pem=body["csrPem"],
            addresses=addresses[:8],
            agent_version=str(body.get("agentVersion", "")),
            protocol_versions=body.get("protocolVersions"),
        )
    except services.EnrollmentRefused as exc:
        return _error(exc.status, exc.code, str(exc))
    return web.json_response(result)


def build_app() -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_get("/ca", handle_ca)
    app.router.add_post("/enroll", handle_enroll)
    return app


class EnrollTls:
    """The listener's TLS context and the certificate it holds, kept current (D53).

    ``refresh`` re-issues the enroll certificate at half life and loads the new one
    into the same context: OpenSSL copies a context's certificate into each
    connection when it starts, so new handshakes present the new certificate and
    those under way keep theirs. It runs on the listener's loop, where the
    connections' TLS objects are made.
    """

    def __init__(self) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.serial: int | None = None
        self.refresh()

    @staticmethod
    def _leaf() -> pki.LeafCertificate:
        cfg = services.config()
        try:
            return master_store.ensure_enroll_certificate(
                services.master_pki().ca,
                cfg.enroll_addresses,
                lifetime=dt.timedelta(seconds=cfg.master_cert_seconds),
            )
        finally:
            master_store.close_thread_connection()  # keep_current runs it on a worker

    def refresh(self, leaf: pki.LeafCertificate | None = None) -> bool:
        """Load the current certificate when it changed; True when it did."""
        leaf = leaf or self._leaf()
        if leaf.serial == self.serial:
            return False
        self.context.load_cert_chain(str(leaf.path))
        if self.serial is not None:
            log.info("The enroll certificate is now %x (valid until %s)", leaf.serial,
                     leaf.not_after.isoformat())  # fmt: skip
        self.serial = leaf.serial
        return True

    async def keep_current(self, every: float, stop: asyncio.Event) -> None:
        """Check every ``every`` seconds until ``stop``; a failed check is retried."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
                return
            try:
                # The check may write files and make a key: off the loop. The load is on it.
                self.refresh(await asyncio.to_thread(self._leaf))
            except Exception:
                log.exception("Checking the enroll certificate failed; next try in %g s", every)


async def serve(
    host: str,
    port: int,
    context: ssl.SSLContext | None,
    limits: HttpLimits,
    *,
    started: asyncio.Future[int] | None = None,
    stop: asyncio.Event | None = None,
    tls: EnrollTls | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None).

    ``started`` gets the bound port (the one picked when ``port`` is 0). With ``tls``
    (whose ``context`` is ``context``) the certificate is kept current while it serves.
    """
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    # Cancelled with its connection: a body cut by the idle deadline ends the handler
    # quietly, instead of an error and a traceback in the log for each such client.
    runner = web.AppRunner(
        build_app(), access_log=None, handler_cancellation=True, **aiohttp_handler_limits(limits)
    )
    await runner.setup()
    gate = ConnectionGate(limits.max_connections)
    handler = runner.server
    assert handler is not None
    server = await loop.create_server(
        lambda: GuardedProtocol(handler(), limits, gate),
        host or None,
        port,
        ssl=context,
        ssl_handshake_timeout=limits.head_timeout_seconds if context is not None else None,
        backlog=128,
        reuse_address=True,
    )
    keeper = None
    if tls is not None:
        every = services.config().pki_check_seconds
        keeper = asyncio.create_task(tls.keep_current(every, stop))
    try:
        if started is not None:
            started.set_result(int(server.sockets[0].getsockname()[1]))
        await stop.wait()
    finally:
        if keeper is not None:
            keeper.cancel()
        server.close()
        with contextlib.suppress(Exception):
            await runner.cleanup()
