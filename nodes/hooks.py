"""What other apps do when the monitor learns something about a node.

``nodes`` sits below ``models_registry`` (docs/architecture.md, "Layers"), so the
monitor cannot call the model lifecycle itself. The apps above register their
handlers here in ``AppConfig.ready`` (``models_registry/apps.py``): one that records an
instance's measured memory, one that restarts the auto-start models a node lost, and
one that gives the console's model rows (each model's state over all its replicas,
which only the model registry knows how to aggregate). A monitor without a
registered handler does nothing for that event (and says so).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from nodes.events import ModelSummary

log = logging.getLogger("mirbad.nodes.hooks")

# What it returns (the sample it kept, if any) is not used here.
MeasurementHandler = Callable[[str, dict[str, Any]], object]
AutostartHandler = Callable[[str], list[dict[str, Any]]]
ModelRowsHandler = Callable[[str, list[int] | None], list[ModelSummary]]

_measurement: MeasurementHandler | None = None
_autostart: AutostartHandler | None = None
_model_rows: ModelRowsHandler | None = None


def register(
    *,
    measurement: MeasurementHandler | None = None,
    autostart: AutostartHandler | None = None,
    model_rows: ModelRowsHandler | None = None,
) -> None:
    """Set the handlers (a later call replaces an earlier one: ready() may run twice)."""
    global _measurement, _autostart, _model_rows
    if measurement is not None:
        _measurement = measurement
    if autostart is not None:
        _autostart = autostart
    if model_rows is not None:
        _model_rows = model_rows


def record_measurement(node_id: str, instance: dict[str, Any]) -> None:
    """Blocking: run it in a thread from async code."""
    if _measurement is None:
        log.warning("No measurement handler is registered; node %s's is dropped", node_id)
        return
    _measurement(node_id, instance)


def autostart(node_id: str) -> list[dict[str, Any]]:
    """Blocking: the outcomes ({model, started, reason}) of the node's auto-starts."""
    if _autostart is None:
        log.warning("No auto-start handler is registered; node %s starts nothing", node_id)
        return []
    return _autostart(node_id)


def model_rows(node_id: str, model_ids: list[int] | None) -> list[ModelSummary]:
    """Blocking: the console rows of the models placed on the node (``model_ids`` only, if given)."""
    if _model_rows is None:
        log.warning(
            "No model row handler is registered; node %s's models are not published", node_id
        )
        return []
    return _model_rows(node_id, model_ids)
