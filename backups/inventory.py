"""What model folders the reachable nodes hold, asked once per node with a short timeout.

A backup records where each referenced folder came from (its Hugging Face source and
files) so a restore can fetch it again; the restore preview asks the same question of
the nodes of the master it restores onto. Both are best effort: a node that is not
serving or does not answer is reported, never waited for.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nodes import status as node_status
from nodes.agent_client import AgentClient, AgentError
from nodes.models import Node

log = logging.getLogger("mirbad.backups")

FEATURE = "weights.inventory"
TIMEOUT = 5.0
WORKERS = 8


@dataclass(frozen=True)
class NodeFolders:
    """One node's answer: folder name -> its inventory entry, or why there is none."""

    node_id: str
    folders: dict[str, dict[str, Any]] | None
    problem: str | None = None


def _ask(node: Node) -> NodeFolders:
    try:
        with AgentClient(node=node, timeout=TIMEOUT) as client:
            listing = client.model_folders()
    except AgentError as exc:
        return NodeFolders(node.node_id, None, f"did not answer: {exc}")
    folders = {
        str(item.get("folder")): item
        for item in listing.get("folders") or []
        if isinstance(item, dict) and item.get("folder")
    }
    return NodeFolders(node.node_id, folders)


def ask_nodes(nodes: list[Node]) -> dict[str, NodeFolders]:
    """Each node's folders; nodes not serving or without the feature say so."""
    statuses = node_status.read_many(nodes)
    answers: dict[str, NodeFolders] = {}
    reachable: list[Node] = []
    for node in nodes:
        if not node_status.is_serving(statuses.get(node.node_id)):
            state = (statuses.get(node.node_id) or {}).get("state", "unknown")
            answers[node.node_id] = NodeFolders(node.node_id, None, f"not serving ({state})")
        elif FEATURE not in ((node.facts or {}).get("features") or []):
            answers[node.node_id] = NodeFolders(node.node_id, None, "cannot list its weights")
        else:
            reachable.append(node)
    if reachable:
        with ThreadPoolExecutor(max_workers=min(WORKERS, len(reachable))) as pool:
            for answer in pool.map(_ask, reachable):
                answers[answer.node_id] = answer
    return answers


def holds(folders: dict[str, dict[str, Any]], folder: str, file: str) -> bool:
    """Whether a node's folders hold a model's file (not empty): what the preview calls
    present and the fleet phase skips downloading. An operator's own copy counts; a
    download still running has not put the file in place yet."""
    entry = folders.get(folder) or {}
    return any(
        isinstance(f, dict) and f.get("name") == file and (f.get("bytes") or 0) > 0
        for f in entry.get("files") or []
    )


def source_of(entry: dict[str, Any]) -> dict[str, Any] | None:
    """A fetched folder's source and files, as a restore needs them to fetch it again."""
    source = entry.get("source")
    if not isinstance(source, dict) or not source.get("repoId") or not entry.get("fetched"):
        return None
    files = [
        {"name": f["name"], "bytes": f["bytes"]}
        for f in entry.get("files") or []
        if isinstance(f, dict) and f.get("fetched")
    ]
    return {
        "kind": "huggingface",
        "repoId": source["repoId"],
        "revision": source.get("revision") or "main",
        "files": files,
        "bytes": sum(int(f["bytes"]) for f in files),
    }
