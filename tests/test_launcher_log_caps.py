"""``./mirbad up`` keeps every child's log under MIRBAD_LOG_MAX_BYTES while it runs
(core/supervision.Child.cap_log, mirbad_site/launcher.Launcher.cap_logs; the rule is
protocol/logcap.py), and the two settings are checked like every MIRBAD_* one.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from core.config import load_master_config
from core.envconf import SettingError
from core.supervision import Child
from mirbad_site import launcher
from mirbad_site.launcher import Launcher

pytestmark = pytest.mark.timeout(60)

KIB = 1024
# A child that writes a numbered line every millisecond, as a chatty server would.
CHATTY = """
import sys, time
i = 0
while True:
    sys.stdout.write("child line %06d %s\\n" % (i, "." * 80))
    sys.stdout.flush()
    i += 1
    time.sleep(0.001)
"""


def test_the_settings_and_their_errors(tmp_path: Path) -> None:
    env = {"MIRBAD_DATA_PATH": str(tmp_path)}
    config = load_master_config(env)
    assert (config.log_max_bytes, config.log_files) == (64 * 1024 * 1024, 3)
    config = load_master_config({**env, "MIRBAD_LOG_MAX_BYTES": "65536", "MIRBAD_LOG_FILES": "0"})
    assert (config.log_max_bytes, config.log_files) == (65536, 0)
    for name, value, words in (
        ("MIRBAD_LOG_MAX_BYTES", "1000", "out of range"),
        ("MIRBAD_LOG_MAX_BYTES", "64M", "expected a whole number"),
        ("MIRBAD_LOG_FILES", "-1", "out of range"),
    ):
        with pytest.raises(SettingError) as refused:
            load_master_config({**env, name: value})
        assert str(refused.value).startswith(f"{name}: ") and words in str(refused.value)


def test_up_caps_a_childs_log_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "LOG_CHECK_SECONDS", 0.2)  # 2 s in production
    config = load_master_config(
        {
            "MIRBAD_DATA_PATH": str(tmp_path / "var"),
            "MIRBAD_LOG_MAX_BYTES": str(64 * KIB),
            "MIRBAD_LOG_FILES": "2",
        }
    )
    up = Launcher(config=config, demo=False)
    log_path = up.logs / "chatty.log"
    child = Child(name="chatty", argv=[sys.executable, "-c", CHATTY], log_path=log_path)
    up.children.append(child)
    up._spawn(child)
    loop = threading.Thread(target=up.supervise, daemon=True)
    loop.start()
    try:
        # ~100 bytes a millisecond: past 64 KiB in under a second.
        deadline = time.monotonic() + 20
        while not (log_path.parent / "chatty.log.2").exists():
            assert time.monotonic() < deadline, sorted(p.name for p in log_path.parent.iterdir())
            time.sleep(0.1)
    finally:
        up.stopping = True
        loop.join(5)
        up.stop_all()
    names = sorted(p.name for p in log_path.parent.iterdir())
    assert names == ["chatty.log", "chatty.log.1", "chatty.log.2"]
    # Each cut is marked in the fresh file, and the child wrote on from offset 0.
    for name in ("chatty.log.1", "chatty.log.2"):
        text = (log_path.parent / name).read_text()
        assert "\0" not in text and "child line " in text
    newest = (log_path.parent / "chatty.log.1").read_text()
    assert "mirbad: the log passed 65536 bytes and was cut; earlier lines are in chatty.log.1" in (
        newest + log_path.read_text()
    )
    # The numbers run on across the cut: .2, then .1, then the live file.
    lines = [
        line
        for name in ("chatty.log.2", "chatty.log.1", "chatty.log")
        for line in (log_path.parent / name).read_text().splitlines()
        if line.startswith("child line ")
    ]
    numbers = [int(line.split()[2]) for line in lines]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    # Three files, each at most the limit plus what one check interval adds (~20 KB).
    sizes = [p.stat().st_size for p in log_path.parent.iterdir()]
    assert all(size < 64 * KIB + 48 * KIB for size in sizes), sizes


def test_a_log_that_cannot_be_capped_is_reported_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_master_config(
        {
            "MIRBAD_DATA_PATH": str(tmp_path / "var"),
            "MIRBAD_LOG_MAX_BYTES": str(64 * KIB),
            "MIRBAD_LOG_FILES": "1",
        }
    )
    up = Launcher(config=config, demo=False)
    up.logs.mkdir(parents=True)
    log_path = up.logs / "web.log"
    log_path.write_bytes(b"x" * (65 * KIB))
    (up.logs / "web.log.1").mkdir()  # a directory in the way of the copy
    (up.logs / "web.log.1" / "keep").write_text("k")
    up.children.append(Child(name="web", argv=["true"], log_path=log_path))
    up.cap_logs()
    up.cap_logs()
    errors = capsys.readouterr().err
    assert errors.count("mirbad: could not cap the log of web: ") == 1, errors
    assert log_path.stat().st_size == 65 * KIB
