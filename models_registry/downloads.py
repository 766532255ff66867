"""Weights on nodes: Hugging Face downloads, the inventory, and reclaiming.

The master reads Hugging Face itself only to inspect a repo (its GGUF
variants) and to resolve a revision to an immutable commit SHA; the bytes are
fetched by the node's agent (docs/operator-guide.md, "Getting weights onto a node"), so they go straight to the
disk that needs them. The Hugging Face endpoint is huggingface_hub's own
``HF_ENDPOINT``, so the master and the agents it drives point at the same hub.
It is read from the environment at each call and passed to ``HfApi``
explicitly: huggingface_hub reads ``HF_ENDPOINT`` only once, at import.

The ``?node=`` rules (docs/operator-guide.md, "Models through /api") come from
:func:`nodes.services.node_from_param`. The token is passed through in the
POST body and nowhere else: never logged here, never stored.

Reclaiming deletes only folders the system fetched (the agent keeps a
manifest of each finished download and re-checks every path itself before
deleting). Listing is the default: ``GET /api/reclaim`` shows what could go,
and only ``POST /api/reclaim`` naming folders asks nodes to delete them.
"""

from __future__ import annotations

import os
import re
from typing import Any

from core.errors import ServiceError
from models_registry.lifecycle import agent_error
from models_registry.models import ModelDefinition
from nodes import status as node_status
from nodes.agent_client import AgentClient, AgentError, AgentRefused, check_folder
from nodes.models import Node
from nodes.services import node_from_param

SHA_RE = re.compile(r"^[0-9a-f]{40}$")
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _invalid(message: str, details: dict[str, Any] | None = None) -> ServiceError:
    return ServiceError(400, "invalid_request", message, details=details)


def hub_endpoint() -> str:
    """The hub's base URL: ``HF_ENDPOINT`` as the environment has it now.

    ``huggingface_hub.constants.ENDPOINT`` is read once at import, so it is only
    the fallback (it is huggingface.co unless ``HF_ENDPOINT`` was set then).
    """
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hub_error(repo_id: str, revision: str, token: str | None, exc: Exception) -> ServiceError:
    """The admin API's answer for a hub refusal; never carries the token."""
    from huggingface_hub import errors

    where = f"the Hugging Face hub at {hub_endpoint()}"
    if isinstance(exc, errors.RevisionNotFoundError):
        return ServiceError(
            404,
            "not_found",
            f"Revision '{revision}' of {repo_id} does not exist on {where}; "
            "name a branch, a tag or a commit SHA of that repo.",
        )
    if isinstance(exc, errors.GatedRepoError):
        return ServiceError(
            403,
            "hub_forbidden",
            f"{repo_id} is gated on {where}: accept its terms there and pass a token "
            "of an account that did.",
            details={"needsToken": True},
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        hint = (
            "or the token given cannot read it"
            if token
            else 'or it is private or gated and needs a token (pass "token")'
        )
        return ServiceError(
            404,
            "not_found",
            f"Repository {repo_id} was not found on {where}: it does not exist, {hint}.",
            details={"needsToken": True},
        )
    status = getattr(getattr(exc, "response", None), "status_code", None)
    answered = f" (HTTP {status})" if status else f": {type(exc).__name__}"
    return ServiceError(
        502,
        "hub_unavailable",
        f"The Hugging Face hub at {hub_endpoint()} could not be read for {repo_id}{answered}; "
        "try again, or check HF_ENDPOINT and the master's network.",
    )


def _check_repo(
    repo_id: Any, revision: Any, token: Any, fields: tuple[str, str, str]
) -> tuple[str, str, str | None]:
    """The repo, revision and token of a request, checked (400 naming the field)."""
    repo_field, revision_field, token_field = fields
    if not isinstance(repo_id, str) or not REPO_RE.match(repo_id):
        raise _invalid(f"{repo_field}: name a Hugging Face repo as owner/name")
    if not isinstance(revision, str) or not 0 < len(revision) <= 200:
        raise _invalid(f"{revision_field}: name a branch, a tag or a commit SHA")
    if token is not None and not isinstance(token, str):
        raise _invalid(f"{token_field}: must be a string (a Hugging Face token) or null")
    return repo_id, revision, token


def repo_files(repo_id: str, revision: str, token: str | None) -> tuple[str, list[dict[str, Any]]]:
    """The commit SHA a revision names and the repo's files (name, size) at that commit.

    The arguments are checked by the caller (:func:`_check_repo`, naming its own fields).
    """
    from huggingface_hub import HfApi

    try:
        # token=False: never fall back to a token stored on the master's machine.
        info = HfApi(endpoint=hub_endpoint()).model_info(
            repo_id, revision=revision, files_metadata=True, token=token or False
        )
    except Exception as exc:
        raise _hub_error(repo_id, revision, token, exc) from None
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
    revision = revision or "main"
    repo_id, revision, token = _check_repo(repo_id, revision, token, ("repo", "revision", "token"))
    sha, files = repo_files(repo_id, revision, token or None)
    return {"repoId": repo_id, "revision": revision, "commit": sha} | gguf_variants(files)


def _node_with(feature: str, node_param: str | None, action: str, what: str) -> Node:
    """The ``?node=`` node, refused with 501 when it does not report ``feature``.

    ``action`` completes node_from_param's "...; {action} cannot be done now."
    """
    node = node_from_param(node_param, action=action)
    features = (node.facts or {}).get("features") or []
    if feature not in features:
        raise ServiceError(
            501, "not_supported", f"Node '{node.node_id}' cannot {what} (feature '{feature}')."
        )
    return node


def _check_folder(folder: Any) -> str:
    return check_folder(folder)  # the agent's own rule (nodes.agent_client)


def _call(node: Node, method: str, *args: Any) -> Any:
    """One agent call; its errors become the admin API's (the agent's details kept)."""
    try:
        with AgentClient(node=node, timeout=60.0) as client:
            return getattr(client, method)(*args)
    except AgentError as exc:
        error = agent_error(node, exc)
        if isinstance(exc, AgentRefused) and exc.details:
            error.details = exc.details
        raise error from exc


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
        raise ServiceError(
            501,
            "not_supported",
            "source: 'ollama' is not supported (the Ollama registry puller is deferred); "
            "download a Hugging Face GGUF repo with source 'huggingface'.",
        )
    if source != "huggingface":
        raise _invalid(f"source: {source!r} is not a source; use 'huggingface'")
    folder = _check_folder(body.get("folder"))
    repo_id, token = body.get("repoId"), body.get("token")
    revision = body.get("revision") or "main"
    repo_id, revision, token = _check_repo(
        repo_id, revision, token, ("repoId", "revision", "token")
    )
    patterns = body.get("allowPatterns")
    variant_name = body.get("variant")
    if variant_name is not None and patterns is not None:
        raise _invalid("variant, allowPatterns: give one of them, not both")
    if variant_name is not None and not isinstance(variant_name, str):
        raise _invalid("variant: name a variant as GET /api/downloads/inspect lists it")
    if variant_name is None and (
        not isinstance(patterns, list)
        or not patterns
        or not all(isinstance(p, str) and p for p in patterns)
    ):
        raise _invalid("allowPatterns: give a non-empty list of file patterns, or a variant")
    node = _node_with(
        "downloads.hf-native",
        node_param,
        "a download",
        "download from Hugging Face",
    )
    sha, files = repo_files(repo_id, revision, token or None)
    if variant_name is not None:
        variants = {v["name"]: v for v in gguf_variants(files)["variants"]}
        if variant_name not in variants:
            raise _invalid(
                f"variant: {variant_name!r} is not a GGUF variant of {repo_id} at {sha}; "
                f"choose one of: {', '.join(sorted(variants)) or 'none (no .gguf files)'}",
                details={"variants": sorted(variants)},
            )
        patterns = variants[variant_name]["allowPatterns"]
    request = {
        "folder": folder,
        "source": "huggingface",
        "repoId": repo_id,
        "revision": sha,
        "allowPatterns": patterns,
        "token": token or None,
    }
    download = _call(node, "start_download", request)
    return {"node": node.node_id, **download}


def list_downloads(node_param: str | None) -> dict[str, Any]:
    """GET /api/downloads: the node's downloads, running and finished."""
    node = _node_with(
        "downloads.hf-native", node_param, "reading its downloads", "download from Hugging Face"
    )
    return {"node": node.node_id, "downloads": _call(node, "downloads")}


def get_download(node_param: str | None, folder: str) -> dict[str, Any]:
    """GET /api/downloads/{folder}: one download, with its files and progress."""
    _check_folder(folder)
    node = _node_with(
        "downloads.hf-native", node_param, "reading its downloads", "download from Hugging Face"
    )
    return {"node": node.node_id, **_call(node, "download", folder)}


def cancel_download(node_param: str | None, folder: str) -> dict[str, Any]:
    """DELETE /api/downloads/{folder}: cancel it (a completed one's record is forgotten)."""
    _check_folder(folder)
    node = _node_with(
        "downloads.hf-native", node_param, "cancelling a download", "download from Hugging Face"
    )
    return {"node": node.node_id, **_call(node, "cancel_download", folder)}


RETRYABLE = ("Failed", "Cancelled")


def retry_download(node_id: str, folder: str) -> dict[str, Any]:
    """Start a Failed or Cancelled download again from its own source (docs/decisions.md D67).

    The source (repo, the commit it was resolved to, the files) is the node's record
    of the download as its last heartbeat reported it, the record the console shows,
    so a cancelled download (which the node forgets) can be retried too. The token is
    never kept: a download that needed one is started again with it from the form,
    and the node resumes from the bytes in ``.partial``.
    """
    _check_folder(folder)
    node = node_from_param(node_id, action="a retry")
    record = ((node_status.read(node).get("downloads") or {}).get(folder)) or {}
    if not record:
        raise ServiceError(
            404,
            "not_found",
            f"Node {node.node_id} reports no download into '{folder}'; start it from the form.",
        )
    if record.get("state") not in RETRYABLE:
        raise ServiceError(
            409,
            "invalid_state",
            f"The download into '{folder}' is {record.get('state')}; only a Failed or "
            "Cancelled download can be retried.",
        )
    body = {
        "folder": folder,
        "repoId": record.get("repoId"),
        "revision": record.get("revision"),
        "allowPatterns": record.get("allowPatterns"),
    }
    return start_download(node.node_id, body)


def model_folders(node_param: str | None) -> dict[str, Any]:
    """GET /api/model-folders: the weights a node holds, which of them it fetched."""
    node = _node_with(
        "weights.inventory", node_param, "reading its model folders", "list its weights"
    )
    return {"node": node.node_id, **_call(node, "model_folders")}


def model_folder(node_param: str | None, folder: str) -> dict[str, Any]:
    """GET /api/model-folders/{folder}: one folder of the node's inventory."""
    _check_folder(folder)
    listing = model_folders(node_param)
    for item in listing.get("folders") or []:
        if item.get("folder") == folder:
            return {"node": listing["node"], **item}
    raise ServiceError(
        404, "not_found", f"Node {listing['node']} holds no model folder '{folder}'."
    )


def _referenced() -> set[str]:
    return set(ModelDefinition.objects.values_list("source_folder", flat=True))


def reclaimable() -> dict[str, Any]:
    """GET /api/reclaim: fetched folders no model definition uses, per serving node.

    From each node's last heartbeat inventory; nothing is deleted here.
    """
    used = _referenced()
    nodes = list(Node.objects.filter(approved=True, revoked=False).order_by("node_id"))
    statuses = node_status.read_many(nodes)
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
    anything it cannot prove it fetched. The answer says per folder, in
    ``askedToRemove``, whether it was removed and, if not, why (``code`` and
    ``reason``); for a removed one the node's ``removedFiles``, ``kept`` (files
    it left, the operator's) and ``bytesFreed``.
    """
    if not isinstance(body, dict):
        raise _invalid("The body must be a JSON object {node, folders}.")
    unknown = sorted(set(body) - {"node", "folders"})
    if unknown:
        raise _invalid(f"{unknown[0]}: unknown field; the body is {{node, folders}}")
    folders = body.get("folders")
    if not isinstance(folders, list) or not folders:
        raise _invalid("folders: name one or more model folders to reclaim")
    for folder in folders:
        _check_folder(folder)
    node_param = body.get("node")
    if node_param is not None and not isinstance(node_param, str):
        raise _invalid("node: must be a node id")
    node = _node_with("weights.inventory", node_param, "reclaiming weights", "reclaim weights")
    used = _referenced()
    results: list[dict[str, Any]] = []
    for folder in dict.fromkeys(folders):
        if folder in used:
            results.append(
                {
                    "folder": folder,
                    "removed": False,
                    "code": "folder_referenced",
                    "reason": "a model definition uses it; delete or change that model first",
                }
            )
            continue
        try:
            answer = _call(node, "reclaim", folder)
        except ServiceError as exc:
            results.append(
                {"folder": folder, "removed": False, "code": exc.code, "reason": exc.message}
            )
            continue
        results.append(
            {
                "folder": folder,
                "removed": True,
                "removedFiles": answer.get("removed", []),
                "kept": answer.get("kept", []),
                "bytesFreed": answer.get("bytesFreed"),
            }
        )
    return {"node": node.node_id, "askedToRemove": results}
