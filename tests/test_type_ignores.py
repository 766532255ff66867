"""Every ``type: ignore`` in the product names its error code and says why beside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "agent",
    "protocol",
    "core",
    "console",
    "nodes",
    "models_registry",
    "router",
    "backups",
    "mirbad_site",
)
# "# type: ignore[code]  # why" (the reason may also be the comment line just above).
WITH_REASON = re.compile(r"#\s*type:\s*ignore\[[a-z0-9_,-]+\]\s*#\s*\S")


def test_every_type_ignore_has_a_code_and_a_reason() -> None:
    checked = 0
    bare = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            checked += 1
            lines = path.read_text().splitlines()
            for number, line in enumerate(lines, 1):
                if "type: ignore" not in line or WITH_REASON.search(line):
                    continue
                above = lines[number - 2].strip() if number > 1 else ""
                if re.search(r"type:\s*ignore\[[a-z0-9_,-]+\]", line) and above.startswith("#"):
                    continue
                bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert checked > 100, "the scan found too few files to mean anything"
    assert not bare, "type: ignore without a code and a reason:\n" + "\n".join(bare)
