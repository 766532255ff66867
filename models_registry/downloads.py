"""Weights on nodes: Hugging Face downloads, the inventory, and reclaiming.

The master reads Hugging Face itself only to inspect a repo (its GGUF
variants) and to resolve a revision to an immutable commit SHA; the bytes are
fetched by the node's agent (seed 002 section 7.1), so they go straight to the
disk that needs them. The Hugging Face endpoint is huggingface_hub's own
``HF_ENDPOINT``, so the master and the agents it drives point at the same hub.

The ``?node=`` rules (seed 002 section 6) come from
:func:`nodes.services.node_from_param`. The token is passed through in the
POST body and nowhere else: never logged here, never stored.

Reclaiming deletes only folders the system fetched (the agent keeps a
manifest of each finished download and re-checks every path itself before
deleting). Listing is the default: ``GET /api/reclaim`` shows what could go,
and only ``POST /api/reclaim`` naming folders asks nodes to delete them.
"""

from __future__ import annotations

import re
from typing import Any

from mirbad_site.errors import ServiceError
from models_registry.models import ModelDefinition
from nodes import status_cache
from nodes.agent_client import AgentClient, AgentRefused, AgentUnreachable
from nodes.models import Node
from nodes.services import node_from_param

SHA_RE = re.compile(r"^[0-9a-f]{40}$")
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
FOLDER_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _invalid(message: str) -> ServiceError:
    return ServiceError(400, "invalid_request", message)


def _hub_error(repo_id: str, revision: str, exc: Exception) -> ServiceError:
    from huggingface_hub import errors

    if isinstance(exc, errors.RevisionNotFoundError):
        return ServiceError(404, "not_found", f"Revision '{revision}' of {repo_id} does not exist.")
    if isinstance(exc, errors.GatedRepoError):
        return ServiceError(
            403, "hub_forbidden", f"{repo_id} is gated: accept its terms and pass a token."
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ServiceError(
            404,
            "not_found",
            f"Repository {repo_id} does not exist on the hub, or it is private and needs a token.",
        )
    return ServiceError(
        502, "hub_unavailable", f"The Hugging Face hub could not be read: {type(exc).__name__}"
    )


def repo_files(repo_id: str, revision: str, token: str | None) -> tuple[str, list[dict[str, Any]]]:
    """The commit SHA a revision names and the repo's files (name, size) at that commit."""
    from huggingface_hub import HfApi

    if not isinstance(repo_id, str) or not REPO_RE.match(repo_id):
        raise _invalid("repoId: name a Hugging Face repo as owner/name")
    if not isinstance(revision, str) or not 0 < len(revision) <= 200:
        raise _invalid("revision: name a branch, tag or commit SHA")
    if token is not None and not isinstance(token, str):
        raise _invalid("token: must be a string")
    try:
        # token=False: never fall back to a token stored on the master's machine.
        info = HfApi().model_info(
            repo_id, revision=revision, files_metadata=True, token=token or False
        )
    except Exception as exc:
        raise _hub_error(repo_id, revision, exc) from None
    if not info.sha or not SHA_RE.match(info.sha):
        raise ServiceError(502, "hub_unavailable", f"The hub gave no commit SHA for {repo_id}.")
    files = [{"name": s.rfilename, "size": s.size} for s in info.siblings or []]
    return info.sha, files


def gguf_variants(files: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Group a repo's GGUFs into variants: split parts together, ``mmproj-*`` apart."""
    variants: dict[str, dict[str, Any]] = {}
    projectors = []
    for f in sorted(files, key=lambda f: f["name"]):
        name = f["name"]
        base = name.rsplit("/", 1)[-1]
        if not base.endswith(".gguf"):
            continue
        if base.startswith("mmproj-"):
            projectors.append({"name": name, "sizeBytes": f["size"]})
            continue
        match = SPLIT_RE.match(name)
        key = f"{match['stem']}.gguf" if match else name
        variant = variants.setdefault(
            key, {"name": key, "files": [], "expectedParts": int(match["count"]) if match else 1}
        )
        variant["files"].append(name)
        variant.setdefault("_sizes", []).append(f["size"])
    out = []
    for variant in variants.values():
        sizes = variant.pop("_sizes")
        known = all(isinstance(s, int) for s in sizes)
        out.append(
            {
                **variant,
                "modelFile": variant["files"][0].rsplit("/", 1)[-1],
                "complete": len(variant["files"]) == variant["expectedParts"],
                "sizeBytes": sum(sizes) if known else None,
                # Before the download only the size is known: the budget is at least that.
                "needsAtLeastBytes": sum(sizes) if known else None,
                "allowPatterns": list(variant["files"]),
            }
        )
    return {"variants": out, "projectors": projectors}


def inspect(repo_id: Any, revision: Any, token: Any) -> dict[str, Any]:
    """GET /api/downloads/inspect: read the hub, not a node (no ?node=)."""
    sha, files = repo_files(repo_id, revision or "main", token)
    return {"repoId": repo_id, "revision": revision or "main", "commit": sha} | gguf_variants(files)


def _node_with(feature: str, node_param: str | None, action: str, what: str) -> Node:
    node = node_from_param(node_param, action=action)
    features = (node.facts or {}).get("features") or []
    if feature not in features:
        raise ServiceError(
            501, "not_supported", f"Node '{node.node_id}' cannot {what} (feature '{feature}')."
        )
    return node


def _call(node: Node, method: str, *args: Any) -> Any:
    try:
        with AgentClient(node=node, timeout=60.0) as client:
            return getattr(client, method)(*args)
    except AgentUnreachable as exc:
        raise ServiceError(503, "node_unreachable", str(exc)) from exc
    except AgentRefused as exc:
        status = exc.status if exc.status in (400, 404, 409, 422, 501, 503) else 502
        raise ServiceError(status, exc.code, exc.message, details=exc.details) from exc


def start_download(node_param: str | None, body: Any) -> dict[str, Any]:
    """POST /api/downloads: resolve the revision, pick the files, hand it to the node."""
    if not isinstance(body, dict):
        raise _invalid("The body must be a JSON object.")
    known = {"folder", "source", "repoId", "revision", "allowPatterns", "variant", "token"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise _invalid(f"{unknown[0]}: unknown field; known fields are {', '.join(sorted(known))}")
    source = body.get("source", "huggingface")
    if source == "ollama":
        raise ServiceError(501, "not_supported", "The Ollama registry source is not available.")
    if source != "huggingface":
        raise _invalid("source: must be 'huggingface'")
    folder = body.get("folder")
    if not isinstance(folder, str) or not FOLDER_RE.match(folder) or folder in (".", ".."):
        raise _invalid("folder: use 1-200 letters, digits, '.', '_' or '-'")
    node = _node_with(
        "downloads.hf-native",
        node_param,
        "nothing can be downloaded to it",
        "download from Hugging Face",
    )
    token = body.get("token")
    sha, files = repo_files(body.get("repoId"), body.get("revision") or "main", token)
    patterns = body.get("allowPatterns")
    variant_name = body.get("variant")
    if variant_name is not None:
        if patterns is not None:
            raise _invalid("give either variant or allowPatterns, not both")
        variants = {v["name"]: v for v in gguf_variants(files)["variants"]}
        if variant_name not in variants:
            raise _invalid(
                f"variant: {variant_name!r} is not a GGUF variant of {body['repoId']}; "
                f"choose one of: {', '.join(sorted(variants)) or 'none'}"
            )
        patterns = variants[variant_name]["allowPatterns"]
    if (
        not isinstance(patterns, list)
        or not patterns
        or not all(isinstance(p, str) and p for p in patterns)
    ):
        raise _invalid("allowPatterns: give a non-empty list of file patterns, or a variant")
    request = {
        "folder": folder,
        "source": "huggingface",
        "repoId": body["repoId"],
        "revision": sha,
        "allowPatterns": patterns,
        "token": token or None,
    }
    download = _call(node, "start_download", request)
    return {"node": node.node_id, **download}


def list_downloads(node_param: str | None) -> dict[str, Any]:
    node = _node_with("downloads.hf-native", node_param, "its downloads cannot be read", "download")
    return {"node": node.node_id, "downloads": _call(node, "downloads")}


def get_download(node_param: str | None, folder: str) -> dict[str, Any]:
    node = _node_with("downloads.hf-native", node_param, "its downloads cannot be read", "download")
    return {"node": node.node_id, **_call(node, "download", folder)}


def cancel_download(node_param: str | None, folder: str) -> dict[str, Any]:
    node = _node_with(
        "downloads.hf-native", node_param, "downloads cannot be cancelled", "download"
    )
    return {"node": node.node_id, **_call(node, "cancel_download", folder)}


def model_folders(node_param: str | None) -> dict[str, Any]:
    """GET /api/model-folders: the weights a node holds, which of them it fetched."""
    node = _node_with(
        "weights.inventory", node_param, "its model folders cannot be read", "list its weights"
    )
    return {"node": node.node_id, **_call(node, "model_folders")}


def _referenced() -> set[str]:
    return set(ModelDefinition.objects.values_list("source_folder", flat=True))


def reclaimable() -> dict[str, Any]:
    """GET /api/reclaim: fetched folders no model definition uses, per serving node.

    From each node's last heartbeat inventory; nothing is deleted here.
    """
    used = _referenced()
    nodes = list(Node.objects.filter(approved=True, revoked=False).order_by("node_id"))
    statuses = status_cache.read_many([n.node_id for n in nodes])
    out = []
    for node in nodes:
        status = statuses.get(node.node_id) or {}
        weights = (status.get("telemetry") or {}).get("weights") or []
        for item in weights:
            if item.get("fetched") and item.get("folder") not in used:
                out.append(
                    {"node": node.node_id, "folder": item["folder"], "bytes": item.get("bytes")}
                )
    return {"candidates": out, "totalBytes": sum(c["bytes"] or 0 for c in out)}


def reclaim(body: Any) -> dict[str, Any]:
    """POST /api/reclaim {node, folders}: ask the node to delete what it fetched.

    A folder a model definition still names is refused here; the node refuses
    anything it cannot prove it fetched. The answer says "asked to remove" per
    folder with the node's own verdict.
    """
    if not isinstance(body, dict) or set(body) - {"node", "folders"}:
        raise _invalid("The body must be {node, folders}.")
    folders = body.get("folders")
    if (
        not isinstance(folders, list)
        or not folders
        or not all(isinstance(f, str) and FOLDER_RE.match(f) for f in folders)
    ):
        raise _invalid("folders: name one or more model folders to reclaim")
    node = _node_with(
        "weights.inventory", body.get("node"), "nothing can be reclaimed on it", "reclaim weights"
    )
    used = _referenced()
    results = []
    for folder in folders:
        if folder in used:
            results.append(
                {
                    "folder": folder,
                    "removed": False,
                    "reason": "a model definition uses it; delete or change that model first",
                }
            )
            continue
        try:
            answer = _call(node, "reclaim", folder)
        except ServiceError as exc:
            results.append({"folder": folder, "removed": False, "reason": exc.message})
            continue
        results.append({"folder": folder, "removed": True, **answer})
    return {"node": node.node_id, "askedToRemove": results}
