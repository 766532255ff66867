"""Reading a backup document: versions 1 and 2 (docs/operator-guide.md, "Backups").

A malformed document is refused with the JSON path of its first problem
(``$.models[3].source.folder: ...``); unknown sections and fields are ignored, so a
newer master's optional additions read as before; a wrong passphrase (or a changed
byte of the sealed section) says "wrong passphrase" and nothing else.

Version 1 documents (older releases) hold models without placements and, optionally,
sealed API keys; a restore places their models on the bootstrap node.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backups import crypto
from backups.document import FORMAT, READABLE_VERSIONS
from core.errors import ServiceError
from models_registry.services import RUNTIMES
from nodes import labels as node_labels
from protocol.engine_flags import DELIVERIES
from protocol.names import NODE_ID_RE, NameRefused, check_file_name, check_folder_name
from router.models import SCOPES

MAX_DOCUMENT_BYTES = 64 * 1024 * 1024
_RUNTIMES = RUNTIMES
_DELIVERIES = DELIVERIES
_DESIRED = ("running", "stopped")
_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})?$")

T = TypeVar("T")


class BackupInvalid(ValueError):
    """The document is not a backup this master reads; ``path`` names the first problem."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class WrongPassphrase(BackupInvalid):
    """Said for a wrong passphrase and for a tampered secrets section alike."""

    def __init__(self) -> None:
        super().__init__("$.secrets", "wrong passphrase")

    def __str__(self) -> str:
        return "wrong passphrase"


@dataclass(kw_only=True)
class Backup:
    """A read document: every section checked, ``secrets`` opened when a passphrase was given."""

    schema_version: int
    created_at: str | None
    master: dict[str, Any] | None
    models: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    running_models: dict[str, list[str]]
    sources: dict[str, dict[str, Any]]
    settings: dict[str, Any]
    history: dict[str, Any]
    sealed: bool
    secrets: dict[str, Any] | None = None
    api_keys: list[dict[str, Any]] = field(default_factory=list)
    ca: dict[str, str] | None = None


# -- checks: each takes the value and its JSON path ------------------------------------


def _obj(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BackupInvalid(path, "must be an object")
    return value


def _list(value: Any, path: str, each: Callable[[Any, str], T], limit: int = 100_000) -> list[T]:
    if not isinstance(value, list):
        raise BackupInvalid(path, "must be a list")
    if len(value) > limit:
        raise BackupInvalid(path, f"has {len(value)} entries; at most {limit} are read")
    return [each(item, f"{path}[{i}]") for i, item in enumerate(value)]


def _str(value: Any, path: str, *, max_len: int = 500, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise BackupInvalid(path, "must be a string")
    if len(value) > max_len:
        raise BackupInvalid(path, f"is {len(value)} characters; at most {max_len}")
    if not empty and not value:
        raise BackupInvalid(path, "must not be empty")
    if "\x00" in value:
        raise BackupInvalid(path, "must not contain a NUL character")
    return value


def _opt_str(value: Any, path: str, *, max_len: int = 500) -> str | None:
    return None if value is None else _str(value, path, max_len=max_len)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise BackupInvalid(path, "must be true or false")
    return value


def _int(value: Any, path: str, *, low: int = 0, high: int = 2**63 - 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BackupInvalid(path, "must be an integer")
    if not low <= value <= high:
        raise BackupInvalid(path, f"must be from {low} to {high}")
    return value


def _opt_int(value: Any, path: str, *, low: int = 0) -> int | None:
    return None if value is None else _int(value, path, low=low)


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise BackupInvalid(path, f"must be one of {', '.join(choices)}")
    return str(value)


def _when(value: Any, path: str) -> str | None:
    if value is None:
        return None
    text = _str(value, path, max_len=40)
    if not _ISO.match(text):
        raise BackupInvalid(path, "must be an ISO 8601 date and time")
    return text


def _node_id(value: Any, path: str) -> str:
    text = _str(value, path, max_len=40)
    if not NODE_ID_RE.fullmatch(text):
        raise BackupInvalid(path, "is not a node id (lower-case letters, digits and '-')")
    return text


def _get(record: dict[str, Any], name: str, default: Any = None) -> Any:
    return record.get(name, default)


# -- sections ---------------------------------------------------------------------------


def _placement(value: Any, path: str) -> dict[str, Any]:
    p = _obj(value, path)
    return {
        "id": _opt_int(_get(p, "id"), f"{path}.id", low=1),
        "node": _node_id(_get(p, "node"), f"{path}.node"),
        "gpuUuids": _list(_get(p, "gpuUuids", []), f"{path}.gpuUuids", _uuid, limit=64),
        "gpuBudgets": _list(_get(p, "gpuBudgets", []), f"{path}.gpuBudgets", _int, limit=64),
    }


def _uuid(value: Any, path: str) -> str:
    return _str(value, path, max_len=100, empty=False)


def _model(version: int) -> Callable[[Any, str], dict[str, Any]]:
    def check(value: Any, path: str) -> dict[str, Any]:
        m = _obj(value, path)
        source = _obj(_get(m, "source"), f"{path}.source")
        folder = _str(_get(source, "folder"), f"{path}.source.folder", max_len=200)
        try:
            check_folder_name(folder, "the folder")
        except NameRefused as exc:
            raise BackupInvalid(f"{path}.source.folder", str(exc)) from None
        record = {
            "id": _opt_int(_get(m, "id"), f"{path}.id", low=1),
            "servedName": _str(_get(m, "servedName"), f"{path}.servedName", max_len=200, empty=False),
            "runtime": _choice(_get(m, "runtime", "llamacpp"), f"{path}.runtime", _RUNTIMES),
            "delivery": _choice(_get(m, "delivery", "process"), f"{path}.delivery", _DELIVERIES),
            "image": _str(_get(m, "image", ""), f"{path}.image", max_len=512),
            "source": {
                "folder": folder,
                # Empty for vLLM, which reads the whole folder.
                "file": _source_file(_get(source, "file"), f"{path}.source.file"),
            },
            "settings": _obj(_get(m, "settings", {}), f"{path}.settings"),
            "executableVersion": _str(_get(m, "executableVersion", ""), f"{path}.executableVersion", max_len=60),
            "autoStart": _bool(_get(m, "autoStart", False), f"{path}.autoStart"),
            "memoryBudgetBytes": _opt_int(_get(m, "memoryBudgetBytes"), f"{path}.memoryBudgetBytes", low=1),
            "desiredState": _choice(_get(m, "desiredState", "stopped"), f"{path}.desiredState", _DESIRED),
            # Version 1 had no placements: the restore puts those models on the bootstrap node.
            "placements": (
                _list(_get(m, "placements", []), f"{path}.placements", _placement, limit=1000)
                if version >= 2
                else []
            ),
        }  # fmt: skip
        return record

    return check


def _node(value: Any, path: str) -> dict[str, Any]:
    n = _obj(value, path)
    address = _str(_get(n, "address"), f"{path}.address", max_len=200, empty=False)
    if not address.startswith("https://"):
        raise BackupInvalid(f"{path}.address", "must be an https:// URL")
    return {
        "nodeId": _node_id(_get(n, "nodeId"), f"{path}.nodeId"),
        "displayName": _str(_get(n, "displayName", ""), f"{path}.displayName", max_len=100),
        "address": address,
        "isBootstrap": _bool(_get(n, "isBootstrap", False), f"{path}.isBootstrap"),
        "approved": _bool(_get(n, "approved", False), f"{path}.approved"),
        "draining": _bool(_get(n, "draining", False), f"{path}.draining"),
        "revoked": _bool(_get(n, "revoked", False), f"{path}.revoked"),
        "memoryReserveBytes": _int(_get(n, "memoryReserveBytes", 2 * 1024**3), f"{path}.memoryReserveBytes"),
        "gpuReserves": _obj(_get(n, "gpuReserves", {}), f"{path}.gpuReserves"),
        "labels": _labels(_get(n, "labels", {}), f"{path}.labels"),
        "certSpkiSha256": _str(_get(n, "certSpkiSha256", ""), f"{path}.certSpkiSha256", max_len=64),
        "certSerial": _str(_get(n, "certSerial", ""), f"{path}.certSerial", max_len=64),
        "certNotAfter": _when(_get(n, "certNotAfter"), f"{path}.certNotAfter"),
        "enrolledAt": _when(_get(n, "enrolledAt"), f"{path}.enrolledAt"),
        "capabilities": _obj(_get(n, "capabilities", {}), f"{path}.capabilities"),
        "agentVersion": _str(_get(n, "agentVersion", ""), f"{path}.agentVersion", max_len=40),
        "protocolVersion": _opt_int(_get(n, "protocolVersion"), f"{path}.protocolVersion"),
        "os": _str(_get(n, "os", ""), f"{path}.os", max_len=40),
        "arch": _str(_get(n, "arch", ""), f"{path}.arch", max_len=40),
        "memoryTotalBytes": _opt_int(_get(n, "memoryTotalBytes"), f"{path}.memoryTotalBytes"),
    }  # fmt: skip


def _labels(value: Any, path: str) -> dict[str, str]:
    """A node's labels, by the rules of nodes/labels.py (a backup older than labels has
    none)."""
    try:
        return node_labels.clean(value)
    except ServiceError as exc:
        raise BackupInvalid(path, exc.message.removeprefix("labels").lstrip(".: ")) from None


def _scope(value: Any, path: str) -> str:
    return _choice(value, path, SCOPES)


def _api_key(value: Any, path: str) -> dict[str, Any]:
    k = _obj(value, path)
    key_hash = _str(_get(k, "keyHash"), f"{path}.keyHash", max_len=64)
    if not re.fullmatch(r"[0-9a-f]{64}", key_hash):
        raise BackupInvalid(f"{path}.keyHash", "must be 64 lower-case hex digits (a SHA-256)")
    return {
        "id": _int(_get(k, "id"), f"{path}.id", low=1),
        "name": _str(_get(k, "name"), f"{path}.name", max_len=100),
        "prefix": _str(_get(k, "prefix"), f"{path}.prefix", max_len=16),
        "keyHash": key_hash,
        "scopes": _list(_get(k, "scopes", []), f"{path}.scopes", _scope, limit=len(SCOPES)),
        "modelAllowlist": _list(
            _get(k, "modelAllowlist", []), f"{path}.modelAllowlist",
            lambda v, p: _str(v, p, max_len=200), limit=1000,
        ),
        "expiresAt": _when(_get(k, "expiresAt"), f"{path}.expiresAt"),
        "revokedAt": _when(_get(k, "revokedAt"), f"{path}.revokedAt"),
        "createdAt": _when(_get(k, "createdAt"), f"{path}.createdAt"),
        "rpmLimit": _opt_int(_get(k, "rpmLimit"), f"{path}.rpmLimit", low=1),
        "tpmLimit": _opt_int(_get(k, "tpmLimit"), f"{path}.tpmLimit", low=1),
        "concurrencyLimit": _opt_int(_get(k, "concurrencyLimit"), f"{path}.concurrencyLimit", low=1),
    }  # fmt: skip


def _ca(value: Any, path: str) -> dict[str, str]:
    c = _obj(value, path)
    cert = _str(_get(c, "certPem"), f"{path}.certPem", max_len=20_000, empty=False)
    key = _str(_get(c, "keyPem"), f"{path}.keyPem", max_len=20_000, empty=False)
    if "BEGIN CERTIFICATE" not in cert:
        raise BackupInvalid(f"{path}.certPem", "is not a PEM certificate")
    if "PRIVATE KEY" not in key:
        raise BackupInvalid(f"{path}.keyPem", "is not a PEM private key")
    return {"certPem": cert, "keyPem": key}


def _source_file(value: Any, path: str) -> str:
    """A model's file: empty (vLLM's whole folder) or one plain name (protocol.names)."""
    name = _str(value, path, max_len=255)
    if name:
        try:
            check_file_name(name, "the file")
        except NameRefused as exc:
            raise BackupInvalid(path, str(exc)) from None
    return name


def _file(value: Any, path: str) -> dict[str, Any]:
    f = _obj(value, path)
    name = _str(_get(f, "name"), f"{path}.name", max_len=500, empty=False)
    if name.startswith("/") or ".." in name.split("/"):
        raise BackupInvalid(f"{path}.name", "must be a relative path inside the folder")
    return {"name": name, "bytes": _int(_get(f, "bytes"), f"{path}.bytes")}


def _sources(value: Any, path: str) -> dict[str, dict[str, Any]]:
    r = _obj(value, path)
    out: dict[str, dict[str, Any]] = {}
    for folder, source in r.items():
        here = f"{path}.{folder}"
        try:
            check_folder_name(folder, "the folder")
        except NameRefused as exc:
            raise BackupInvalid(here, str(exc)) from None
        s = _obj(source, here)
        files = _list(_get(s, "files", []), f"{here}.files", _file, limit=10_000)
        out[folder] = {
            "kind": _choice(_get(s, "kind", "huggingface"), f"{here}.kind", ("huggingface",)),
            "repoId": _str(_get(s, "repoId"), f"{here}.repoId", max_len=200, empty=False),
            "revision": _str(_get(s, "revision", "main"), f"{here}.revision", max_len=100),
            "files": files,
            "bytes": sum(f["bytes"] for f in files),
        }
    return out


def _running(value: Any, path: str) -> dict[str, list[str]]:
    r = _obj(value, path)
    out: dict[str, list[str]] = {}
    for node_id, names in r.items():
        _node_id(node_id, f"{path}.{node_id}")
        out[node_id] = _list(names, f"{path}.{node_id}", lambda v, p: _str(v, p, max_len=200))
    return out


def _open_secrets(sealed: Any, version: int, passphrase: str) -> dict[str, Any]:
    section = _obj(sealed, "$.secrets")
    try:
        plaintext = crypto.open_sealed(section, passphrase=passphrase, schema_version=version)
    except crypto.SealedProblem as exc:
        raise BackupInvalid(f"$.secrets{exc.path}", exc.message) from None
    except crypto.WrongPassphrase:
        raise WrongPassphrase() from None
    try:
        return _obj(json.loads(plaintext), "$.secrets")
    except ValueError:
        # Authenticated but not JSON: written by something that is not a MirbadLLM master.
        raise BackupInvalid("$.secrets", "opened, but does not hold a JSON object") from None


def parse(data: bytes, *, passphrase: str | None = None) -> Backup:
    """Check a document and open its secrets with ``passphrase`` (BackupInvalid on any problem)."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise BackupInvalid("$", f"is {len(data)} bytes; a backup is at most {MAX_DOCUMENT_BYTES}")
    try:
        document = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise BackupInvalid("$", "is not UTF-8 text") from None
    except ValueError as exc:
        raise BackupInvalid("$", f"is not JSON ({exc})") from None
    root = _obj(document, "$")
    if root.get("format", FORMAT) != FORMAT:
        raise BackupInvalid("$.format", f"must be {FORMAT!r}")
    version = root.get("schemaVersion")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise BackupInvalid(
            "$.schemaVersion", f"must be one of {', '.join(map(str, READABLE_VERSIONS))}"
        )
    models = _list(root.get("models", []), "$.models", _model(version), limit=10_000)
    seen: set[str] = set()
    for i, model in enumerate(models):
        if model["servedName"] in seen:
            raise BackupInvalid(f"$.models[{i}].servedName", "appears twice")
        seen.add(model["servedName"])
    master = root.get("master")
    if master is not None:
        m = _obj(master, "$.master")
        master = {
            "instanceId": _opt_str(m.get("instanceId"), "$.master.instanceId", max_len=64),
            "epoch": _int(m.get("epoch", 0), "$.master.epoch"),
        }
    backup = Backup(
        schema_version=version,
        created_at=_when(root.get("createdAt"), "$.createdAt"),
        master=master,
        models=models,
        nodes=_list(root.get("nodes", []), "$.nodes", _node, limit=10_000) if version >= 2 else [],
        running_models=_running(root.get("runningModels", {}), "$.runningModels"),
        sources=_sources(root.get("sources", {}), "$.sources"),
        settings=_obj(root.get("settings", {}), "$.settings"),
        history=_obj(root.get("history", {}), "$.history"),
        sealed="secrets" in root,
    )
    if backup.sealed and passphrase is not None:
        secrets = _open_secrets(root["secrets"], version, passphrase)
        backup.secrets = secrets
        backup.api_keys = _list(secrets.get("apiKeys", []), "$.secrets.apiKeys", _api_key)
        if "ca" in secrets:
            if version < 2:
                raise BackupInvalid("$.secrets.ca", "a version 1 document cannot carry the CA")
            backup.ca = _ca(secrets["ca"], "$.secrets.ca")
    return backup
