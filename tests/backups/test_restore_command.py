"""`manage.py restore`: preview, apply with the fleet phase, and its refusals."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from backups import crypto
from backups.document import build
from models_registry.models import ModelDefinition
from tests.factories import make_model, make_node

PASS = "a long enough passphrase"


def _file(tmp_path: Path) -> Path:
    model = make_model("alpha", node=make_node("n1"))
    model.auto_start = True
    model.save()
    path = tmp_path / "b.json"
    path.write_bytes(build(passphrase=PASS, include_ca=False, log2_n=crypto.MIN_LOG2_N).data)
    ModelDefinition.objects.all().delete()
    return path


def _run(*args: str) -> dict:  # type: ignore[type-arg]
    out = StringIO()
    call_command("restore", *args, stdout=out)
    return json.loads(out.getvalue())


@pytest.mark.django_db
def test_preview_prints_and_changes_nothing(tmp_path: Path) -> None:
    shown = _run(str(_file(tmp_path)), "--preview")
    assert [m["status"] for m in shown["models"]] == ["new"]
    assert not ModelDefinition.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_apply_writes_and_runs_the_fleet_phase(tmp_path: Path) -> None:
    secret = tmp_path / "pass"
    secret.write_text(PASS + "\n")
    done = _run(str(_file(tmp_path)), "--passphrase-file", str(secret))
    assert done["models"] == [{"servedName": "alpha", "result": "created"}]
    assert done["steps"][0]["step"] == "failed" and "did not answer" in done["steps"][0]["note"]
    assert ModelDefinition.objects.filter(served_name="alpha").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("content", "message"),
    [(b"{", "is not JSON"), (b'{"schemaVersion": 5}', "$.schemaVersion")],
)
def test_a_bad_file_is_a_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(CommandError, match=message.replace("$", r"\$")):
        _run(str(path), "--preview")
    with pytest.raises(CommandError, match="No such file"):
        _run(str(tmp_path / "missing.json"))


@pytest.mark.django_db
def test_a_wrong_passphrase_says_so(tmp_path: Path) -> None:
    secret = tmp_path / "pass"
    secret.write_text("not the passphrase at all")
    with pytest.raises(CommandError, match="wrong passphrase"):
        _run(str(_file(tmp_path)), "--preview", "--passphrase-file", str(secret))
