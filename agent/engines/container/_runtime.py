"""The container runtime: engines (vLLM, or llama-server in an image) as Docker containers.

It mirrors the process runtime (:mod:`agent.engines.process._runtime`) where the two
can agree: the same launch spec checks (the engine's flag allow-list, the model's
confinement under ModelsRoot), the same Ready rule (:mod:`agent.engines._ready`), the
same restart budget, the same ``instance`` events and the same engine log file, which
a log follower fills from the container's output. What differs (docs/agent.md,
"Containers"):

- The image policy (``ApprovedImages``, ``AllowTagPulls``) and the mounts: only the
  model's folder, read-only, and the node's cache volume where one is configured.
  Every refusal is a 422 spec_rejected before anything is created.
- The engine listens on port 8000 in its container; the agent publishes it on
  127.0.0.1 from its port range, or reaches ``ss-<instanceId>:8000`` on
  ``DockerNetwork`` when the agent runs in a container itself.
- The key is in the container's environment (``LLAMA_API_KEY`` or ``VLLM_API_KEY``),
  GPUs are device requests by UUID with ``NVIDIA_VISIBLE_DEVICES``.
- Labels say whose a container is (node, instance, fingerprint, master epoch). After
  an agent restart a running container that ``containers.json`` describes is adopted
  as it runs; one labelled as this node's that no record describes is stopped and
  removed; any other container is never touched.
- Docker may be down: every call is bounded (:mod:`._docker`); at start the runtime
  waits up to ``DockerStartupTimeoutSeconds`` in the background and then reconciles
  whenever the daemon answers. Until then launches answer 503 docker_unavailable.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import docker.errors
import docker.types

from agent._config import AgentConfig
from agent._errors import (
    Conflict,
    DockerUnavailable,
    ModelNotRunning,
    NotFound,
    SpecRejected,
    StateUnavailable,
)
from agent.engines._ready import engine_ready
from agent.engines._spec import (
    LaunchSpec,
    check_args,
    check_container,
    check_env,
    check_runtime,
)
from agent.engines.container._adoption import ContainerAdoption
from agent.engines.container._docker import DockerGateway, DockerRefused, NotThere
from agent.engines.container._images import ensure_image
from agent.engines.container._instance import (
    CONTAINER_PORT,
    KEY_VARIABLES,
    LABELS,
    ContainerInstance,
    container_name,
)
from agent.engines.container._policy import (
    check_image_policy,
    container_definition,
    model_bindings,
)
from agent.engines.container._records import (
    RECORDS_FILE,
    instance_from_record,
    read_records,
    write_records,
)
from agent.engines.process._handle import (
    EngineLogWriter,
    PortAllocator,
    engine_log_path,
    exit_text,
    open_log,
    read_log_tail,
)
from agent.state import EventBus
from protocol.states import InstanceState

__all__ = ["CONTAINER_OFFERS", "CONTAINER_PORT", "LABELS", "ContainerRuntime"]

log = logging.getLogger("mirbad.agent.container")

CONTAINER_OFFERS = (("llamacpp", "container"), ("vllm", "container"))
STARTING, READY, FAILED, STOPPED = (
    InstanceState.STARTING,
    InstanceState.READY,
    InstanceState.FAILED,
    InstanceState.STOPPED,
)


class ContainerRuntime(ContainerAdoption):
    """Every container instance of this agent, and the supervisor task of each."""

    def __init__(
        self,
        *,
        config: AgentConfig,
        bus: EventBus,
        check_gpus: Callable[[tuple[str, ...]], Awaitable[None]],
        epoch: Callable[[], int | None],
        ready_poll_interval: float = 0.5,
        stop_grace_seconds: float = 10.0,
        watch_interval: float = 2.0,
    ) -> None:
        """``check_gpus`` refuses GPU UUIDs the node lacks (the process runtime's rule);
        ``epoch`` is the accepted master epoch, written on every container's labels."""
        self._config = config
        self._bus = bus
        self._check_gpus = check_gpus
        self._epoch = epoch
        self._poll = ready_poll_interval
        self._grace = stop_grace_seconds
        self._watch = watch_interval
        self.docker = DockerGateway(
            endpoint=config.docker_endpoint, call_timeout=config.docker_call_timeout_seconds
        )
        self._ports = PortAllocator(start=config.port_range_start, end=config.port_range_end)
        self._instances: dict[str, ContainerInstance] = {}
        self._launch_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._state_file = config.state_directory / RECORDS_FILE
        self._log_dir = config.state_directory / "logs"
        self._reconciled = asyncio.Event()
        self._connector: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Load the records, then wait for Docker and reconcile in the background."""
        self._log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=5), connector=aiohttp.TCPConnector(force_close=True)
        )
        for record in read_records(self._state_file):
            inst = instance_from_record(record, self._state_file)
            if inst is not None:
                self._instances[inst.instance_id] = inst
        self._connector = asyncio.create_task(self._connect(), name="docker-connect")

    async def _connect(self) -> None:
        """Wait for the daemon (DockerStartupTimeoutSeconds), then reconcile once it answers."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.docker_startup_timeout_seconds
        warned = False
        while True:
            try:
                await self.docker.ping()
                break
            except DockerUnavailable as exc:
                if not warned and loop.time() >= deadline:
                    log.warning(
                        "%s; reconciling when it answers (launches fail docker_unavailable "
                        "until then)",
                        exc.message,
                    )
                    warned = True
                await asyncio.sleep(1.0 if not warned else 5.0)
        try:
            await self._reconcile()
        except Exception:
            log.exception("Reconciling the containers failed")
        finally:
            self._reconciled.set()

    async def close(self, *, stop_instances: bool = True) -> None:
        """Stop every container, or leave them running for the next agent to adopt."""
        if self._connector is not None:
            self._connector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connector
        if stop_instances:
            active = [i for i in self._instances.values() if i.state in (STARTING, READY)]
            await asyncio.gather(
                *(self.stop(i.instance_id) for i in active), return_exceptions=True
            )
        for inst in self._instances.values():
            if inst.task is not None:
                inst.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await inst.task
                inst.task = None
        self._persist_quietly()
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.docker.close()

    # -- queries ---------------------------------------------------------------------

    def list(self) -> builtins.list[dict[str, Any]]:
        return [i.to_json() for i in self._instances.values()]

    def has(self, instance_id: str) -> bool:
        return instance_id in self._instances

    def get(self, instance_id: str) -> ContainerInstance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise NotFound(f"instance {instance_id!r} does not exist on this node") from None

    def upstream_host(self, inst: ContainerInstance) -> tuple[str, int]:
        """Where the proxy reaches the engine: the published port, or the network name."""
        if self._config.docker_network:
            return container_name(inst.instance_id), CONTAINER_PORT
        assert inst.port is not None
        return "127.0.0.1", inst.port

    def upstream(self, instance_id: str) -> ContainerInstance:
        """The instance to proxy to; raises NotFound or ModelNotRunning."""
        inst = self.get(instance_id)
        if inst.state != READY:
            raise ModelNotRunning(
                f"model {inst.spec.served_name!r} (instance {instance_id}) is {inst.state}, not Ready"
            )
        return inst

    # -- persistence and events ------------------------------------------------------

    def _persist(self) -> None:
        write_records(self._state_file, self._instances.values())

    def _persist_quietly(self) -> None:
        try:
            self._persist()
        except StateUnavailable as exc:
            log.error("%s", exc.message)

    def _changed(self, inst: ContainerInstance) -> None:
        self._persist_quietly()
        self._bus.publish("instance", inst.to_json())

    # -- launch ----------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> dict[str, Any]:
        """Check a container launch, record it Starting and hand it to its supervisor.

        Everything that can refuse the spec runs before anything is created; the image
        pull, the container's creation and the Ready wait happen in the supervisor.
        """
        check_runtime(spec, CONTAINER_OFFERS)
        assert spec.container is not None
        check_container(spec.container)
        check_image_policy(
            spec.container.image,
            approved=self._config.approved_images,
            allow_tags=self._config.allow_tag_pulls,
        )
        alias = check_args(spec.args, engine=spec.runtime, delivery="container")
        check_env(spec.env, None, self._config.engine_env_allow, engine=spec.runtime)
        for name, _ in spec.env:
            if name in KEY_VARIABLES.values():
                raise SpecRejected(
                    f"env {name} is refused: the agent sets the engine's key itself",
                    details={"flag": name},
                )
        model_bindings(self._config, spec.container, spec.model_folder, spec.model_file)
        if spec.gpu_uuids:
            await self._check_gpus(spec.gpu_uuids)
        await self.docker.ping()
        try:
            await asyncio.wait_for(
                self._reconciled.wait(), self._config.docker_call_timeout_seconds
            )
        except TimeoutError:
            raise DockerUnavailable(
                "the agent is still reconciling its containers with the Docker engine; retry"
            ) from None
        async with self._launch_lock:
            current = self._instances.get(spec.instance_id)
            if current is not None and current.state in (STARTING, READY):
                if current.spec == spec:
                    return current.to_json()
                raise Conflict(
                    f"instance {spec.instance_id!r} is {current.state} with another spec; stop it first"
                )
            if current is not None and current.task is not None:
                await current.task
            inst = ContainerInstance(spec=spec, alias=alias)
            if not self._config.docker_network:
                inst.port = await self._ports.reserve()
            self._instances[spec.instance_id] = inst
            try:
                self._persist()
            except StateUnavailable:
                self._ports.release(inst.port)
                if current is not None:
                    self._instances[spec.instance_id] = current
                else:
                    del self._instances[spec.instance_id]
                raise
            inst.task = asyncio.create_task(self._run(inst), name=f"container-{inst.instance_id}")
            self._bus.publish("instance", inst.to_json())
            return inst.to_json()

    def _create_kwargs(self, inst: ContainerInstance) -> dict[str, Any]:
        return container_definition(self._config, inst, self._epoch())

    # -- the supervisor --------------------------------------------------------------

    async def _run(self, inst: ContainerInstance) -> None:
        """Pull, create and start the container, then supervise it."""
        try:
            await self._ensure_image(inst)
            await self._remove_named(inst)
            kwargs = self._create_kwargs(inst)
            container = await self.docker.call(
                lambda: self.docker.client.containers.create(**kwargs)
            )
            async with inst.lock:
                if inst.stopping:
                    await self._remove(str(container.id))
                    return
                inst.container_id = str(container.id)
                self._persist_quietly()
            await self._start_container(inst)
            await self._supervise(inst)
        except asyncio.CancelledError:
            raise
        except DockerRefused as exc:
            await self._fail(inst, f"the container could not be started: {exc.explanation}", None)
        except DockerUnavailable as exc:
            await self._fail(inst, f"the container could not be started: {exc.message}", None)
        except Exception as exc:
            log.exception("The supervisor of %s crashed", inst.instance_id)
            await self._fail(inst, f"the agent's supervisor failed: {exc}", None)

    async def _ensure_image(self, inst: ContainerInstance) -> None:
        await ensure_image(self.docker, self._bus, inst)

    async def _remove_named(self, inst: ContainerInstance) -> None:
        """Remove a leftover container of this instance's name, if the labels say it is ours."""
        name = container_name(inst.instance_id)
        try:
            old = await self.docker.call(lambda: self.docker.client.containers.get(name))
        except NotThere:
            return
        labels = old.labels or {}
        if labels.get(LABELS["node"]) != self._config.node_id:
            raise DockerRefused(
                409, f"a container named {name} exists and is not this node's; remove it"
            )
        await self._remove(str(old.id))

    async def _start_container(self, inst: ContainerInstance) -> None:
        """Start (or restart) the created container and follow its output into the log."""
        assert inst.container_id is not None
        cid = inst.container_id
        path = engine_log_path(self._config.state_directory, inst.instance_id)
        header = f"agent: starting container {container_name(inst.instance_id)} from {inst.image}"
        handle, inst.log_offset = await asyncio.to_thread(open_log, path, header)
        handle.close()
        since = int(time.time())
        await self.docker.call(lambda: self.docker.client.containers.get(cid).start())
        inst.state = STARTING
        inst.ready_at = None
        inst.exit_code = None
        inst.error = None
        inst.log_tail = []
        inst.started_at = time.time()
        await self._refresh_pid(inst)
        self._follow(inst, since)
        log.info("Started container %s for %s", cid[:12], inst.instance_id)
        self._changed(inst)

    async def _refresh_pid(self, inst: ContainerInstance) -> None:
        """The engine's host pid (for the telemetry sampler), where the engine reports one."""
        cid = inst.container_id
        if cid is None:
            return
        with contextlib.suppress(DockerRefused, DockerUnavailable):
            attrs = await self.docker.call(lambda: self.docker.client.api.inspect_container(cid))
            pid = (attrs.get("State") or {}).get("Pid")
            inst.pid = pid if isinstance(pid, int) and pid > 0 else None

    def _follow(self, inst: ContainerInstance, since: int) -> None:
        """Copy the container's output into the engine log on a daemon thread of its own."""
        cid = inst.container_id
        assert cid is not None
        path = engine_log_path(self._config.state_directory, inst.instance_id)

        def copy() -> None:
            try:
                stream = self.docker.long_client.api.logs(
                    cid, stream=True, follow=True, since=since
                )
                with EngineLogWriter(path) as handle:  # a full disk drops chunks, not the relay
                    for chunk in stream:
                        handle.write(chunk)
            except Exception as exc:  # the container went, or Docker did: the log just ends
                log.debug("Log follower of %s ended: %s", cid, exc)

        thread = threading.Thread(target=copy, name=f"logs-{inst.instance_id}", daemon=True)
        thread.start()
        inst.follower = thread

    async def _inspect_state(self, inst: ContainerInstance) -> tuple[bool, int | None]:
        """(running, exit code) of the instance's container; NotThere when it is gone."""
        cid = inst.container_id
        if cid is None:
            raise NotThere(404, f"instance {inst.instance_id} has no container")
        attrs = await self.docker.call(lambda: self.docker.client.api.inspect_container(cid))
        state = attrs.get("State") or {}
        code = state.get("ExitCode")
        return bool(state.get("Running")), code if isinstance(code, int) else None

    async def _wait_ready(self, inst: ContainerInstance) -> tuple[str, int | None]:
        """ "ready", ("exited", code) or "timeout"."""
        assert self._session is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.process_start_timeout_seconds
        host, port = self.upstream_host(inst)
        base = f"http://{host}:{port}"
        while True:
            if await engine_ready(self._session, base, key=inst.key, alias=inst.alias):
                return "ready", None
            try:
                running, code = await self._inspect_state(inst)
            except NotThere:
                return "exited", None
            except DockerUnavailable:
                running, code = True, None  # cannot tell: keep waiting until the deadline
            if not running:
                return "exited", code
            if loop.time() >= deadline:
                return "timeout", None
            await asyncio.sleep(self._poll)

    async def _supervise(self, inst: ContainerInstance) -> None:
        """Wait for Ready, then watch for the exit and restart within budget."""
        while True:
            outcome, code = await self._wait_ready(inst)
            async with inst.lock:
                if inst.stopping:
                    return
                if outcome == "exited":
                    await self._fail(
                        inst, f"the engine's container {exit_text(code)} before it was ready", code
                    )
                    return
                if outcome == "timeout":
                    await self._fail(
                        inst,
                        "the engine was not ready after "
                        f"{self._config.process_start_timeout_seconds:g} s "
                        "(ProcessStartTimeoutSeconds); its container was removed",
                        None,
                    )
                    return
                inst.state = READY
                inst.ready_at = time.time()
                log.info(
                    "Instance %s is Ready (container %s)%s",
                    inst.instance_id,
                    (inst.container_id or "")[:12],
                    " (adopted)" if inst.adopted else "",
                )
                self._changed(inst)
            code = await self._wait_exit(inst)
            async with inst.lock:
                if inst.stopping:
                    return
                now = time.monotonic()
                window = self._config.restart_window_seconds
                while inst.restarts and inst.restarts[0] < now - window:
                    inst.restarts.popleft()
                if len(inst.restarts) >= self._config.restart_budget:
                    await self._fail(
                        inst,
                        f"the engine's container {exit_text(code)} after it was ready; it "
                        f"already restarted {len(inst.restarts)} times in the last {window:g} s "
                        "(RestartBudget)",
                        code,
                    )
                    return
                inst.restarts.append(now)
                inst.restart_count += 1
                log.warning(
                    "Instance %s: its container %s after it was ready; restarting (%d of %d)",
                    inst.instance_id,
                    exit_text(code),
                    len(inst.restarts),
                    self._config.restart_budget,
                )
                inst.adopted = False
                # Starting from here on: the count and the state change in one event, so
                # nobody sees the old Ready beside the new restart count.
                inst.state = STARTING
                inst.ready_at = None
                self._changed(inst)
                await self._start_container(inst)

    async def _wait_exit(self, inst: ContainerInstance) -> int | None:
        """Poll the container (bounded calls) until it is no longer running."""
        unreachable = False
        while True:
            await asyncio.sleep(self._watch)
            try:
                running, code = await self._inspect_state(inst)
            except NotThere:
                return None
            except DockerUnavailable as exc:
                if not unreachable:
                    log.warning("Watching %s: %s", inst.instance_id, exc.message)
                unreachable = True
                continue
            unreachable = False
            if not running:
                return code

    async def _fail(self, inst: ContainerInstance, error: str, exit_code: int | None) -> None:
        """Failed, with the container's last lines; the container is removed first, so a
        reader that sees Failed never finds the container still there."""
        path = engine_log_path(self._config.state_directory, inst.instance_id)
        if inst.follower is not None:
            await asyncio.to_thread(inst.follower.join, 2.0)
        if inst.container_id is not None:
            with contextlib.suppress(DockerRefused, DockerUnavailable):
                await self._remove(inst.container_id)
            inst.container_id = None
        inst.state = FAILED
        inst.error = error
        inst.exit_code = exit_code
        inst.log_tail = await asyncio.to_thread(read_log_tail, path, inst.log_offset)
        inst.pid = None
        inst.pulling = None
        self._ports.release(inst.port)
        log.error("Instance %s failed: %s", inst.instance_id, error)
        self._changed(inst)

    async def _remove(self, container_id: str) -> None:
        """Stop (SIGTERM, the grace period, then SIGKILL) and remove a container."""
        grace = int(self._grace)

        def stop_and_remove() -> None:
            try:
                container = self.docker.client.containers.get(container_id)
            except docker.errors.NotFound:
                return
            with contextlib.suppress(docker.errors.APIError):
                container.stop(timeout=grace)
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass

        await self.docker.call(stop_and_remove)

    # -- stop and delete -------------------------------------------------------------

    async def stop(self, instance_id: str) -> dict[str, Any]:
        """Stop and remove the container; the instance ends Stopped.

        With Docker down the stop is refused (503 docker_unavailable) and nothing
        changes: the engine may still run, so the instance must not claim otherwise.
        """
        inst = self.get(instance_id)
        async with inst.lock:
            if inst.state == STOPPED:
                return inst.to_json()
            inst.stopping = True
            if inst.container_id is not None:
                try:
                    await self._remove(inst.container_id)
                except DockerUnavailable:
                    inst.stopping = False
                    raise
            task, inst.task = inst.task, None
            if task is not None and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            log.info("Stopped %s (container %s)", instance_id, (inst.container_id or "")[:12])
            inst.state = STOPPED
            inst.container_id = None
            inst.pid = None
            inst.pulling = None
            inst.error = None
            inst.log_tail = []
            inst.stopping = False
            self._ports.release(inst.port)
            self._changed(inst)
            return inst.to_json()

    async def delete(self, instance_id: str) -> None:
        """Stop the instance if needed and forget it."""
        async with self._launch_lock:
            await self.stop(instance_id)
            self._instances.pop(instance_id, None)
            self._persist_quietly()
