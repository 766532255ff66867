"""The agent's HTTPS listener (aiohttp.web) and the wiring of its parts.

:class:`AgentServer` is the composition root: it verifies the executables, starts the
process runtime, the proxy and the health monitor, and serves the contract's endpoints
(docs/agent-api.md) on ListenAddress:Port. The TLS handshake already requires a client
certificate chained to our CA (a refused one gets its TLS alert and a logged WARNING);
the first middleware adds the role check (only the master may call) once per connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import ssl
import weakref
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from agent._config import AgentConfig
from agent._errors import (
    ERROR_HEADER,
    ApiError,
    ClientNotMaster,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    NotSupported,
    StateUnavailable,
)
from agent._util import utc_now_iso
from agent._version import PROTOCOL_VERSIONS, __version__
from agent.engines import (
    Catalogue,
    ContainerRuntime,
    ProcessRuntime,
    Runtimes,
    cap_log,
    engine_log_path,
    list_images,
)
from agent.http._complete import complete
from agent.http._front import FrontListener
from agent.http._json import read_json
from agent.http._pki import RotationRoutes
from agent.http._proxy import Proxy, Upstream, engine_slots
from agent.http._refusals import RefusalLog
from agent.http._weights import WeightRoutes
from agent.identity import (
    Identity,
    RotationStore,
    check_master_client_cert,
    handshake_refusal,
    load_identity,
    server_ssl_context,
)
from agent.state import OPERATION_HEADER, EventBus, Fencing, OperationLog, describe_request
from agent.telemetry import (
    EngineTarget,
    HealthMonitor,
    LogBook,
    Telemetry,
    describe,
    disks,
    docker_reachable,
    host_facts,
    memory,
    probe_gpus,
)
from agent.weights import DownloadManager, Weights
from protocol.atomic import AtomicWriteError
from protocol.fencing import MASTER_HEADER, TIME_HEADER
from protocol.http_limits import aiohttp_handler_limits
from protocol.states import InstanceState

__all__ = ["ERROR_HEADER", "AgentServer", "error_middleware"]

log = logging.getLogger("mirbad.agent.server")

FEATURES = [
    "runtime.llamacpp.process",
    "telemetry",
    "events",
    # Heartbeats carry the /telemetry sample when the stream asks (?telemetry=1).
    "events.telemetry",
    "gguf.inspect",
    "gpus.pinning",
    "instances.measured",
    "downloads.hf-native",
    "weights.inventory",
    "pki.rotation",
    "logs",
]


def error_response(code: str, message: str, status: int) -> web.Response:
    """An agent error; the header tells the master's router it is not the engine's."""
    return web.json_response(
        {"error": {"code": code, "message": message}},
        status=status,
        headers={ERROR_HEADER: code},
    )


def _api_error_response(error: ApiError) -> web.Response:
    response = web.json_response(
        error.to_json(), status=error.status, headers={ERROR_HEADER: error.code}
    )
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every error in the contract's JSON shape, whatever raised it."""
    try:
        return await handler(request)
    except ApiError as exc:
        if isinstance(exc, StateUnavailable):  # a state file: the operator must act
            log.error("%s %s: %s", request.method, request.path, exc.message)
        return _api_error_response(exc)
    except web.HTTPNotFound:
        return _api_error_response(NotFound(f"no such endpoint: {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _api_error_response(
            MethodNotAllowed(f"{request.method} is not allowed on {request.path}; use {allowed}")
        )
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response("invalid_request", exc.reason, exc.status)
        raise
    except (asyncio.CancelledError, ConnectionError):
        raise
    except AtomicWriteError as exc:
        # A state file could not be written (EIO, disk full): the file named, not a bare 500.
        log.error("%s %s: %s", request.method, request.path, exc)
        return _api_error_response(StateUnavailable(str(exc)))
    except Exception:
        log.exception("Unexpected error on %s %s", request.method, request.path)
        return error_response("internal_error", "unexpected agent error; see its log", 500)


class AgentServer:
    """The running agent: listener, runtime, proxy, telemetry and events."""

    def __init__(
        self,
        *,
        config: AgentConfig,
        identity: Identity,
        heartbeat_interval: float = 5.0,
        ready_poll_interval: float = 0.5,
        stop_grace_seconds: float = 10.0,
        telemetry_interval: float = 5.0,
    ) -> None:
        self.config = config
        self.identity = identity
        self.boot_id = secrets.token_hex(16)
        self.bus = EventBus()
        self.catalogue = Catalogue(entries=config.executables)
        self.health = HealthMonitor(
            models_root=config.models_root_path,
            state_directory=config.state_directory,
            bus=self.bus,
            interval=config.health_check_interval_seconds,
            extra_checks=[self.catalogue.health_reasons, self._expected_subsystems],
        )
        process = ProcessRuntime(
            config=config,
            catalogue=self.catalogue,
            bus=self.bus,
            ready_poll_interval=ready_poll_interval,
            stop_grace_seconds=stop_grace_seconds,
        )
        self.fencing = Fencing(state_dir=config.state_directory)
        containers = (
            ContainerRuntime(
                config=config,
                bus=self.bus,
                check_gpus=process.check_gpus_present,
                epoch=lambda: self.fencing.accepted.epoch if self.fencing.accepted else None,
                ready_poll_interval=ready_poll_interval,
                stop_grace_seconds=stop_grace_seconds,
            )
            if config.docker_enabled
            else None
        )
        self.runtime = Runtimes(process=process, container=containers)
        self.telemetry = Telemetry(
            models_root=config.models_root_path,
            state_directory=config.state_directory,
            engines=self._engine_targets,
            gpus=self.runtime.gpus,
            interval=telemetry_interval,
        )
        self.logs = LogBook(
            instances=lambda: [(i["instanceId"], i["state"]) for i in self.runtime.list()],
            log_path=lambda instance_id: engine_log_path(config.state_directory, instance_id),
            cap=lambda path: cap_log(
                path, config.engine_log_max_bytes, files=config.engine_log_files
            ),
        )
        self.proxy = Proxy(
            resolve=self._upstream,
            max_in_flight=config.proxy_max_in_flight,
            idle_timeout_seconds=config.proxy_upstream_idle_timeout_seconds,
        )
        self._heartbeat = heartbeat_interval
        self._verdicts: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()
        # Refused handshakes and certificates: one WARNING a second per peer at most.
        self.refusals = RefusalLog(log)
        self._runner: web.AppRunner | None = None
        self._front: FrontListener | None = None
        self._facts = host_facts()
        self.oplog = OperationLog(state_dir=config.state_directory)
        self.rotations = RotationRoutes(
            store=RotationStore(state_dir=config.state_directory, node_id=config.node_id),
            identity=lambda: self.identity,
            reload_identity=self._reload_identity,
        )
        self.weights = Weights(models_root=config.models_root_path, in_use=self._folder_in_use)
        self.downloads = DownloadManager(
            models_root=config.models_root_path,
            state_directory=config.state_directory,
            bus=self.bus,
            on_finished=self.weights.invalidate,
            reserve_bytes=config.download_reserve_bytes,
        )
        self.weight_routes = WeightRoutes(
            models_root=config.models_root_path, weights=self.weights, downloads=self.downloads
        )
        self.port: int | None = None

    def _expected_subsystems(self) -> list[dict[str, str]]:
        """docker_unreachable / gpu_probe_failing, only where the node is meant to have them."""
        reasons = []
        if self.config.docker_expected or self.config.docker_enabled:
            problem = docker_reachable(self.config.docker_endpoint)
            if problem:
                reasons.append({"code": "docker_unreachable", "message": problem})
        if self.config.gpus_expected:
            gpus, problem = probe_gpus()
            if problem or not gpus:
                reasons.append(
                    {
                        "code": "gpu_probe_failing",
                        "message": problem or "no NVIDIA GPU found (NVML, nvidia-smi)",
                    }
                )
        return reasons

    def _engine_targets(self) -> list[EngineTarget]:
        """The engines the telemetry sampler measures: every instance with a process."""
        targets = []
        for item in self.runtime.list():
            if item["pid"] is None:
                continue
            inst = self.runtime.get(item["instanceId"])
            targets.append(
                EngineTarget(
                    instance_id=inst.instance_id,
                    state=str(inst.state),
                    pid=item["pid"],
                    port=inst.port,
                    key=inst.key,
                    ready=inst.state == InstanceState.READY,
                )
            )
        return targets

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Verify executables, start the parts, then listen (so /info is truthful at once)."""
        self.config.models_root_path.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.catalogue.verify)
        await self.runtime.start()
        await self.downloads.start()
        closed = self.oplog.reconcile(self._instance_state)
        if closed:
            log.info("Reconciled %d open operation(s) from the state files", closed)
        await self.proxy.start()
        await self.health.refresh()
        self.health.start()
        self.telemetry.start()
        self.logs.start()
        limits = self.config.http_limits
        self._runner = web.AppRunner(
            self.build_app(),
            handler_cancellation=True,
            shutdown_timeout=self.config.shutdown_timeout_seconds,
            **aiohttp_handler_limits(limits),
        )
        await self._runner.setup()
        server = self._runner.server
        if server is None:  # setup() makes it; AppRunner types it optional for before then
            raise RuntimeError("aiohttp's AppRunner has no server after setup()")
        # Proxy requests are served on a lean protocol; any other request hands its
        # connection to aiohttp (D32).
        self._front = FrontListener(
            proxy=self.proxy, fallback=server, verdict=self.peer_verdict, limits=limits
        )
        self.port = await self._front.start(
            self.config.listen_address, self.config.port, ssl=self.ssl_context()
        )
        log.info(
            "Agent %s %s listening on https://%s:%s (boot %s)",
            self.config.node_id,
            __version__,
            self.config.listen_address,
            self.port,
            self.boot_id,
        )

    async def stop(self) -> None:
        """Drain the listener, then stop every engine and the background tasks."""
        self.bus.close()
        await self.logs.close()  # answers the console's long-polls before the drain
        if self._front is not None:
            await self._front.close(self.config.shutdown_timeout_seconds)
            self._front = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.runtime.close(stop_instances=self.config.stop_instances_on_shutdown)
        await self.downloads.close()
        await self.proxy.close()
        await self.health.stop()
        await self.telemetry.stop()
        log.info("Agent stopped")

    def ssl_context(self) -> ssl.SSLContext:
        context = server_ssl_context(self.identity)
        self.rotations.attach(context)
        return context

    def _reload_identity(self) -> Identity:
        """After a rotation's commit: the promoted key and certificate."""
        self.identity = load_identity(self.config.state_directory, node_id=self.config.node_id)
        return self.identity

    def _upstream(self, instance_id: str) -> Upstream:
        host, port, inst = self.runtime.address(instance_id)
        return Upstream(
            host=host,
            port=port,
            key=inst.key,
            served_name=inst.spec.served_name,
            slots=engine_slots(inst.spec.args),
        )

    # -- app -------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[
                self._client_cert_middleware,
                error_middleware,
                self._fencing_middleware,
                self._oplog_middleware,
            ]
        )
        r = app.router
        r.add_get("/agent/v1/info", self.handle_info)
        r.add_get("/agent/v1/status", self.handle_status)
        r.add_get("/agent/v1/telemetry", self.handle_telemetry)
        r.add_get("/agent/v1/events", self.handle_events)
        r.add_get("/agent/v1/logs", self.handle_logs)
        r.add_get("/agent/v1/logs/{name}", self.handle_log_lines)
        r.add_get("/agent/v1/operations/{operationId}", self.handle_operation)
        r.add_get("/agent/v1/instances", self.handle_list)
        r.add_post("/agent/v1/instances", self.handle_launch)
        r.add_post("/agent/v1/instances/{instanceId}/stop", self.handle_stop)
        r.add_delete("/agent/v1/instances/{instanceId}", self.handle_delete)
        r.add_get("/agent/v1/images", self.handle_images)
        self.weight_routes.register(r)
        self.rotations.register(r)
        r.add_route("*", "/agent/v1/proxy/{instanceId}/{path:.*}", self.proxy.handle)
        r.add_route("*", "/agent/v1/proxy/{instanceId}", self.proxy.handle)
        return app

    def peer_verdict(self, transport: asyncio.BaseTransport) -> str | None:
        """None when the connection's client certificate is the master's, else why not
        (decided once per TLS connection)."""
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None:
            return "the connection is not TLS"
        if ssl_object in self._verdicts:
            return self._verdicts[ssl_object]
        verdict: str | None = None
        peer = transport.get_extra_info("peername")
        failed = handshake_refusal(ssl_object)
        if failed is not None:
            verdict = f"the TLS handshake failed: {failed}"
            self.refusals.refused(
                peer, "Refused a TLS handshake", f"{failed} (closed with a TLS alert)"
            )
        else:
            try:
                check_master_client_cert(ssl_object.getpeercert(binary_form=True))
            except ClientNotMaster as exc:
                verdict = exc.message
                self.refusals.refused(peer, "Refused a master client certificate", verdict)
        self._verdicts[ssl_object] = verdict
        return verdict

    @web.middleware
    async def _client_cert_middleware(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        transport = request.transport
        verdict = self.peer_verdict(transport) if transport else "the connection is gone"
        if verdict is not None:
            response = _api_error_response(
                ClientNotMaster(f"only the master may call the agent: {verdict}")
            )
            response.force_close()
            return response
        return await handler(request)

    @web.middleware
    async def _fencing_middleware(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        """Check the master's fencing triple before any mutation (not reads, not the proxy)."""
        mutating = request.method in ("POST", "PUT", "DELETE", "PATCH") and not (
            request.path.startswith("/agent/v1/proxy/")
        )
        if mutating:
            try:
                moved = await self.fencing.check(
                    request.headers.get(MASTER_HEADER), request.headers.get(TIME_HEADER)
                )
            except ApiError as exc:
                log.warning(
                    "Refused %s %s: %s (%s).", request.method, request.path, exc.code, exc.message
                )
                raise
            if moved:
                self.bus.publish("fencing", {"accepted": self.fencing.to_json()})
        return await handler(request)

    def _instance_state(self, instance_id: str) -> str | None:
        try:
            return str(self.runtime.get(instance_id).state)
        except ApiError:
            return None

    @web.middleware
    async def _oplog_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Write each mutation to the operation log before it runs; answer repeats from it."""
        if request.method not in ("POST", "PUT", "DELETE", "PATCH") or request.path.startswith(
            "/agent/v1/proxy/"
        ):
            return await handler(request)
        op_id = OperationLog.operation_id(request.headers.get(OPERATION_HEADER))
        kind, instance_id = describe_request(request.method, request.path)
        if kind == "launch":
            try:
                body = json.loads(await request.read() or b"{}")
                instance_id = body.get("instanceId") if isinstance(body, dict) else None
            except ValueError:
                instance_id = None  # the handler answers the malformed body
        earlier = await self.oplog.begin(
            op_id, method=request.method, path=request.path, instance_id=instance_id
        )
        if earlier is not None:
            return web.Response(
                status=earlier["status"],
                body=earlier.get("body", "").encode(),
                content_type="application/json",
                headers={OPERATION_HEADER: op_id, "MirbadLLM-Operation-Repeated": "true"},
            )
        try:
            response = await handler(request)
        except ApiError as exc:
            await self.oplog.close(
                op_id, status=exc.status, body=json.dumps(exc.to_json()).encode()
            )
            refused = _api_error_response(exc)
            refused.headers[OPERATION_HEADER] = op_id
            return refused
        except Exception:
            await self.oplog.close(op_id, status=500, body=None)
            raise
        # A web.Response carries its body; a streamed response has none to keep.
        raw = getattr(response, "body", None)
        body = raw if isinstance(raw, bytes) else None
        await self.oplog.close(op_id, status=response.status, body=body)
        response.headers[OPERATION_HEADER] = op_id
        return response

    # -- handlers --------------------------------------------------------------------

    def _heartbeat_data(self) -> dict[str, Any]:
        """Memory, disk and GPU memory ride on every heartbeat: they change, unlike /info.

        The GPUs come from the runtime's cached probe: nvidia-smi never runs on the event
        loop, and a stale answer (over 5 s) only starts a refresh in a thread.
        """
        paths = [self.config.models_root_path, self.config.state_directory]
        return {
            "time": utc_now_iso(),
            # The accepted master, again: a "fencing" event sent before a new monitor's
            # event stream was open would otherwise be missed until it reconnects.
            "fencing": self.fencing.to_json(),
            "memory": memory(),
            "disks": disks(paths),
            **self.runtime.gpus.heartbeat(),
            "downloads": self.downloads.heartbeat(),
            "weights": self.weights.summary(),
            "operations": self.oplog.open_operations(),
        }

    def _folder_in_use(self, folder: str) -> bool:
        """Whether a Starting or Ready instance loads its model from ``folder``."""
        for item in self.runtime.list():
            if item["state"] in ("Starting", "Ready"):
                if self.runtime.get(item["instanceId"]).spec.model_folder == folder:
                    return True
        return False

    async def handle_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "nodeId": self.config.node_id,
                "agentVersion": __version__,
                "protocolVersions": list(PROTOCOL_VERSIONS),
                "bootId": self.boot_id,
                "time": utc_now_iso(),
                **self._facts,
                **await asyncio.to_thread(
                    describe,
                    models_root=self.config.models_root_path,
                    state_directory=self.config.state_directory,
                ),
                "spkiSha256": self.identity.spki_sha256,
                "certificate": {
                    "serial": format(self.identity.cert.serial_number, "x"),
                    "notAfter": self.identity.cert.not_valid_after_utc.isoformat(),
                },
                "rotation": self.rotations.summary(),
                "fencing": self.fencing.to_json(),
                "executables": [i.to_json() for i in self.catalogue.infos],
                "features": self.features(),
            }
        )

    def features(self) -> list[str]:
        """FEATURES, and a ``runtime.<engine>.<delivery>`` entry for each runtime offered."""
        offered = [f"runtime.{r}.{d}" for r, d in self.runtime.offers]
        return offered + [f for f in FEATURES if not f.startswith("runtime.")]

    async def handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "nodeId": self.config.node_id,
                "bootId": self.boot_id,
                "time": utc_now_iso(),
                "health": {"reasons": self.health.reasons},
                "instances": self.runtime.list(),
                "operations": self.oplog.open_operations(),
                "telemetry": await self.telemetry.current(),
            }
        )

    async def handle_telemetry(self, request: web.Request) -> web.Response:
        return web.json_response(await self.telemetry.current())

    async def handle_logs(self, request: web.Request) -> web.Response:
        return web.json_response(self.logs.listing())

    async def handle_log_lines(self, request: web.Request) -> web.Response:
        return web.json_response(await self.logs.read(request.match_info["name"], request.query))

    async def handle_operation(self, request: web.Request) -> web.Response:
        """One recorded operation (read-only): how the master closes the operations whose
        answers it lost (docs/agent-api.md, "Operation log")."""
        return web.json_response(self.oplog.answer(request.match_info["operationId"]))

    async def handle_list(self, request: web.Request) -> web.Response:
        return web.json_response({"instances": self.runtime.list()})

    async def handle_launch(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        instance = await complete(self.runtime.launch(body))
        return web.json_response(instance, status=202)

    async def handle_stop(self, request: web.Request) -> web.Response:
        instance = await complete(self.runtime.stop(request.match_info["instanceId"]))
        return web.json_response(instance)

    async def handle_delete(self, request: web.Request) -> web.Response:
        await complete(self.runtime.delete(request.match_info["instanceId"]))
        return web.Response(status=204)

    async def handle_images(self, request: web.Request) -> web.Response:
        """The container images the Docker engine holds (docs/agent-api.md,
        "GET /agent/v1/images")."""
        if self.runtime.container is None:
            raise NotSupported(
                "this node does not run containers: its DockerEnabled is false "
                '(docs/agent.md, "Containers")'
            )
        return web.json_response(await list_images(self.runtime.container.docker))

    async def handle_events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: hello, then instance/health events and heartbeats.

        ``?telemetry=1``: each heartbeat also carries the ``/telemetry`` sample, so the
        master needs no request per node every 5 s (docs/agent-api.md).
        """
        with_telemetry = _events_telemetry(request)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        loop = asyncio.get_running_loop()
        # Subscribe before hello: an event published right after hello is never lost.
        with self.bus.subscribe() as subscription:
            await response.prepare(request)
            hello = {"bootId": self.boot_id, "nodeId": self.config.node_id}
            await response.write(_sse(self.bus.next_seq(), "hello", hello))
            next_beat = loop.time() + self._heartbeat
            while True:
                try:
                    async with asyncio.timeout(max(0.0, next_beat - loop.time())):
                        event = await subscription.get()
                except TimeoutError:
                    data = self._heartbeat_data()
                    if with_telemetry:
                        data["telemetry"] = await self.telemetry.current()
                    beat = _sse(self.bus.next_seq(), "heartbeat", data)
                    await response.write(beat)
                    next_beat += self._heartbeat
                    continue
                if event is None:
                    break
                await response.write(_sse(event.seq, event.type, event.data))
        return response


def _events_telemetry(request: web.Request) -> bool:
    """The events stream's one parameter, allow-listed: ``telemetry`` is ``0`` or ``1``."""
    unknown = sorted(set(request.query) - {"telemetry"})
    if unknown:
        raise InvalidRequest(f"unknown query parameter {unknown[0][:40]!r}: only telemetry=0|1")
    value = request.query.get("telemetry", "0")
    if value not in ("0", "1"):
        raise InvalidRequest("telemetry: 0 or 1")
    return value == "1"


def _sse(seq: int, event_type: str, data: dict[str, Any]) -> bytes:
    return f"id: {seq}\nevent: {event_type}\ndata: {json.dumps(data)}\n\n".encode()
