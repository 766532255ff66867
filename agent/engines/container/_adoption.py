"""Adoption after an agent restart: the part of the container runtime that reads labels.

A running container that ``containers.json`` describes (same container id) is adopted
as it runs: same port, same key, supervised again without a restart. A record whose
container is gone or stopped reads Stopped (its container, if any, removed). A
container labelled as this node's that no record describes (the agent died between
creating it and recording its id) is stopped and removed; a container without this
node's label is never touched (docs/agent.md, "Containers").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from agent._errors import DockerUnavailable
from agent.engines.container._docker import DockerGateway, DockerRefused
from agent.engines.container._instance import LABELS, ContainerInstance
from agent.engines.process._handle import PortAllocator, engine_log_path
from protocol.states import InstanceState

if TYPE_CHECKING:
    from agent._config import AgentConfig

__all__ = ["GONE_ERROR", "UNDESCRIBED_ERROR", "ContainerAdoption"]

log = logging.getLogger("mirbad.agent.container")

GONE_ERROR = "The engine's container was gone after the agent restarted."
UNDESCRIBED_ERROR = "The agent restarted while it was creating the container; it was removed."
STARTING, STOPPED = InstanceState.STARTING, InstanceState.STOPPED


class ContainerAdoption:
    """Mixed into ContainerRuntime, whose state it uses (declared here for the reader)."""

    _config: AgentConfig
    docker: DockerGateway
    _ports: PortAllocator
    _instances: dict[str, ContainerInstance]

    def _changed(self, inst: ContainerInstance) -> None:
        raise NotImplementedError

    async def _remove(self, container_id: str) -> None:
        raise NotImplementedError

    async def _refresh_pid(self, inst: ContainerInstance) -> None:
        raise NotImplementedError

    def _follow(self, inst: ContainerInstance, since: int) -> None:
        raise NotImplementedError

    async def _supervise(self, inst: ContainerInstance) -> None:
        raise NotImplementedError

    async def _fail(self, inst: ContainerInstance, error: str, exit_code: int | None) -> None:
        raise NotImplementedError

    async def _reconcile(self) -> None:
        """Adopt the recorded containers that still run; remove ours that nobody describes."""
        node = self._config.node_id
        found = await self.docker.call(
            lambda: self.docker.client.containers.list(
                all=True, filters={"label": f"{LABELS['node']}={node}"}
            )
        )
        by_id = {str(c.id): c for c in found}
        described: set[str] = set()
        for inst in list(self._instances.values()):
            if inst.state != STARTING:
                continue
            container = by_id.get(inst.container_id or "")
            if container is not None and container.status == "running":
                described.add(str(container.id))
                await self._adopt(inst)
                continue
            if container is not None:
                described.add(str(container.id))
                with contextlib.suppress(DockerRefused, DockerUnavailable):
                    await self._remove(str(container.id))
            inst.state = STOPPED
            inst.error = GONE_ERROR if inst.container_id else UNDESCRIBED_ERROR
            inst.container_id = None
            inst.pid = None
            self._changed(inst)
        for container in found:
            cid = str(container.id)
            if cid in described:
                continue
            log.warning(
                "Removing container %s (%s): labelled as node %s's, but no record describes it",
                container.name,
                cid[:12],
                node,
            )
            with contextlib.suppress(DockerRefused, DockerUnavailable):
                await self._remove(cid)

    async def _adopt(self, inst: ContainerInstance) -> None:
        """Supervise a running container of the previous agent as it runs (no restart)."""
        inst.adopted = True
        if inst.port is not None:
            self._ports.claim(inst.port)
        path = engine_log_path(self._config.state_directory, inst.instance_id)
        inst.log_offset = path.stat().st_size if path.exists() else 0
        await self._refresh_pid(inst)
        self._follow(inst, int(time.time()))
        log.info("Adopting container %s of %s", (inst.container_id or "")[:12], inst.instance_id)
        self._changed(inst)
        inst.task = asyncio.create_task(
            self._supervise_adopted(inst), name=f"container-{inst.instance_id}"
        )

    async def _supervise_adopted(self, inst: ContainerInstance) -> None:
        try:
            await self._supervise(inst)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("The supervisor of %s crashed", inst.instance_id)
            await self._fail(inst, f"the agent's supervisor failed: {exc}", None)
