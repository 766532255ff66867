"""Restore: the preview, applying definitions and keys, and rebuilding an empty master."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from backups import crypto, restore
from backups.document import build
from backups.reader import parse
from core.errors import ServiceError
from models_registry.models import MemorySample, ModelDefinition, Placement
from nodes import fencing
from nodes.models import AuditEvent, Node
from router import keys
from router.models import ApiKey
from tests.factories import make_model, make_node

pytestmark = pytest.mark.django_db
PASS = "a long enough passphrase"


@pytest.fixture
def old_master(settings: Any, tmp_path: Path) -> Path:
    """A master of its own data directory, with an identity at epoch 7."""
    data = tmp_path / "old"
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, data_path=data)
    for _ in range(7):
        fencing.begin_epoch(data)
    return data


def _fleet() -> None:
    n1 = make_node("n1", display_name="Box", gpu_reserves={"GPU-1": 3}, draining=True,
                   facts={"disks": [{"path": "/models", "totalBytes": 1000}], "gpus": []})  # fmt: skip
    n2 = make_node("n2", revoked=True, memory_reserve_bytes=5)
    alpha = make_model("alpha", node=n1)
    alpha.auto_start, alpha.desired_state, alpha.memory_budget_bytes = True, "running", 9
    alpha.settings = {"context_size": 512}
    alpha.save()
    Placement.objects.create(model=alpha, node=n2)
    make_model("beta")
    keys.create_key(name="app", scopes=["chat"], model_allowlist=["alpha"], rpm_limit=5)
    keys.create_key(name="ops", scopes=["admin"])
    MemorySample.objects.create(
        model=alpha, served_name="alpha", node_id="n1", instance_id="m1-p1", ready_at="t1",
        budget_bytes=10, measured_bytes=9, kind="rss",
    )  # fmt: skip


def _wipe() -> None:
    MemorySample.objects.all().delete()
    ModelDefinition.objects.all().delete()
    Node.objects.all().delete()
    ApiKey.objects.all().delete()


def _sections(data: bytes) -> dict[str, Any]:
    document = json.loads(data)
    opened = parse(data, passphrase=PASS)
    document["secrets"] = opened.secrets
    return document


def test_round_trip_every_section_field_by_field(
    old_master: Path, settings: Any, tmp_path: Path
) -> None:
    """Back up a master with nodes, models, keys and the CA; rebuild an empty master
    from it; its own backup equals the first in every section and field."""
    _fleet()
    first = build(passphrase=PASS, include_ca=True, log2_n=crypto.MIN_LOG2_N).data
    _wipe()
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, data_path=tmp_path / "new")
    done = restore.rebuild(parse(first, passphrase=PASS), actor="test")
    second = build(passphrase=PASS, include_ca=True, log2_n=crypto.MIN_LOG2_N).data
    a, b = _sections(first), _sections(second)
    assert set(a) == set(b)
    for section in sorted(set(a) - {"createdAt", "master"}):
        if isinstance(a[section], list):
            assert len(a[section]) == len(b[section]), section
            for i, (x, y) in enumerate(zip(a[section], b[section], strict=True)):
                for field in sorted(set(x) | set(y)):
                    assert x.get(field) == y.get(field), f"{section}[{i}].{field}"
        elif isinstance(a[section], dict):
            for field in sorted(set(a[section]) | set(b[section])):
                assert a[section].get(field) == b[section].get(field), f"{section}.{field}"
        else:
            assert a[section] == b[section], section
    assert b["master"]["instanceId"] == a["master"]["instanceId"]
    assert b["master"]["epoch"] > a["master"]["epoch"] == 7
    assert done["epoch"] == b["master"]["epoch"]
    # The keys still authenticate: the hashes came back, and new rows do not collide.
    assert keys.create_key(name="after", scopes=["chat"])[0].pk > max(
        k["id"] for k in a["secrets"]["apiKeys"]
    )
    event = AuditEvent.objects.get(action="master.rebuilt")
    assert event.detail["backupEpoch"] == 7 and event.detail["epoch"] == done["epoch"]
    assert set(event.detail["nodes"]) == {"n1"}  # the revoked node is not asked


def _backup(**options: Any) -> bytes:
    return build(passphrase=PASS, include_ca=True, log2_n=crypto.MIN_LOG2_N, **options).data


def test_rebuild_is_refused_without_the_ca(old_master: Path, settings: Any, tmp_path: Path) -> None:
    _fleet()
    without_secrets = build(passphrase=None, include_ca=True).data
    without_ca = build(passphrase=PASS, include_ca=False, log2_n=crypto.MIN_LOG2_N).data
    _wipe()
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, data_path=tmp_path / "new")
    for data, passphrase, reason in (
        (without_secrets, None, "no secrets section"),
        (without_ca, PASS, "holds no CA"),
        (without_ca, None, "give the backup's passphrase"),
    ):
        with pytest.raises(ServiceError) as caught:
            restore.rebuild(parse(data, passphrase=passphrase), actor="test")
        assert caught.value.code == "rebuild_refused" and reason in caught.value.message
    assert not Node.objects.exists() and not (tmp_path / "new" / "pki").exists()


def test_rebuild_is_refused_on_a_master_that_is_not_empty(old_master: Path) -> None:
    _fleet()
    with pytest.raises(ServiceError, match="not empty"):
        restore.rebuild(parse(_backup(), passphrase=PASS), actor="test")


def test_rebuild_is_refused_over_another_ca(
    old_master: Path, settings: Any, tmp_path: Path
) -> None:
    from nodes import pki

    _fleet()
    data = _backup()
    _wipe()
    new = tmp_path / "new"
    settings.MIRBAD = dataclasses.replace(settings.MIRBAD, data_path=new)
    pki.load_or_create_ca(new / "pki")
    with pytest.raises(ServiceError, match="already has its own CA"):
        restore.rebuild(parse(data, passphrase=PASS), actor="test")


def test_preview_changes_nothing_and_says_what_would(old_master: Path) -> None:
    _fleet()
    data = _backup()
    alpha = ModelDefinition.objects.get(served_name="alpha")
    alpha.settings = {"context_size": 1024}
    alpha.save()
    ModelDefinition.objects.filter(served_name="beta").delete()
    ApiKey.objects.filter(name="ops").delete()
    before = (ModelDefinition.objects.count(), ApiKey.objects.count())
    shown = restore.preview(parse(data, passphrase=PASS))
    assert (ModelDefinition.objects.count(), ApiKey.objects.count()) == before
    models = {m["servedName"]: m for m in shown["models"]}
    assert models["beta"]["status"] == "new" and models["beta"]["problem"] is None
    assert models["alpha"]["status"] == "changed"
    assert [c["field"] for c in models["alpha"]["changes"]] == ["settings"]
    assert models["alpha"]["changes"][0]["backup"]["context_size"] == 512
    assert models["alpha"]["changes"][0]["current"]["context_size"] == 1024
    # n2 is revoked here: the placement would be refused, and the preview says so.
    assert "n2" in models["alpha"]["problem"]
    folders = {f["node"]: f for f in models["alpha"]["folders"]}
    assert folders["n1"]["present"] is None and "not serving" in folders["n1"]["note"]
    assert [k["name"] for k in shown["apiKeys"]["add"]] == ["ops"]
    assert [k["name"] for k in shown["apiKeys"]["present"]] == ["app"]
    assert {n["nodeId"]: n["status"] for n in shown["nodes"]} == {"n1": "known", "n2": "known"}
    assert shown["rebuild"] is not None and "not empty" in shown["rebuild"]
    locked = restore.preview(parse(data))
    assert locked["apiKeys"]["state"] == "locked" and not locked["secretsOpened"]


def test_preview_flags_storage_that_differs(old_master: Path) -> None:
    _fleet()
    data = _backup()
    Node.objects.filter(node_id="n1").update(
        facts={"disks": [{"path": "/other", "totalBytes": 1000}]}
    )
    make_node("n9")
    shown = {n["nodeId"]: n for n in restore.preview(parse(data))["nodes"]}
    assert shown["n1"]["storage"]["differs"] is True
    assert shown["n9"]["status"] == "not in backup"


def test_apply_writes_definitions_with_placements_and_merges_keys(old_master: Path) -> None:
    _fleet()
    Node.objects.filter(node_id="n2").update(revoked=False)
    data = _backup()
    app = ApiKey.objects.get(name="app")
    ModelDefinition.objects.all().delete()
    ApiKey.objects.all().delete()
    other = ApiKey.objects.create(pk=app.pk, name="taken", prefix="x", key_hash="0" * 64)
    result = restore.apply(parse(data, passphrase=PASS), served_names=None, actor="test")
    assert {r["servedName"]: r["result"] for r in result["models"]} == {
        "alpha": "created", "beta": "created"
    }  # fmt: skip
    alpha = ModelDefinition.objects.get(served_name="alpha")
    assert sorted(alpha.placements.values_list("node__node_id", flat=True)) == ["n1", "n2"]
    assert alpha.settings["context_size"] == 512 and alpha.auto_start
    assert alpha.desired_state == "stopped"  # started by the fleet phase, not by the write
    # The key whose id is taken here is not added over another key; the other one is.
    assert ApiKey.objects.get(pk=other.pk).name == "taken"
    assert ApiKey.objects.filter(name="ops").exists()
    again = restore.apply(parse(data, passphrase=PASS), served_names=["alpha"], actor="test")
    assert again["models"] == [{"servedName": "alpha", "result": "unchanged"}]
    assert again["apiKeysAdded"] == []
    assert AuditEvent.objects.filter(action="backup.restored").count() == 2


def test_apply_reports_a_refused_model_and_goes_on(old_master: Path) -> None:
    _fleet()
    data = _backup()  # alpha is placed on n2, which is revoked here
    ModelDefinition.objects.all().delete()
    result = restore.apply(parse(data), served_names=None, actor="test")
    outcome = {r["servedName"]: r for r in result["models"]}
    assert outcome["alpha"]["result"] == "refused" and "n2" in outcome["alpha"]["reason"]
    assert outcome["beta"]["result"] == "created"
    assert list(ModelDefinition.objects.values_list("served_name", flat=True)) == ["beta"]


def test_a_version_1_backup_goes_to_the_bootstrap_node(settings: Any) -> None:
    boot = make_node(settings.MIRBAD.bootstrap_node_id, is_bootstrap=True)
    document = {
        "schemaVersion": 1,
        "models": [{"servedName": "old", "source": {"folder": "f", "file": "m.gguf"}}],
    }
    result = restore.apply(parse(json.dumps(document).encode()), served_names=None, actor="t")
    assert result["models"] == [{"servedName": "old", "result": "created"}]
    model = ModelDefinition.objects.get(served_name="old")
    assert [p.node_id for p in model.placements.all()] == [boot.pk]


def test_apply_names_an_unknown_model() -> None:
    document = {"schemaVersion": 2, "models": []}
    with pytest.raises(ServiceError, match="'ghost' is not a model of this backup"):
        restore.apply(parse(json.dumps(document).encode()), served_names=["ghost"], actor="t")


def test_a_folder_is_present_when_it_holds_the_models_file() -> None:
    from backups.inventory import holds

    folders = {
        "f": {"files": [{"name": "m.gguf", "bytes": 10}, {"name": "empty.gguf", "bytes": 0}]}
    }
    assert holds(folders, "f", "m.gguf")
    assert not holds(folders, "f", "empty.gguf")  # a file being written, or truncated
    assert not holds(folders, "f", "other.gguf")
    assert not holds(folders, "g", "m.gguf")
