"""What a container launch may run and mount on this node (docs/agent.md, "Containers").

The image policy is an allow-list: ``ApprovedImages`` holds the digests this node
runs; an image named by tag runs only where ``AllowTagPulls`` says so. Mounts are
volumes the node names (``models``, ``cache``), mapped here to the host paths the
node's operator configured; a spec never carries a host path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker.types

from agent._config import AgentConfig
from agent._errors import InvalidRequest, SpecRejected
from agent.engines._spec import (
    ContainerSpec,
    check_folder_name,
    confined_path,
    resolve_model_path,
    substitute,
)
from agent.engines.container._instance import (
    CONTAINER_PORT,
    KEY_VARIABLES,
    LABELS,
    ContainerInstance,
    container_name,
)
from protocol.images import parse_image

__all__ = ["Binding", "check_image_policy", "container_definition", "model_bindings"]


def check_image_policy(image: str, *, approved: tuple[str, ...], allow_tags: bool) -> None:
    """422 spec_rejected unless this node may run ``image`` (already a valid reference)."""
    ref = parse_image(image, "container.image")
    if ref.digest is not None:
        if ref.digest in approved:
            return
        if approved:
            raise SpecRejected(
                f"container.image: digest {ref.digest} is not in this node's ApprovedImages; "
                "add it there (docs/agent.md) or use an approved image",
                details={"field": "container.image", "digest": ref.digest},
            )
        if allow_tags:
            return
        raise SpecRejected(
            "container.image: this node approves no image (ApprovedImages is empty and "
            "AllowTagPulls is false); add the digest to ApprovedImages",
            details={"field": "container.image", "digest": ref.digest},
        )
    if allow_tags:
        return
    raise SpecRejected(
        f"container.image: {image!r} names a tag, and this node runs images by digest only "
        "(AllowTagPulls is false): use NAME@sha256:<digest> with the digest in ApprovedImages",
        details={"field": "container.image"},
    )


@dataclass(frozen=True)
class Binding:
    """A host path mounted at ``target`` in the container."""

    host: str
    target: str
    read_only: bool


def model_bindings(
    config: AgentConfig, spec: ContainerSpec, folder: str, file: str
) -> tuple[list[Binding], str]:
    """The mounts of a launch and the model's path inside the container.

    Only the model's own folder is mounted (read-only), at ``<models target>/<folder>``:
    an engine sees no other model of the node. The folder (and the file, when the spec
    names one) must exist under ModelsRoot; the host side of the mount is
    ModelsHostPath, the same folder as the Docker engine sees it.
    """
    root = config.models_root_path
    if file:
        resolve_model_path(root, folder, file)
    else:
        try:
            path = confined_path(root, check_folder_name(folder, "model.folder"))
        except InvalidRequest as exc:
            raise SpecRejected(exc.message, details={"field": "model.folder"}) from None
        if not path.is_dir():
            raise SpecRejected(
                f"model folder {folder} does not exist under the models root {root}",
                details={"field": "model.folder"},
            )
    host_root = config.models_host_path or root
    bindings: list[Binding] = []
    model_path = ""
    for mount in spec.mounts:
        if mount.source == "models":
            target = f"{mount.target.rstrip('/')}/{folder}"
            bindings.append(Binding(str(Path(host_root) / folder), target, True))
            model_path = f"{target}/{file}" if file else target
        elif mount.source == "cache":
            if config.cache_host_path is None:
                raise SpecRejected(
                    "container.mounts: this node has no cache volume (CacheHostPath is not "
                    "set); drop the cache mount or set CacheHostPath",
                    details={"field": "container.mounts"},
                )
            bindings.append(Binding(str(config.cache_host_path), mount.target, mount.read_only))
    return bindings, model_path


def container_definition(
    config: AgentConfig, inst: ContainerInstance, epoch: int | None
) -> dict[str, Any]:
    """The container's definition: everything checked at launch, nothing else."""
    spec = inst.spec
    assert spec.container is not None
    bindings, model_path = model_bindings(
        config, spec.container, spec.model_folder, spec.model_file
    )
    env = dict(spec.env)
    env[KEY_VARIABLES[spec.runtime]] = inst.key
    labels = {
        LABELS["node"]: config.node_id,
        LABELS["instance"]: inst.instance_id,
        LABELS["fingerprint"]: inst.fingerprint,
        LABELS["epoch"]: "" if epoch is None else str(epoch),
    }
    kwargs: dict[str, Any] = {
        "image": spec.container.image,
        "command": substitute(spec.args, model_path=model_path, port=CONTAINER_PORT),
        "name": container_name(inst.instance_id),
        "environment": env,
        "labels": labels,
        "volumes": {
            b.host: {"bind": b.target, "mode": "ro" if b.read_only else "rw"} for b in bindings
        },
        "detach": True,
        # The agent supervises and restarts within its budget; Docker must not as well.
        "restart_policy": {"Name": "no"},
        # Docker keeps its own copy of the output (the agent copies it to the engine
        # log): capped like that log, EngineLogMaxBytes per file.
        "log_config": docker.types.LogConfig(
            type="json-file",
            config={
                "max-size": str(config.engine_log_max_bytes),
                "max-file": str(config.engine_log_files + 1),
            },
        ),
    }
    if spec.container.shm_size_bytes:
        kwargs["shm_size"] = spec.container.shm_size_bytes
    if spec.gpu_uuids:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)
        kwargs["device_requests"] = [
            docker.types.DeviceRequest(device_ids=list(spec.gpu_uuids), capabilities=[["gpu"]])
        ]
    if config.docker_network:
        kwargs["network"] = config.docker_network
    else:
        kwargs["ports"] = {f"{CONTAINER_PORT}/tcp": ("127.0.0.1", inst.port)}
    return kwargs
