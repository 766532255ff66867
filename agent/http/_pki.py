"""``/agent/v1/pki/rotations``: the agent's side of a certificate rotation over HTTP
(docs/agent-api.md, "Certificate rotation").

The steps are those of ``agent.identity``'s ``RotationStore``; this module adds what
the listener presents. From the install on, new connections get the pending
certificate (the master's connections accept either pin by then); an abort goes back
to the current one; the commit is accepted only over a connection that negotiated
the pending certificate in a full handshake, and the identity is reloaded after it.
Like every other mutation, the steps pass the fencing check and the operation log
(``AgentServer``'s middlewares).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from agent.http._json import read_json
from agent.identity import (
    Identity,
    RotationStore,
    ServerContext,
    check_rotation_id,
    presented_spki,
)

__all__ = ["RotationRoutes"]

log = logging.getLogger("mirbad.agent.rotation")


class RotationRoutes:
    """The rotation routes over one store and the listener's context."""

    def __init__(
        self,
        *,
        store: RotationStore,
        identity: Callable[[], Identity],
        reload_identity: Callable[[], Identity],
    ) -> None:
        self.store = store
        self._identity = identity
        self._reload_identity = reload_identity
        self.context: ServerContext | None = None  # set by attach()

    def attach(self, context: ServerContext) -> None:
        """The listener's context: it presents an installed rotation's certificate."""
        self.context = context
        installed = self.store.installed()
        if installed is not None:
            cert, key, spki = installed
            context.present(cert_path=cert, key_path=key, spki=spki)
            log.info("Presenting the installed certificate of an open rotation again")

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/agent/v1/pki/rotations", self.start)
        router.add_get("/agent/v1/pki/rotations/{rotationId}", self.read)
        router.add_put("/agent/v1/pki/rotations/{rotationId}/cert", self.install)
        router.add_post("/agent/v1/pki/rotations/{rotationId}/commit", self.commit)
        router.add_post("/agent/v1/pki/rotations/{rotationId}/abort", self.abort)

    def summary(self) -> dict[str, str] | None:
        """The open rotation for ``/info`` (None when there is none)."""
        active = self.store.active
        return None if active is None else {"rotationId": active.rotation_id, "stage": active.stage}

    @staticmethod
    def _connection(request: web.Request) -> tuple[str | None, bool]:
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        resumed = bool(getattr(ssl_object, "session_reused", False))
        return presented_spki(ssl_object), resumed

    async def start(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        rotation_id = check_rotation_id(body.get("rotationId") if isinstance(body, dict) else None)
        rotation, created = self.store.start(rotation_id)
        return web.json_response(rotation.answer(), status=201 if created else 200)

    async def read(self, request: web.Request) -> web.Response:
        rotation = self.store.find(check_rotation_id(request.match_info["rotationId"]))
        presented, resumed = self._connection(request)
        return web.json_response(
            {
                **rotation.answer(),
                "currentSpki": self._identity().spki_sha256,
                "connection": {"presentedSpki": presented, "sessionReused": resumed},
            }
        )

    async def install(self, request: web.Request) -> web.Response:
        rotation_id = check_rotation_id(request.match_info["rotationId"])
        body = await read_json(request)
        cert_pem = body.get("certPem") if isinstance(body, dict) else None
        rotation = self.store.install(rotation_id, cert_pem, ca_cert=self._identity().ca_cert)
        installed = self.store.installed()
        if self.context is not None and installed is not None:
            cert, key, spki = installed
            self.context.present(cert_path=cert, key_path=key, spki=spki)
        return web.json_response(rotation.answer())

    async def commit(self, request: web.Request) -> web.Response:
        rotation_id = check_rotation_id(request.match_info["rotationId"])
        presented, resumed = self._connection(request)
        rotation = self.store.commit(rotation_id, presented_spki=presented, resumed=resumed)
        identity = self._reload_identity()
        # The context already presents the new certificate (since the install); after a
        # restart between commit and now it presents it from agent.crt.
        if self.context is not None and self.context.presented_spki != identity.spki_sha256:
            self.context.present(
                cert_path=identity.cert_path, key_path=identity.key_path, spki=identity.spki_sha256
            )
        return web.json_response(rotation.answer())

    async def abort(self, request: web.Request) -> web.Response:
        rotation = self.store.abort(check_rotation_id(request.match_info["rotationId"]))
        identity = self._identity()
        if self.context is not None and self.context.presented_spki != identity.spki_sha256:
            self.context.present(
                cert_path=identity.cert_path, key_path=identity.key_path, spki=identity.spki_sha256
            )
        return web.json_response(rotation.answer())
