"""Stopping the containers a dead agent left behind, from its own ``containers.json``.

The container twin of :mod:`agent.engines.process._leftovers`: whoever supervises the
agent (``./mirbad up``) calls it once the agent is gone, so stopping the stack stops
its containers too. A container is stopped only when a record names its id and its
labels say it is this node's and that instance's; anything else is left alone.
Blocking; every Docker call bounded by DockerCallTimeoutSeconds.
"""

from __future__ import annotations

import logging

import docker
import docker.errors
import requests.exceptions

from agent._config import AgentConfig
from agent.engines.container._instance import LABELS
from agent.engines.container._records import RECORDS_FILE, read_records

__all__ = ["stop_recorded_containers"]

log = logging.getLogger("mirbad.agent.container")


def stop_recorded_containers(config: AgentConfig, *, grace: int = 10) -> list[str]:
    """Stop and remove every recorded container of this node; returns their ids."""
    if not config.docker_enabled:
        return []
    records = read_records(config.state_directory / RECORDS_FILE)
    wanted = {
        str(r["containerId"]): str(r.get("instanceId"))
        for r in records
        if r.get("containerId") and r.get("state") in ("Starting", "Ready")
    }
    if not wanted:
        return []
    stopped: list[str] = []
    try:
        client = docker.DockerClient(
            base_url=config.docker_endpoint, timeout=int(config.docker_call_timeout_seconds)
        )
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        log.warning("Cannot reach Docker to stop the recorded containers: %s", exc)
        return []
    try:
        for container_id, instance_id in wanted.items():
            try:
                container = client.containers.get(container_id)
                labels = container.labels or {}
                if (
                    labels.get(LABELS["node"]) != config.node_id
                    or labels.get(LABELS["instance"]) != instance_id
                ):
                    continue
                container.stop(timeout=grace)
                container.remove(force=True)
            except docker.errors.NotFound:
                continue
            except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
                log.warning("Could not stop container %s: %s", container_id[:12], exc)
                continue
            stopped.append(container_id)
            log.warning("Stopped container %s that its agent left running", container_id[:12])
    finally:
        client.close()
    return stopped
