"""The backup document: what each section holds, and how the reader refuses a bad one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from backups import crypto
from backups.document import build
from backups.reader import BackupInvalid, parse
from models_registry.models import MemorySample, Placement
from nodes.models import JoinToken, Node
from nodes.services import master_pki
from router import keys
from tests.factories import make_model, make_node

pytestmark = pytest.mark.django_db
PASS = "a long enough passphrase"


def _fleet() -> dict[str, Any]:
    n1 = make_node("n1", display_name="Box one", draining=True, gpu_reserves={"GPU-1": 5})
    n2 = make_node("n2", pending_pin="pending-secret-pin", revoked=True)
    JoinToken.objects.create(
        token_hash="f" * 64, node_id="n3", purpose="join", expires_at="2030-01-01T00:00:00Z"
    )
    m1 = make_model("alpha", node=n1)
    m1.auto_start, m1.desired_state, m1.memory_budget_bytes = True, "running", 123
    m1.settings = {"ctx_size": 2048}
    m1.save()
    Placement.objects.create(model=m1, node=n2, gpu_uuids=["GPU-1"], gpu_budgets=[7])
    make_model("beta")
    row, plaintext = keys.create_key(name="app", scopes=["chat"], model_allowlist=["alpha"])
    MemorySample.objects.create(
        model=m1, served_name="alpha", node_id="n1", instance_id="m1-p1", ready_at="t",
        budget_bytes=10, measured_bytes=9, kind="rss",
    )  # fmt: skip
    return {"n1": n1, "n2": n2, "key": row, "plaintext": plaintext}


def test_the_open_sections_hold_what_is_not_secret(master_identity: Any, backup_dir: Path) -> None:
    fleet = _fleet()
    built = build(passphrase=None, include_ca=True)
    text = built.data.decode()
    document = json.loads(text)
    assert document["schemaVersion"] == 2 and "secrets" not in document
    assert document["master"] == {
        "instanceId": master_identity.instance_id,
        "epoch": master_identity.epoch,
    }
    nodes = {n["nodeId"]: n for n in document["nodes"]}
    assert nodes["n1"]["draining"] is True and nodes["n1"]["gpuReserves"] == {"GPU-1": 5}
    assert nodes["n1"]["certSpkiSha256"] == "pin-n1"
    assert nodes["n2"]["revoked"] is True
    models = {m["servedName"]: m for m in document["models"]}
    assert [p["node"] for p in models["alpha"]["placements"]] == ["n1", "n2"]
    second = Placement.objects.get(node__node_id="n2")
    assert models["alpha"]["id"] == second.model_id
    assert models["alpha"]["placements"][1] == {
        "id": second.pk, "node": "n2", "gpuUuids": ["GPU-1"], "gpuBudgets": [7]
    }  # fmt: skip
    assert document["sources"] == {}  # no node is serving: nothing to ask
    assert document["runningModels"] == {"n1": ["alpha"], "n2": ["alpha"]}
    assert document["history"]["memorySamples"][0]["measuredBytes"] == 9
    # Never: a pending pin, a join token's hash, a key's hash or the CA key.
    assert "pending-secret-pin" not in text
    assert "f" * 64 not in text
    assert fleet["key"].key_hash not in text
    assert "PRIVATE KEY" not in text


def test_the_secrets_section_is_sealed_and_opens_with_the_passphrase(
    master_identity: Any, backup_dir: Path
) -> None:
    fleet = _fleet()
    built = build(passphrase=PASS, include_ca=True, log2_n=crypto.MIN_LOG2_N)
    assert built.has_secrets and built.has_ca
    assert fleet["key"].key_hash not in built.data.decode()
    backup = parse(built.data, passphrase=PASS)
    assert backup.sealed
    assert [k["keyHash"] for k in backup.api_keys] == [fleet["key"].key_hash]
    assert backup.api_keys[0]["modelAllowlist"] == ["alpha"]
    assert backup.ca is not None
    ca = master_pki().ca
    assert x509.load_pem_x509_certificate(backup.ca["certPem"].encode()) == ca.cert
    key = serialization.load_pem_private_key(backup.ca["keyPem"].encode(), password=None)
    assert key.private_numbers() == ca.key.private_numbers()  # type: ignore[union-attr]
    without_ca = parse(
        build(passphrase=PASS, include_ca=False, log2_n=crypto.MIN_LOG2_N).data, passphrase=PASS
    )
    assert without_ca.ca is None and len(without_ca.api_keys) == 1


def test_without_the_passphrase_the_open_sections_still_read(backup_dir: Path) -> None:
    _fleet()
    backup = parse(build(passphrase=PASS, include_ca=True, log2_n=crypto.MIN_LOG2_N).data)
    assert backup.sealed and backup.secrets is None and backup.api_keys == []
    assert {m["servedName"] for m in backup.models} == {"alpha", "beta"}
    assert {n["nodeId"] for n in backup.nodes} == {"n1", "n2"}


def _valid() -> dict[str, Any]:
    return {
        "schemaVersion": 2,
        "models": [
            {
                "servedName": "alpha",
                "source": {"folder": "f", "file": "m.gguf"},
                "placements": [{"node": "n1"}],
            }
        ],
        "nodes": [{"nodeId": "n1", "address": "https://10.0.0.1:9443"}],
    }


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (lambda d: d.update(schemaVersion=3), "$.schemaVersion"),
        (lambda d: d.update(schemaVersion="2"), "$.schemaVersion"),
        (lambda d: d.update(format="other"), "$.format"),
        (lambda d: d.update(models={}), "$.models"),
        (lambda d: d["models"][0].update(servedName=5), "$.models[0].servedName"),
        (lambda d: d["models"][0].update(servedName=""), "$.models[0].servedName"),
        (lambda d: d["models"][0]["source"].update(folder=".."), "$.models[0].source.folder"),
        (lambda d: d["models"][0]["source"].update(folder="a/b"), "$.models[0].source.folder"),
        (lambda d: d["models"][0].update(runtime="tgi"), "$.models[0].runtime"),
        (lambda d: d["models"][0].update(autoStart="yes"), "$.models[0].autoStart"),
        (lambda d: d["models"][0].update(memoryBudgetBytes=-1), "$.models[0].memoryBudgetBytes"),
        (lambda d: d["models"][0]["placements"][0].update(node="N 1"), "$.models[0].placements[0].node"),
        (lambda d: d["models"].append(dict(d["models"][0])), "$.models[1].servedName"),
        (lambda d: d["nodes"][0].update(address="http://x"), "$.nodes[0].address"),
        (lambda d: d["nodes"][0].update(approved=1), "$.nodes[0].approved"),
        (lambda d: d["nodes"][0].update(certNotAfter="tomorrow"), "$.nodes[0].certNotAfter"),
        (lambda d: d.update(master={"epoch": -1}), "$.master.epoch"),
        (lambda d: d.update(runningModels={"n1": "alpha"}), "$.runningModels.n1"),
        (lambda d: d["models"][0].update(servedName="a\x00b"), "$.models[0].servedName"),
    ],
)  # fmt: skip
def test_a_malformed_document_names_the_first_problem(change: Any, path: str) -> None:
    document = _valid()
    change(document)
    with pytest.raises(BackupInvalid) as caught:
        parse(json.dumps(document).encode())
    assert caught.value.path == path, str(caught.value)
    assert str(caught.value).startswith(path + ": ")


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"\xff\xfe", "not UTF-8"), (b"{", "not JSON"), (b"[]", "must be an object")],
)
def test_not_a_document_at_all(data: bytes, message: str) -> None:
    with pytest.raises(BackupInvalid, match=message):
        parse(data)


def test_unknown_sections_and_fields_are_ignored() -> None:
    document = _valid()
    document["hostUnits"] = {"anything": [1, 2]}
    document["models"][0]["tags"] = ["new"]
    backup = parse(json.dumps(document).encode())
    assert backup.models[0]["servedName"] == "alpha"
    assert "tags" not in backup.models[0]


def test_a_version_1_document_reads_without_placements_or_nodes() -> None:
    document = _valid()
    document["schemaVersion"] = 1
    backup = parse(json.dumps(document).encode())
    assert backup.schema_version == 1
    assert backup.models[0]["placements"] == [] and backup.nodes == []


def test_a_version_1_document_cannot_carry_the_ca() -> None:
    plaintext = json.dumps({"apiKeys": [], "ca": {"certPem": "x", "keyPem": "y"}}).encode()
    sealed = crypto.seal(plaintext, passphrase=PASS, schema_version=1, log2_n=crypto.MIN_LOG2_N)
    data = json.dumps({"schemaVersion": 1, "secrets": sealed}).encode()
    with pytest.raises(BackupInvalid) as caught:
        parse(data, passphrase=PASS)
    assert caught.value.path == "$.secrets.ca"


def test_a_bad_api_key_record_names_its_field() -> None:
    plaintext = json.dumps({"apiKeys": [{"id": 1, "name": "a", "prefix": "p",
                                         "keyHash": "nothex", "scopes": []}]}).encode()  # fmt: skip
    sealed = crypto.seal(plaintext, passphrase=PASS, schema_version=2, log2_n=crypto.MIN_LOG2_N)
    with pytest.raises(BackupInvalid) as caught:
        parse(json.dumps({"schemaVersion": 2, "secrets": sealed}).encode(), passphrase=PASS)
    assert caught.value.path == "$.secrets.apiKeys[0].keyHash"


def test_an_oversized_document_is_refused_before_parsing() -> None:
    from backups import reader

    with pytest.raises(BackupInvalid, match="at most"):
        parse(b" " * (reader.MAX_DOCUMENT_BYTES + 1))


def test_nodes_are_counted_in_the_built_summary(backup_dir: Path) -> None:
    _fleet()
    built = build(passphrase=None, include_ca=False)
    assert (built.models, built.nodes) == (2, Node.objects.count())
