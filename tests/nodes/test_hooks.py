"""The monitor reaches the model lifecycle only through hooks set in AppConfig.ready."""

from __future__ import annotations

import logging

import pytest

from nodes import hooks


def test_models_registry_registers_its_handlers_at_start_up() -> None:
    from models_registry import lifecycle

    assert hooks._measurement is lifecycle.record_measurement
    assert hooks._autostart is lifecycle.autostart_node


def test_without_handlers_the_monitor_does_nothing_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(hooks, "_measurement", None)
    monkeypatch.setattr(hooks, "_autostart", None)
    with caplog.at_level(logging.WARNING, logger="mirbad.nodes.hooks"):
        hooks.record_measurement("n1", {"instanceId": "i"})
        assert hooks.autostart("n1") == []
    assert "n1" in caplog.text and "auto-start" in caplog.text


def test_registered_handlers_are_called(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    monkeypatch.setattr(hooks, "_measurement", None)
    monkeypatch.setattr(hooks, "_autostart", None)
    hooks.register(
        measurement=lambda node, inst: seen.append((node, inst)),
        autostart=lambda node: [{"model": "m", "started": True, "reason": node}],
    )
    hooks.record_measurement("n2", {"a": 1})
    assert seen == [("n2", {"a": 1})]
    assert hooks.autostart("n2") == [{"model": "m", "started": True, "reason": "n2"}]
