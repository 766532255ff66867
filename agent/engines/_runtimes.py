"""One face over the node's runtimes: each launch goes to the driver of its delivery.

The process runtime is always there; the container runtime only on a node with
``DockerEnabled`` (docs/agent.md, "Containers"). Instance ids are unique across both:
a launch whose id the other runtime holds is a 409 until that instance is deleted.
"""

from __future__ import annotations

import builtins
from typing import Any

from agent._errors import Conflict, NotFound, SpecRejected
from agent.engines._spec import parse_launch_spec
from agent.engines.container import CONTAINER_OFFERS, ContainerRuntime
from agent.engines.container._instance import ContainerInstance
from agent.engines.process import ProcessRuntime
from agent.engines.process._instance import Instance
from agent.engines.process._runtime import PROCESS_OFFERS
from agent.telemetry import GpuSampler
from protocol.states import ACTIVE

__all__ = ["Runtimes"]


class Runtimes:
    """The process runtime and, where enabled, the container runtime."""

    def __init__(self, *, process: ProcessRuntime, container: ContainerRuntime | None) -> None:
        self.process = process
        self.container = container

    @property
    def gpus(self) -> GpuSampler:
        """The node's GPU sampler (the process runtime owns it; containers share it)."""
        return self.process.gpus

    @property
    def offers(self) -> tuple[tuple[str, str], ...]:
        """Every (runtime, delivery) this node can launch."""
        return PROCESS_OFFERS + (CONTAINER_OFFERS if self.container is not None else ())

    async def start(self) -> None:
        await self.process.start()
        if self.container is not None:
            await self.container.start()

    async def close(self, *, stop_instances: bool = True) -> None:
        if self.container is not None:
            await self.container.close(stop_instances=stop_instances)
        await self.process.close(stop_instances=stop_instances)

    def list(self) -> builtins.list[dict[str, Any]]:
        items = self.process.list()
        if self.container is not None:
            items += self.container.list()
        return items

    def get(self, instance_id: str) -> Instance | ContainerInstance:
        if self.container is not None and self.container.has(instance_id):
            return self.container.get(instance_id)
        return self.process.get(instance_id)

    def address(self, instance_id: str) -> tuple[str, int, Instance | ContainerInstance]:
        """Where the proxy reaches a Ready instance: (host, port, instance)."""
        if self.container is not None and self.container.has(instance_id):
            inst = self.container.upstream(instance_id)
            host, port = self.container.upstream_host(inst)
            return host, port, inst
        process = self.process.upstream(instance_id)
        assert process.port is not None
        return "127.0.0.1", process.port, process

    async def launch(self, body: Any) -> dict[str, Any]:
        """Launch on the runtime of the spec's delivery.

        A model whose delivery changed keeps its instance id: the other runtime's
        record of it is dropped when that instance no longer runs, and refused (409)
        while it does.
        """
        spec = parse_launch_spec(body)
        if spec.delivery == "container":
            if self.container is None:
                raise SpecRejected(
                    "delivery 'container' is not offered by this agent: its DockerEnabled is "
                    'false (docs/agent.md, "Containers")',
                    details={"field": "delivery"},
                )
            await self._leave(self.process, spec.instance_id, "a process")
            return await self.container.launch(spec)
        if self.container is not None:
            await self._leave(self.container, spec.instance_id, "a container")
        return await self.process.launch(body)

    @staticmethod
    async def _leave(other: ProcessRuntime | ContainerRuntime, instance_id: str, kind: str) -> None:
        """Forget ``instance_id`` in ``other`` if it has it and it does not run there."""
        try:
            current = other.get(instance_id)
        except NotFound:
            return
        if current.state in ACTIVE:
            raise Conflict(
                f"instance {instance_id!r} runs as {kind} ({current.state}); stop it first"
            )
        await other.delete(instance_id)

    async def stop(self, instance_id: str) -> dict[str, Any]:
        if self.container is not None and self.container.has(instance_id):
            return await self.container.stop(instance_id)
        return await self.process.stop(instance_id)

    async def delete(self, instance_id: str) -> None:
        if self.container is not None and self.container.has(instance_id):
            await self.container.delete(instance_id)
            return
        await self.process.delete(instance_id)
