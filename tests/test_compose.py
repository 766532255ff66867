"""docker-compose.yml is valid compose YAML and uses only settings the code knows."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_services_and_settings() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("db", "redis", "web", "monitor", "worker", "beat", "agent"):
        assert name in services, name
    for name, service in services.items():
        assert "image" in service or "build" in service, name
    known = set(re.findall(r'"(MIRBAD_[A-Z_]+)"', (ROOT / "core" / "config.py").read_text()))
    used = {
        key
        for service in services.values()
        for key in (service.get("environment") or {})
        if key.startswith("MIRBAD_") and not key.startswith("MIRBAD_AGENT_")
    }
    assert used - known == set(), f"compose sets unknown settings: {used - known}"
    readme = (ROOT / "README.md").read_text()
    undocumented = {k for k in known if k not in readme}
    assert undocumented == set(), f"settings missing from the README: {undocumented}"
