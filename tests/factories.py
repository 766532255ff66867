"""Small factories for registry rows used across tests."""

from __future__ import annotations

import time
from typing import Any

from models_registry.models import ModelDefinition, Placement
from nodes import status_cache
from nodes.models import Node


def make_node(node_id: str = "n1", **kwargs: Any) -> Node:
    defaults: dict[str, Any] = {
        "address": "https://127.0.0.1:1",
        "approved": True,
        "spki_pin": "pin-" + node_id,
    }
    defaults.update(kwargs)
    return Node.objects.create(node_id=node_id, **defaults)


def make_model(served_name: str = "m1", node: Node | None = None) -> ModelDefinition:
    model = ModelDefinition.objects.create(
        served_name=served_name, source_folder="f", source_file="m.gguf", settings={}
    )
    if node is not None:
        Placement.objects.create(model=model, node=node)
    return model


def set_status(
    node: Node, state: str = "Online", instances: dict[str, dict[str, Any]] | None = None
) -> None:
    status_cache.write(
        {
            "nodeId": node.node_id,
            "state": state,
            "reasons": [],
            "lastSeen": time.time(),
            "instances": instances or {},
            "telemetry": {
                "cpuPercent": 3.0,
                "memory": {"percent": 40.0, "usedBytes": 4 * 2**30, "totalBytes": 10 * 2**30},
            },
        }
    )
