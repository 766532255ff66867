"""Several master hosts on one database (nodes/master_store.py, nodes/fencing.py; D80, D81).

A "host" here is a data directory: two of them on the test database must get the
same CA, the same client identity and the same instance id, and epochs that only
rise whichever host starts. The master key: a missing or a wrong one is refused
with the message that names MIRBAD_MASTER_KEY; the single-host default makes one
once. A data directory of an earlier release is imported once.
"""

from __future__ import annotations

import dataclasses
import json
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nodes import fencing, master_store, pki, services
from nodes.models import MasterCredential, MasterState

pytestmark = pytest.mark.django_db

KEY_A = "the master key both hosts were given, " + "a" * 8
KEY_B = "another master key, never given to anyone " + "b" * 8


@pytest.fixture
def host(settings: Any, tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``host(name, key=...)`` makes this process act as that master host."""

    def use(name: str, *, key: str | None = KEY_A) -> Path:
        data = tmp_path / name
        settings.MIRBAD = dataclasses.replace(settings.MIRBAD, data_path=data, master_key=key)
        services.forget_master_pki()
        fencing.forget()
        return data

    MasterCredential.objects.all().delete()
    MasterState.objects.all().delete()
    yield use
    services.forget_master_pki()
    fencing.forget()


def _leaf_pem(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_two_hosts_share_the_ca_the_client_certificate_and_the_identity(
    host: Callable[..., Path],
) -> None:
    a = host("a")
    first = services.master_pki()
    epoch_a = fencing.begin_epoch(a)
    b = host("b")
    second = services.master_pki()
    assert second.ca.cert == first.ca.cert and second.ca.spki_sha256 == first.ca.spki_sha256
    assert second.client.serial == first.client.serial
    # Each host has its own cache files, 0600, written from the database.
    assert second.ca.cert_path == b / "pki" / "ca.crt" != first.ca.cert_path
    assert second.client.path.read_bytes() == first.client.path.read_bytes()
    assert stat.S_IMODE(second.client.path.stat().st_mode) == 0o600
    assert not (b / "pki" / "ca.key").exists() and not (a / "pki" / "ca.key").exists()
    # The enroll certificate too: agents check it against the CA hash, not the host name.
    enroll_b = master_store.ensure_enroll_certificate(second.ca, ["10.0.0.2"])
    host("a")
    enroll_a = master_store.ensure_enroll_certificate(services.master_pki().ca, ["10.0.0.1"])
    assert enroll_a.serial == enroll_b.serial
    # Epochs rise whichever host starts its monitor; the instance id is the first one's.
    host("b")
    epoch_b = fencing.begin_epoch(b)
    host("a")
    epoch_a2 = fencing.begin_epoch(a)
    assert epoch_a.epoch < epoch_b.epoch < epoch_a2.epoch
    assert epoch_a.instance_id == epoch_b.instance_id == epoch_a2.instance_id
    # A web process of the other host sends the new triple (after its brief cache).
    host("b")
    assert fencing.read_identity(b) == epoch_a2
    # The private keys are sealed: no PEM key in the database.
    for row in MasterCredential.objects.all():
        assert "PRIVATE KEY" not in row.sealed_key and row.sealed_key.startswith("v1.")


def test_an_epoch_raise_takes_the_row_in_one_transaction(host: Callable[..., Path]) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    data = host("a")
    fencing.begin_epoch(data)

    with CaptureQueriesContext(connection) as queries:
        fencing.begin_epoch(data, at_least=50)
    sql = " ".join(q["sql"] for q in queries.captured_queries)
    if connection.vendor == "postgresql":
        assert "FOR UPDATE" in sql
    assert MasterState.objects.get().epoch == 50


def test_a_wrong_master_key_is_refused_with_the_message(host: Callable[..., Path]) -> None:
    host("a")
    services.master_pki()
    host("b", key=KEY_B)
    with pytest.raises(master_store.MasterKeyError) as caught:
        services.master_pki()
    assert str(caught.value) == master_store.WRONG_KEY
    assert "MIRBAD_MASTER_KEY does not open the keys stored in the database" in str(caught.value)
    with pytest.raises(master_store.MasterKeyError, match="use the value the other master"):
        master_store.check_key()


def test_a_missing_master_key_is_refused_once_the_database_holds_keys(
    host: Callable[..., Path],
) -> None:
    # The first host without MIRBAD_MASTER_KEY: the single-host default, made once, 0600.
    a = host("a", key=None)
    ca = services.master_pki().ca
    made = a / master_store.KEY_FILE
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    value = made.read_text()
    host("a", key=None)
    assert services.master_pki().ca.cert == ca.cert and made.read_text() == value
    # A second host given nothing: refused, naming the variable, and nothing made.
    b = host("b", key=None)
    with pytest.raises(master_store.MasterKeyError, match="MIRBAD_MASTER_KEY is not set"):
        services.master_pki()
    assert not (b / master_store.KEY_FILE).exists()
    # Given the first host's value, it is the same master.
    host("b", key=value)
    assert services.master_pki().ca.cert == ca.cert


def test_a_short_master_key_is_a_setting_error(tmp_path: Path) -> None:
    from core.config import load_master_config
    from core.envconf import SettingError

    env = {"MIRBAD_DATA_PATH": str(tmp_path), "MIRBAD_MASTER_KEY": "short"}
    with pytest.raises(SettingError, match="MIRBAD_MASTER_KEY: use at least 32"):
        load_master_config(env)
    secret = tmp_path / "key"
    secret.write_text(KEY_A + "\n")
    env = {"MIRBAD_DATA_PATH": str(tmp_path), "MIRBAD_MASTER_KEY_FILE": str(secret)}
    assert load_master_config(env).master_key == KEY_A
    assert KEY_A not in repr(load_master_config(env))


def test_an_earlier_data_directory_is_imported_once(host: Callable[..., Path]) -> None:
    data = host("old")
    # What an earlier release left: the CA files, the client leaf, master.json.
    legacy = pki.load_or_create_ca(data / "pki")
    leaf = pki.ensure_master_client_certificate(legacy)
    (data / "master.json").write_text(
        json.dumps({"instanceId": "0123456789abcdef", "epoch": 41, "bootId": "b00t"})
    )
    mp = services.master_pki()
    assert mp.ca.cert == legacy.cert and mp.client.serial == leaf.serial
    assert not (data / "pki" / "ca.key").exists()  # the plaintext key left the directory
    assert fencing.read_identity(data) == fencing.MasterIdentity("0123456789abcdef", 41, "b00t")
    assert not (data / "master.json").exists() and (data / "master.json.imported").exists()
    assert fencing.begin_epoch(data).epoch == 42
    # Once: a second start (another process) finds it in the database and imports nothing.
    rows = {r.name: r.cert_pem for r in MasterCredential.objects.all()}
    services.forget_master_pki()
    fencing.forget()
    assert services.master_pki().ca.cert == legacy.cert
    assert {r.name: r.cert_pem for r in MasterCredential.objects.all()} == rows
    assert fencing.begin_epoch(data).instance_id == "0123456789abcdef"
    # Another host on the database gets the imported CA.
    other = host("other")
    assert services.master_pki().ca.cert == legacy.cert
    assert _leaf_pem(other / "pki" / "ca.crt") == legacy.cert


def test_a_sealed_key_opens_only_in_its_own_row(host: Callable[..., Path]) -> None:
    host("a")
    services.master_pki()
    ca_row = MasterCredential.objects.get(name="ca")
    client = MasterCredential.objects.get(name="master-client")
    client.sealed_key = ca_row.sealed_key  # a key moved to another row does not open
    client.save()
    with pytest.raises(master_store.MasterKeyError):
        master_store.unseal("master-client", client.sealed_key)
    key = serialization.load_pem_private_key(
        master_store.unseal("ca", ca_row.sealed_key), password=None
    )
    assert key.public_key() == x509.load_pem_x509_certificate(ca_row.cert_pem.encode()).public_key()
