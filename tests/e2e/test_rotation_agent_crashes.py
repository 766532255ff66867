"""kill -9 of a real agent at every point of a certificate rotation (issue 13): the
master (its services, in this process) drives the rotation one stored stage at a time
against ``python -m agent run``; between two steps the agent is killed with SIGKILL
and started again. Twenty runs per point: every one ends committed, the agent on one
valid certificate the master pins, and no pending key file left behind."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from nodes import rotation
from nodes.models import CertRotation
from tests.e2e.rotation_support import beat_passes, rotation_rig

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]

RUNS = int(os.environ.get("MIRBAD_TEST_CRASH_RUNS", "20"))  # the issue asks for 20
Stage = CertRotation.Stage
# The points where the agent dies: how many steps the master took before the kill.
# 0: nothing sent yet; 1: the agent holds a key (KeyGenerated); 2: the master signed
# and stored the pending pin; 3: the agent presents the new certificate (CertInstalled);
# 4: the commit went through (the agent promoted, the master has not yet).
POINTS = {0: Stage.REQUESTED, 1: Stage.CSR_RECEIVED, 2: Stage.CERT_ISSUED,
          3: Stage.CERT_INSTALLED, 4: Stage.COMMITTED}  # fmt: skip


def test_the_agent_killed_at_every_point_of_a_rotation(
    settings: Any, master_identity: Any, tmp_path: Path
) -> None:
    settings.MIRBAD = replace(settings.MIRBAD, rotation_pin_grace_seconds=0.0)
    outcomes: dict[int, list[str]] = {point: [] for point in POINTS}
    with rotation_rig(tmp_path, "crashy") as (node, agent, _):
        for point, stage in POINTS.items():
            for _ in range(RUNS):
                opened = rotation.request_rotation("crashy")
                if point:
                    reached = rotation.advance(opened.rotation_id, steps=point)
                    assert reached.stage == stage, (point, reached.stage, reached.last_error)
                agent.kill()
                agent.start()
                agent.wait_ready(node)
                outcomes[point].append(beat_passes(opened.rotation_id).stage)
                agent.assert_on_the_pinned_certificate(node)
        # Killing the agent never costs a rotation that was under way: each one commits.
        assert outcomes == {point: [Stage.COMMITTED] * RUNS for point in POINTS}, outcomes
