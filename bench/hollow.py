"""Hollow agents: the real agent with a stand-in engine runtime, many in one process.

A hollow agent is :class:`agent.http.AgentServer` itself (its TLS listener and client
certificate check, the contract's endpoints, the event stream, telemetry, health, the
operation log and the fencing record, each in its own state directory) with one part
replaced: :class:`HollowRuntime` stands in for the engine runtimes. A launch is checked
as the process runtime checks it (the spec, the runtime offered, the engine flags'
allow-list, the environment, the model file under ModelsRoot, the executable in the
catalogue), then the instance goes Starting, and Ready ``ready_after`` seconds later
with a measured memory figure, without starting a process. Stop and delete behave as
the real runtime's.

Like Kubernetes' kubemark it exercises the master exactly as real agents do (each node
enrolled with a join token, approved, followed by the monitor); it is a measuring tool
for ``bench/fleet.py`` and never stands in for a real agent in the e2e tests
(docs/performance.md, "A fleet of a thousand machines").

Run as a worker (``python bench/hollow.py worker SPEC.json``), it enrolls the nodes the
spec lists that have no identity yet, serves them all on one event loop and takes
commands as JSON lines on stdin, answering each with one JSON line on stdout:

- ``{"cmd": "kill", "node": ID}``: the node's listener and connections are dropped at
  once, as when its process dies; answers ``{"ok": true, "at": UNIX_TIME}``.
- ``{"cmd": "rss"}``: ``{"ok": true, "rssBytes": N}``, this worker's resident memory.
- ``{"cmd": "stop"}`` (or the end of stdin): every node stops, then the worker exits.

The first line it prints is ``{"ready": N, "enrollSeconds": S, "startSeconds": S}``
once every node listens.
"""

from __future__ import annotations

import argparse
import asyncio
import builtins
import concurrent.futures
import contextlib
import json
import logging
import resource
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent._config import AgentConfig, load_config  # noqa: E402
from agent._errors import Conflict, ModelNotRunning, NotFound  # noqa: E402
from agent.engines import Catalogue  # noqa: E402
from agent.engines._executables import write_manifest  # noqa: E402
from agent.engines._measure import Measured  # noqa: E402
from agent.engines._spec import (  # noqa: E402
    check_args,
    check_env,
    check_runtime,
    parse_launch_spec,
    resolve_model_path,
)
from agent.engines.process._instance import READY, STARTING, STOPPED, Instance  # noqa: E402
from agent.engines.process._runtime import PROCESS_OFFERS  # noqa: E402
from agent.http import AgentServer  # noqa: E402
from agent.identity import join, load_identity  # noqa: E402
from agent.identity._tls import has_identity  # noqa: E402
from agent.state import EventBus  # noqa: E402
from agent.telemetry import GpuSampler, _describe  # noqa: E402
from protocol.tinygguf import write_tiny_gguf  # noqa: E402

__all__ = ["HollowRuntime", "Worker", "hollow_server", "prepare_shared", "write_agent_config"]

log = logging.getLogger("mirbad.bench.hollow")

ENGINE_VERSION = "0.6.0-dev"
DEFAULT_RSS = 3 * 2**30  # what a 7B GGUF at Q4 holds once loaded, about
SAMPLE_SECONDS = 30.0  # the host sample and the health check of each hollow node


class HollowRuntime:
    """The engine runtimes' face (``agent.engines.Runtimes``) with no process behind it."""

    container = None  # no container runtime: the node offers llama.cpp processes only

    def __init__(
        self,
        *,
        config: AgentConfig,
        catalogue: Catalogue,
        bus: EventBus,
        gpus: GpuSampler,
        ready_after: float = 0.5,
        rss_bytes: int = DEFAULT_RSS,
    ) -> None:
        self._config = config
        self._catalogue = catalogue
        self._bus = bus
        self._gpus = gpus
        self._ready_after = ready_after
        self._rss = rss_bytes
        self._instances: dict[str, Instance] = {}
        self._next_port = config.port_range_start

    @property
    def gpus(self) -> GpuSampler:
        return self._gpus

    @property
    def offers(self) -> tuple[tuple[str, str], ...]:
        return PROCESS_OFFERS

    async def start(self) -> None:
        """Nothing to adopt: a hollow node starts without instances."""

    async def close(self, *, stop_instances: bool = True) -> None:
        for inst in self._instances.values():
            if inst.task is not None:
                inst.task.cancel()
                inst.task = None
            if stop_instances:
                inst.state = STOPPED

    def list(self) -> builtins.list[dict[str, Any]]:
        return [i.to_json() for i in self._instances.values()]

    def get(self, instance_id: str) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise NotFound(f"instance {instance_id!r} does not exist on this node") from None

    def address(self, instance_id: str) -> tuple[str, int, Instance]:
        inst = self.get(instance_id)
        raise ModelNotRunning(
            f"model {inst.spec.served_name!r} (instance {instance_id}) runs on a hollow "
            "agent, which serves no requests"
        )

    async def launch(self, body: Any) -> dict[str, Any]:
        """The process runtime's checks, then Starting, then Ready after ``ready_after``."""
        spec = parse_launch_spec(body)
        check_runtime(spec, PROCESS_OFFERS)
        alias = check_args(spec.args, spec.executable_version)
        check_env(spec.env, spec.executable_version, self._config.engine_env_allow)
        model_path = resolve_model_path(
            self._config.models_root_path, spec.model_folder, spec.model_file
        )
        exe = self._catalogue.resolve(spec.executable_name, spec.executable_version)
        current = self._instances.get(spec.instance_id)
        if current is not None and current.state in (STARTING, READY):
            if current.spec == spec:
                return current.to_json()
            raise Conflict(
                f"instance {spec.instance_id!r} is {current.state} with another spec; stop it first"
            )
        inst = Instance(spec=spec, executable=exe, alias=alias, model_path=model_path)
        inst.port = self._next_port
        self._next_port += 1
        inst.started_at = time.time()
        self._instances[spec.instance_id] = inst
        self._bus.publish("instance", inst.to_json())
        inst.task = asyncio.create_task(self._become_ready(inst))
        return inst.to_json()

    async def _become_ready(self, inst: Instance) -> None:
        await asyncio.sleep(self._ready_after)
        if inst.state != STARTING:
            return
        now = time.time()
        inst.state = READY
        inst.ready_at = now
        inst.measured = Measured(kind="rss", bytes=self._rss, at=now, peak_bytes=self._rss)
        inst.task = None
        self._bus.publish("instance", inst.to_json())

    async def stop(self, instance_id: str) -> dict[str, Any]:
        inst = self.get(instance_id)
        if inst.state == STOPPED:
            return inst.to_json()
        if inst.task is not None:
            inst.task.cancel()
            inst.task = None
        inst.state = STOPPED
        inst.measured = None
        inst.port = None
        self._bus.publish("instance", inst.to_json())
        return inst.to_json()

    async def delete(self, instance_id: str) -> None:
        await self.stop(instance_id)
        self._instances.pop(instance_id, None)


def hollow_server(
    config: AgentConfig, *, ready_after: float = 0.5, rss_bytes: int = DEFAULT_RSS
) -> AgentServer:
    """The agent's own server for ``config``'s enrolled identity, its runtime hollow."""
    identity = load_identity(config.state_directory, node_id=config.node_id)
    # The master still pulls /telemetry every 5 s and gets heartbeats every 5 s; only the
    # node's own host sample is refreshed every 30 s: a thousand stand-ins share two
    # cores with the master they are there to measure.
    server = AgentServer(config=config, identity=identity, telemetry_interval=SAMPLE_SECONDS)
    server.runtime = HollowRuntime(  # type: ignore[assignment]  # the same face, duck-typed
        config=config,
        catalogue=server.catalogue,
        bus=server.bus,
        gpus=server.runtime.gpus,
        ready_after=ready_after,
        rss_bytes=rss_bytes,
    )
    return server


def kill(server: AgentServer) -> None:
    """Drop the node off the network at once: no drain, no last events (a dead process)."""
    front = server._front
    if front is not None:
        if front._server is not None:
            front._server.close()
            front._server = None
        for conn in list(front.connections):
            conn.abort()
    runner = server._runner
    if runner is not None and runner.server is not None:
        for handler in list(runner.server.connections):
            transport = handler.transport
            if transport is not None:
                transport.abort()


def prepare_shared(folder: Path) -> tuple[Path, Path]:
    """The engine the hollow nodes list (never run) and the models root they share.

    Returns (the engine's path, the models root with ``tiny/tiny.gguf``)."""
    engine_dir = folder / "engine" / "llama.cpp" / ENGINE_VERSION
    engine = engine_dir / "llama-server"
    if not engine.exists():
        engine_dir.mkdir(parents=True, exist_ok=True)
        engine.write_text("#!/bin/sh\necho 'a hollow agent never runs its engine' >&2\nexit 1\n")
        engine.chmod(0o755)
        write_manifest(engine_dir, name="llama.cpp", version=ENGINE_VERSION)
    models = folder / "models"
    if not (models / "tiny" / "tiny.gguf").exists():
        write_tiny_gguf(models / "tiny" / "tiny.gguf")
    return engine, models


def write_agent_config(
    folder: Path, *, node_id: str, ip: str, port: int, engine: Path, models: Path
) -> Path:
    """The node's agent.json, as an operator writes it (read back through load_config)."""
    node_dir = folder / node_id
    node_dir.mkdir(parents=True, exist_ok=True)
    path = node_dir / "agent.json"
    path.write_text(
        json.dumps(
            {
                "NodeId": node_id,
                "StateDirectory": str(node_dir / "state"),
                "ListenAddress": ip,
                "Port": port,
                "ModelsRoot": str(models),
                "StopInstancesOnShutdown": True,
                "HealthCheckIntervalSeconds": SAMPLE_SECONDS,
                "Executables": [
                    {
                        "Name": "llama.cpp",
                        "Version": ENGINE_VERSION,
                        "Path": str(engine),
                        "Default": True,
                    }
                ],
            }
        )
    )
    return path


class Worker:
    """One worker process serving some hollow nodes, driven over its stdin and stdout."""

    def __init__(
        self,
        *,
        folder: Path,
        nodes: builtins.list[dict[str, Any]],
        log_path: Path,
        ready_after: float = 0.5,
        env: dict[str, str] | None = None,
    ) -> None:
        """``nodes``: each ``{"nodeId", "ip", "port"}`` plus, to enroll it, the answer of
        ``POST /api/join-tokens`` (``enrollUrl``, ``caHash``, ``token``)."""
        self.folder = folder
        self.nodes = nodes
        self.log_path = log_path
        self.ready_after = ready_after
        self.env = env
        self.process: subprocess.Popen[str] | None = None
        self.started: dict[str, Any] = {}

    def start(self, timeout: float = 600.0) -> dict[str, Any]:
        """Spawn the worker and wait for its ready line (enrollment included)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        spec = self.folder / f"worker-{self.nodes[0]['nodeId']}.json"
        spec.write_text(
            json.dumps(
                {"folder": str(self.folder), "nodes": self.nodes, "readyAfter": self.ready_after}
            )
        )
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "worker", str(spec)],
            cwd=ROOT, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, text=True, bufsize=1,
        )  # fmt: skip
        log.close()
        self.started = self._read(timeout)
        if "ready" not in self.started:
            raise RuntimeError(f"hollow worker answered {self.started} (log: {self.log_path})")
        return self.started

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise RuntimeError(f"hollow worker silent for {timeout:.0f} s (log: {self.log_path})")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(
                f"hollow worker exited ({self.process.poll()}); log: {self.log_path}"
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    def command(self, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps(body) + "\n")
        self.process.stdin.flush()
        answer = self._read(timeout)
        if not answer.get("ok"):
            raise RuntimeError(f"hollow worker refused {body}: {answer}")
        return answer

    def kill_node(self, node_id: str) -> float:
        """Drop ``node_id`` off the network; returns when (UNIX time)."""
        return float(self.command({"cmd": "kill", "node": node_id})["at"])

    def rss(self) -> int:
        return int(self.command({"cmd": "rss"})["rssBytes"])

    def stop(self, timeout: float = 60.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


# -- the worker ----------------------------------------------------------------------


def _enroll(node: dict[str, Any], config: AgentConfig) -> None:
    join(
        enroll_url=node["enrollUrl"],
        ca_hash=node["caHash"],
        node_id=config.node_id,
        state_dir=config.state_directory,
        addresses=[f"https://{config.listen_address}:{config.port}"],
        token=node["token"],
    )


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _no_gpus(timeout: float = 10.0) -> tuple[builtins.list[dict[str, Any]], str | None]:
    return [], _describe.NVIDIA_SMI_ABSENT


async def _worker(spec: dict[str, Any]) -> None:
    # The stand-in hardware has no GPU. The real probe (NVML, then nvidia-smi) starts a
    # thread per call; hundreds of nodes in one process probing every 5 s wedged the
    # probe's single slot ("NVML has not answered") and held the /info answers.
    _describe.probe_gpus = _no_gpus
    folder = Path(spec["folder"])
    engine, models = prepare_shared(folder)
    configs: dict[str, AgentConfig] = {}
    to_enroll: list[tuple[dict[str, Any], AgentConfig]] = []
    for node in spec["nodes"]:
        path = write_agent_config(
            folder,
            node_id=node["nodeId"],
            ip=node["ip"],
            port=node["port"],
            engine=engine,
            models=models,
        )
        config = load_config(path, environ={})
        configs[config.node_id] = config
        if not has_identity(config.state_directory) and node.get("token"):
            to_enroll.append((node, config))
    began = time.monotonic()
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        await asyncio.gather(*(loop.run_in_executor(pool, _enroll, n, c) for n, c in to_enroll))
    enrolled = time.monotonic() - began
    servers: dict[str, AgentServer] = {}
    began = time.monotonic()
    for config in configs.values():
        server = hollow_server(
            config,
            ready_after=float(spec.get("readyAfter", 0.5)),
            rss_bytes=int(spec.get("rssBytes", DEFAULT_RSS)),
        )
        await server.start()
        servers[config.node_id] = server
    _say(
        {
            "ready": len(servers),
            "enrollSeconds": round(enrolled, 2),
            "startSeconds": round(time.monotonic() - began, 2),
        }
    )
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            try:
                command = json.loads(line)
            except ValueError:
                _say({"ok": False, "error": "not a JSON line"})
                continue
            cmd = command.get("cmd")
            if cmd == "stop":
                break
            if cmd == "rss":
                _say({"ok": True, "rssBytes": psutil.Process().memory_info().rss})
            elif cmd == "kill" and command.get("node") in servers:
                kill(servers[command["node"]])
                _say({"ok": True, "at": time.time()})
            else:
                _say(
                    {
                        "ok": False,
                        "error": f"unknown command {line.decode(errors='replace')[:100]!r}",
                    }
                )
    finally:
        await asyncio.gather(*(s.stop() for s in servers.values()), return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker", help="enroll and serve the nodes of SPEC.json")
    worker.add_argument("spec", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    spec = json.loads(args.spec.read_text())
    # A worker holds two sockets per node and the monitor's connections: lift the cap.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_worker(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
