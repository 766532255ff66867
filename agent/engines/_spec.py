"""Launch specs: parsing, guardrails, model path confinement and the fingerprint.

The master builds every argv; the agent still checks every token of it against the
engine's flag allow-list (protocol.engine_flags), so a spec cannot listen anywhere but
loopback, on a port the agent did not pick, start a process, enable a tool or read a
file; and it refuses a model file outside the models root. A malformed body is 400
invalid_request; a well-formed spec that breaks a rule is 422 spec_rejected. Both name
the field or argument at fault.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from agent._errors import InvalidRequest, SpecRejected
from protocol import names
from protocol.engine_flags import (
    MODEL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    FlagRefused,
    check_engine_argv,
    check_engine_env,
)
from protocol.images import ImageRefused, parse_image

__all__ = [
    "GPU_UUID_RE",
    "INSTANCE_ID_RE",
    "ContainerMount",
    "ContainerSpec",
    "LaunchSpec",
    "check_args",
    "check_env",
    "check_folder_name",
    "check_relative_name",
    "confined_path",
    "fingerprint",
    "parse_launch_spec",
    "resolve_model_path",
    "substitute",
]

INSTANCE_ID_RE = names.INSTANCE_ID_RE
FOLDER_RE = names.FOLDER_RE
# GPU pinning (gpuUuids). A MIG instance has its own MIG-... UUID. Commas never match:
# the UUIDs are joined with commas into CUDA_VISIBLE_DEVICES.
GPU_UUID_RE = re.compile(r"^(?:GPU-[0-9a-fA-F-]{8,64}|MIG-[0-9A-Za-z-]{8,64})$")
MAX_GPUS = 16
# A mount point inside the container: an absolute path of plain parts.
_MOUNT_TARGET_RE = re.compile(r"/[A-Za-z0-9._-]{1,100}(?:/[A-Za-z0-9._-]{1,100}){0,15}")
MOUNT_SOURCES = ("models", "cache")
MAX_SHM_BYTES = 1 << 40


@dataclass(frozen=True, kw_only=True)
class ContainerMount:
    """One mount a container launch asks for: a volume the node names, never a host path.

    ``source`` is ``models`` (the model's folder, always read-only) or ``cache`` (the
    node's CacheHostPath); the agent maps each to the host path it was configured with.
    """

    source: str
    target: str
    read_only: bool

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "readOnly": self.read_only}


@dataclass(frozen=True, kw_only=True)
class ContainerSpec:
    """The container part of a launch (delivery ``container``; docs/agent-api.md)."""

    image: str
    mounts: tuple[ContainerMount, ...]
    shm_size_bytes: int | None = None

    @property
    def models_target(self) -> str:
        """Where the model folder appears inside the container."""
        return next(m.target for m in self.mounts if m.source == "models")

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "mounts": [m.to_json() for m in self.mounts],
            "shmSizeBytes": self.shm_size_bytes,
        }


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """A parsed POST /instances body."""

    instance_id: str
    model_id: int | str | None
    served_name: str
    runtime: str
    delivery: str
    executable_name: str
    executable_version: str | None
    model_folder: str
    model_file: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # In the master's placement order: CUDA renumbers the visible devices in this order,
    # and the builder's --device CUDA0[,CUDA1] refers to that numbering.
    gpu_uuids: tuple[str, ...] = ()
    # Delivery "container" only; "" as model_file there means the folder is the model.
    container: ContainerSpec | None = None

    @property
    def env_dict(self) -> dict[str, str]:
        """The spec's extra environment variables as a dict."""
        return dict(self.env)

    def to_json(self) -> dict[str, Any]:
        """The spec as the master sent it (normalised), for persistence and comparison."""
        return {
            "instanceId": self.instance_id,
            "modelId": self.model_id,
            "servedName": self.served_name,
            "runtime": self.runtime,
            "delivery": self.delivery,
            "executable": {"name": self.executable_name, "version": self.executable_version},
            "model": {"folder": self.model_folder, "file": self.model_file or None},
            "args": list(self.args),
            "env": dict(self.env),
            "gpuUuids": list(self.gpu_uuids),
            **({"container": self.container.to_json()} if self.container else {}),
        }


def _require_str(body: dict[str, Any], key: str, where: str = "") -> str:
    """``body[key]`` as a non-empty string; InvalidRequest naming the field otherwise."""
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"field '{where}{key}' is required and must be a non-empty string")
    return value


def _require_object(body: dict[str, Any], key: str) -> dict[str, Any]:
    """``body[key]`` as a JSON object; InvalidRequest naming the field otherwise."""
    value = body.get(key)
    if not isinstance(value, dict):
        raise InvalidRequest(f"field '{key}' is required and must be an object")
    return value


def _parse_gpu_uuids(body: dict[str, Any]) -> tuple[str, ...]:
    """``gpuUuids``: absent, null or [] mean no pinning; else distinct GPU/MIG UUIDs."""
    value = body.get("gpuUuids")
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_GPUS:
        raise InvalidRequest(f"field 'gpuUuids' must be a list of at most {MAX_GPUS} GPU UUIDs")
    seen: set[str] = set()
    for index, uuid in enumerate(value):
        if not isinstance(uuid, str) or not GPU_UUID_RE.fullmatch(uuid):
            raise InvalidRequest(
                f"field 'gpuUuids[{index}]' ({uuid!r}) is not a GPU UUID "
                "(GPU-<hex> as nvidia-smi reports it, or MIG-...)"
            )
        # nvidia-smi prints lower case, but a hand-written spec may not: the same GPU
        # twice would make CUDA show one device where the argv expects two.
        if uuid.lower() in seen:
            raise InvalidRequest(f"field 'gpuUuids' names {uuid} twice")
        seen.add(uuid.lower())
    return tuple(value)


def parse_launch_spec(body: Any) -> LaunchSpec:
    """Check the shape of a launch body; raises InvalidRequest naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    instance_id = _require_str(body, "instanceId")
    if not INSTANCE_ID_RE.fullmatch(instance_id):
        raise InvalidRequest("field 'instanceId' must match ^[A-Za-z0-9._-]{1,64}$")
    model_id = body.get("modelId")
    if isinstance(model_id, bool) or not isinstance(model_id, int | str | None):
        raise InvalidRequest("field 'modelId' must be an integer, a string or null")
    served_name = _require_str(body, "servedName")
    runtime = _require_str(body, "runtime")
    delivery = _require_str(body, "delivery")
    executable = _require_object(body, "executable")
    exe_name = _require_str(executable, "name", "executable.")
    exe_version = executable.get("version")
    if exe_version is not None and (not isinstance(exe_version, str) or not exe_version):
        raise InvalidRequest("field 'executable.version' must be a non-empty string or null")
    model = _require_object(body, "model")
    folder = _require_str(model, "folder", "model.")
    container = _parse_container(body) if delivery == "container" else None
    # A container engine may take the whole folder (vLLM reads a Hugging Face folder).
    file = "" if container is not None and model.get("file") is None else None
    if file is None:
        file = _require_str(model, "file", "model.")
    args = body.get("args")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidRequest("field 'args' must be a list of strings")
    env = body.get("env", {})
    if env is None:
        env = {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise InvalidRequest("field 'env' must be an object of string values")
    gpu_uuids = _parse_gpu_uuids(body)
    return LaunchSpec(
        instance_id=instance_id,
        model_id=model_id,
        served_name=served_name,
        runtime=runtime,
        delivery=delivery,
        executable_name=exe_name,
        executable_version=exe_version,
        model_folder=folder,
        model_file=file,
        args=tuple(args),
        env=tuple(sorted(env.items())),
        gpu_uuids=gpu_uuids,
        container=container,
    )


def _parse_container(body: dict[str, Any]) -> ContainerSpec:
    """The ``container`` object of a container launch; 400 naming the field at fault.

    Shape only: whether the image may run and whether a mount is acceptable are the
    policy's questions (422 spec_rejected, :func:`check_container`).
    """
    raw = _require_object(body, "container")
    unknown = set(raw) - {"image", "mounts", "shmSizeBytes"}
    if unknown:
        raise InvalidRequest(f"field 'container.{sorted(unknown)[0]}' is not known")
    image = _require_str(raw, "image", "container.")
    mounts_raw = raw.get("mounts")
    if not isinstance(mounts_raw, list) or not 1 <= len(mounts_raw) <= len(MOUNT_SOURCES):
        raise InvalidRequest(
            f"field 'container.mounts' must be a list of 1 to {len(MOUNT_SOURCES)} mounts"
        )
    mounts: list[ContainerMount] = []
    for index, item in enumerate(mounts_raw):
        where = f"container.mounts[{index}]"
        if not isinstance(item, dict) or set(item) - {"source", "target", "readOnly"}:
            raise InvalidRequest(f"field '{where}' must be {{source, target, readOnly}}")
        source, target, read_only = item.get("source"), item.get("target"), item.get("readOnly")
        if source not in MOUNT_SOURCES:
            raise InvalidRequest(
                f"field '{where}.source' must be one of {', '.join(MOUNT_SOURCES)} "
                "(the node maps each to its own folder; a host path is never accepted)"
            )
        if not isinstance(target, str) or not _MOUNT_TARGET_RE.fullmatch(target):
            raise InvalidRequest(
                f"field '{where}.target' must be an absolute path of plain parts, such as /models"
            )
        if any(part in (".", "..") for part in target.split("/")):
            raise InvalidRequest(f"field '{where}.target' may not contain '.' or '..'")
        if not isinstance(read_only, bool):
            raise InvalidRequest(f"field '{where}.readOnly' must be true or false")
        mounts.append(ContainerMount(source=source, target=target, read_only=read_only))
    shm = raw.get("shmSizeBytes")
    if shm is not None and (
        isinstance(shm, bool) or not isinstance(shm, int) or not 0 < shm <= MAX_SHM_BYTES
    ):
        raise InvalidRequest(f"field 'container.shmSizeBytes' must be 1..{MAX_SHM_BYTES} or null")
    return ContainerSpec(image=image, mounts=tuple(mounts), shm_size_bytes=shm)


def check_container(spec: ContainerSpec) -> None:
    """The guardrails of a container launch that need no node setting (422 spec_rejected)."""
    try:
        parse_image(spec.image, "container.image")
    except ImageRefused as exc:
        raise SpecRejected(str(exc), details={"field": "container.image"}) from None
    sources = [m.source for m in spec.mounts]
    if sources.count("models") != 1:
        raise SpecRejected(
            "container.mounts must mount the models volume exactly once",
            details={"field": "container.mounts"},
        )
    if len(set(sources)) != len(sources):
        raise SpecRejected(
            "container.mounts names a volume twice", details={"field": "container.mounts"}
        )
    targets = [m.target.rstrip("/") for m in spec.mounts]
    for a in targets:
        for b in targets:
            if a is not b and (a == b or b.startswith(a + "/")):
                raise SpecRejected(
                    f"container.mounts: {b} lies inside another mount ({a})",
                    details={"field": "container.mounts"},
                )
    for mount in spec.mounts:
        if mount.source == "models" and not mount.read_only:
            raise SpecRejected(
                "container.mounts: a writable models mount is refused; the models volume is "
                "always mounted read-only (set readOnly true)",
                details={"field": "container.mounts"},
            )


def check_runtime(spec: LaunchSpec, offered: tuple[tuple[str, str], ...]) -> None:
    """Refuse a (runtime, delivery) pair this runtime does not offer."""
    if (spec.runtime, spec.delivery) in offered:
        return
    pairs = ", ".join(f"{runtime} as a {delivery}" for runtime, delivery in offered)
    raise SpecRejected(
        f"runtime {spec.runtime!r} with delivery {spec.delivery!r} is not offered by this "
        f"agent (it offers: {pairs or 'nothing'})"
    )


def check_args(
    args: tuple[str, ...],
    version: str | None = None,
    *,
    engine: str = "llamacpp",
    delivery: str = "process",
) -> str:
    """Check the whole argv against the engine's allow-list; returns the ``--alias`` value.

    ``version`` is the executable's (None: the newest allow-list). Every token must be
    an allowed flag or its value (protocol.engine_flags, the list the master checks
    extra args against too), so a spec that bypasses the master's builder still
    cannot start a process, read a file or listen anywhere but loopback.
    """
    try:
        return check_engine_argv(args, engine=engine, version=version, delivery=delivery)
    except FlagRefused as exc:
        raise SpecRejected(
            f"argument {exc.index} is refused: {exc.message}", details={"flag": exc.flag}
        ) from None


def check_env(
    env: tuple[tuple[str, str], ...],
    version: str | None = None,
    node_allows: tuple[str, ...] = (),
    *,
    engine: str = "llamacpp",
) -> None:
    """Check the engine's extra environment against its allow-list (protocol.engine_flags).

    An allow-list, as for argv: the loader's variables (LD_*), llama-server's
    LLAMA_ARG_* (read as flags) and anything that names a file stay out because they
    are not on it. The agent sets PATH, HOME, LANG, the key and CUDA_VISIBLE_DEVICES.
    ``node_allows`` is the node's ``EngineEnvAllow`` (docs/agent.md).
    """
    for name, _value in env:
        if name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
            raise SpecRejected(
                "env CUDA_VISIBLE_DEVICES is refused: the agent sets it itself from "
                "gpuUuids (pin GPUs by UUID there)",
                details={"flag": name},
            )
    try:
        check_engine_env(env, engine=engine, version=version, node_allows=node_allows)
    except FlagRefused as exc:
        raise SpecRejected(exc.message, details={"flag": exc.flag}) from None


def resolve_model_path(models_root: Path, folder: str, file: str) -> Path:
    """The confined, resolved path of ``folder/file`` under the models root.

    Symlinks are followed and the result must still lie inside the resolved root,
    compared by path components (``/srv/models2`` is not inside ``/srv/models``).
    """
    try:
        names.check_folder_name(folder, "model.folder")
        names.check_file_name(file, "model.file")
    except names.NameRefused as exc:
        raise SpecRejected(str(exc)) from None
    try:
        root = models_root.resolve(strict=True)
    except OSError:
        raise SpecRejected(f"the models root {models_root} does not exist on this node") from None
    try:
        resolved = (root / folder / file).resolve(strict=True)
    except FileNotFoundError:
        raise SpecRejected(
            f"model file {folder}/{file} does not exist under the models root {models_root}"
        ) from None
    except (OSError, RuntimeError) as exc:
        raise SpecRejected(f"model file {folder}/{file} cannot be resolved: {exc}") from None
    if resolved.parts[: len(root.parts)] != root.parts:
        raise SpecRejected(
            f"model file {folder}/{file} resolves to {resolved}, outside the models root {root}"
        )
    if not resolved.is_file():
        raise SpecRejected(f"model file {folder}/{file} is not a regular file")
    return resolved


def check_folder_name(folder: object, field: str = "folder") -> str:
    """``folder`` if it is a valid model folder name; else 400 invalid_request naming ``field``.

    The rule is protocol.names.check_folder_name, the one the master's API applies too.
    """
    try:
        return names.check_folder_name(folder, field)
    except names.NameRefused as exc:
        raise InvalidRequest(str(exc)) from None


def check_relative_name(name: object, where: str) -> PurePosixPath:
    """A file name from outside (the hub, a manifest) as a plain relative path.

    Subdirectories are allowed; each part follows protocol.names.path_name_problem, so
    absolute paths, ``..`` or ``.`` parts, empty parts, backslashes, colons (drive
    letters, alternate data streams on Windows), Windows device names and NUL are
    refused with 400 invalid_request, naming ``where`` the name came from.
    """
    try:
        return PurePosixPath(*names.check_relative_path(name, f"{where}:"))
    except names.NameRefused as exc:
        raise InvalidRequest(str(exc)) from None


def confined_path(root: Path, *parts: str | PurePosixPath) -> Path:
    """``root/parts`` with symlinks resolved, refused unless it stays inside the root.

    The tail may not exist yet (a download target); whatever part of it exists is
    resolved, so a symlink anywhere on the way that leaves the root is caught. The
    comparison is by path components, so ``/srv/models2`` is not inside ``/srv/models``,
    and the root itself is not a path inside it. Raises 400 invalid_request.
    """
    try:
        real_root = root.resolve(strict=True)
    except OSError:
        raise InvalidRequest(f"the models root {root} does not exist on this node") from None
    joined = real_root.joinpath(*parts)
    try:
        resolved = joined.resolve(strict=False)
    except (OSError, RuntimeError) as exc:
        raise InvalidRequest(f"{joined} cannot be resolved: {exc}") from None
    inside = resolved.parts[: len(real_root.parts)] == real_root.parts
    if not inside or resolved == real_root:
        raise InvalidRequest(
            f"{joined.relative_to(real_root)} resolves to {resolved}, outside the models root "
            f"{real_root}"
        )
    return resolved


def substitute(args: tuple[str, ...], *, model_path: Path | str, port: int) -> list[str]:
    """Replace the placeholders with the resolved model path and the port.

    ``{model}`` and ``{port}`` are whole arguments; ``{model}/NAME`` (a file of the
    model's folder, such as vLLM's chat template) starts one. The allow-list admits that
    form only where a file of the folder is meant (protocol.engine_flags).
    """
    out: list[str] = []
    for arg in args:
        if arg == MODEL_PLACEHOLDER:
            out.append(str(model_path))
        elif arg == PORT_PLACEHOLDER:
            out.append(str(port))
        elif arg.startswith(MODEL_PLACEHOLDER + "/"):
            out.append(str(model_path) + arg[len(MODEL_PLACEHOLDER) :])
        else:
            out.append(arg)
    return out


def fingerprint(spec: LaunchSpec, executable_version: str) -> str:
    """``sha256:`` + hex SHA-256 of canonical JSON of argv, executable version, env names.

    Placeholders stay unsubstituted, so the fingerprint depends only on what the master
    asked for, not on the port picked or where the models root lives.
    """
    # The same formula as the master's models_registry.llamacpp.execution_fingerprint,
    # so the two sides can compare fingerprints (docs/agent-api.md spells it out).
    payload = json.dumps(
        {
            "argv": list(spec.args),
            "executable": executable_version,
            "env": sorted(name for name, _ in spec.env),
        },
        separators=(",", ":"),
        sort_keys=True,
    )
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()
