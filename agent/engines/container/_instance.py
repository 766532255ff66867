"""One container instance's state as the container runtime keeps, reports and persists it."""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections import deque
from typing import Any

from agent._util import iso_time
from agent.engines._spec import LaunchSpec, fingerprint
from protocol.states import InstanceState

__all__ = ["CONTAINER_PORT", "KEY_VARIABLES", "LABELS", "ContainerInstance", "container_name"]

# The engine's port inside its container ({port} in the argv).
CONTAINER_PORT = 8000
# Where each engine reads its API key (never argv).
KEY_VARIABLES = {"llamacpp": "LLAMA_API_KEY", "vllm": "VLLM_API_KEY"}
# What says whose a container is; adoption reads them (docs/agent.md, "Containers").
LABEL_PREFIX = "io.mirbad."
LABELS = {
    "node": LABEL_PREFIX + "node",
    "instance": LABEL_PREFIX + "instance",
    "fingerprint": LABEL_PREFIX + "fingerprint",
    "epoch": LABEL_PREFIX + "master-epoch",
}


def container_name(instance_id: str) -> str:
    """The container's name, and its host name on a Docker network (``ss-<instanceId>``)."""
    return f"ss-{instance_id}"


class ContainerInstance:
    """One instance run as a container; only the runtime changes it, under ``lock``."""

    def __init__(self, *, spec: LaunchSpec, alias: str, key: str | None = None) -> None:
        assert spec.container is not None
        self.spec = spec
        self.alias = alias
        self.key = key or secrets.token_urlsafe(32)
        # The image reference takes the executable version's place (docs/agent-api.md).
        self.fingerprint = fingerprint(spec, spec.container.image)
        self.state = InstanceState.STARTING
        # The host port published on 127.0.0.1 (None on a Docker network: see ``host``).
        self.port: int | None = None
        self.container_id: str | None = None
        self.pid: int | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.exit_code: int | None = None
        self.error: str | None = None
        self.log_tail: list[str] = []
        self.restart_count = 0
        self.restarts: deque[float] = deque()
        self.task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.stopping = False
        self.adopted = False
        self.log_offset = 0
        self.follower: threading.Thread | None = None
        # Image pull progress while the start waits for its image.
        self.pulling: dict[str, Any] | None = None

    @property
    def instance_id(self) -> str:
        """The master's id of this instance."""
        return self.spec.instance_id

    @property
    def image(self) -> str:
        assert self.spec.container is not None
        return self.spec.container.image

    def to_json(self) -> dict[str, Any]:
        """The contract's ``<instance>``; never includes the key."""
        return {
            "instanceId": self.spec.instance_id,
            "modelId": self.spec.model_id,
            "servedName": self.spec.served_name,
            "state": self.state,
            "delivery": "container",
            "port": self.port,
            "pid": self.pid,
            "containerId": self.container_id,
            "image": self.image,
            "startedAt": iso_time(self.started_at) if self.started_at else None,
            "readyAt": iso_time(self.ready_at) if self.ready_at else None,
            "exitCode": self.exit_code,
            "error": self.error,
            "logTail": list(self.log_tail),
            "fingerprint": self.fingerprint,
            "restartCount": self.restart_count,
            "executable": {"name": self.spec.executable_name, "version": self.image},
            "gpuUuids": list(self.spec.gpu_uuids),
            "startQueuedAt": None,
            "measured": None,
            "pull": self.pulling,
        }

    def to_record(self) -> dict[str, Any]:
        """What containers.json keeps: the public view plus what adoption needs."""
        return {
            **self.to_json(),
            "spec": self.spec.to_json(),
            "apiKey": self.key,
            "startedAtEpoch": self.started_at,
            "readyAtEpoch": self.ready_at,
        }
