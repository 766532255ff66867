"""The enroll listener: ``POST /enroll`` and ``GET /ca`` over TLS on MIRBAD_ENROLL_PORT.

It is a separate small aiohttp server rather than a Django view, because it
needs its own TLS certificate (issued by the CA, which the agent checks
against the CA hash it was given) and must not share the console's port.
"""

from __future__ import annotations

import json
import logging
import ssl
from typing import Any

from aiohttp import web
from asgiref.sync import sync_to_async

from nodes import pki, services

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


def server_context() -> ssl.SSLContext:
    cfg = services.config()
    mp = services.master_pki()
    cert, key = pki.ensure_enroll_certificate(mp.ca, cfg.enroll_addresses)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    return context
