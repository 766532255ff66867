"""The sealed secrets section: AES-256-GCM under scrypt, bound to the document's version."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from backups import crypto
from backups.reader import BackupInvalid, WrongPassphrase, parse

PASS = "a long enough passphrase"
LOW = crypto.MIN_LOG2_N  # the cheapest cost the reader accepts: these tests seal in loops


def _document(sealed: dict[str, Any], version: int = 2) -> bytes:
    return json.dumps({"schemaVersion": version, "models": [], "secrets": sealed}).encode()


def _small_section() -> dict[str, Any]:
    plaintext = json.dumps({"apiKeys": []}).encode()
    return crypto.seal(plaintext, passphrase=PASS, schema_version=2, log2_n=LOW)


def test_seal_and_open_round_trip() -> None:
    sealed = crypto.seal(b'{"x": 1}', passphrase=PASS, schema_version=2, log2_n=LOW)
    assert crypto.open_sealed(sealed, passphrase=PASS, schema_version=2) == b'{"x": 1}'
    assert sealed["cipher"] == "AES-256-GCM"
    assert sealed["kdf"]["name"] == "scrypt" and sealed["kdf"]["log2N"] == LOW
    assert b'"x"' not in base64.b64decode(sealed["ciphertext"])


def test_the_default_cost_is_what_scheduled_backups_use() -> None:
    sealed = crypto.seal(b"{}", passphrase=PASS, schema_version=2)
    assert sealed["kdf"]["log2N"] == crypto.DEFAULT_LOG2_N == 15
    assert sealed["kdf"]["r"] == 8


def test_a_wrong_passphrase_says_only_that() -> None:
    with pytest.raises(WrongPassphrase) as caught:
        parse(_document(_small_section()), passphrase="another long passphrase")
    assert str(caught.value) == "wrong passphrase"


@pytest.mark.parametrize("part", ["ciphertext", "nonce", "salt"])
def test_every_single_byte_flip_fails(part: str) -> None:
    """Each byte position of a small section, each of its bits' worth: one flipped byte
    anywhere (tag included) and the reader refuses, saying only "wrong passphrase"."""
    sealed = _small_section()
    holder = sealed["kdf"] if part == "salt" else sealed
    raw = base64.b64decode(holder[part])
    assert parse(_document(sealed), passphrase=PASS).api_keys == []
    for position in range(len(raw)):
        changed = bytearray(raw)
        changed[position] ^= 0x01
        tampered = copy.deepcopy(sealed)
        target = tampered["kdf"] if part == "salt" else tampered
        target[part] = base64.b64encode(bytes(changed)).decode()
        with pytest.raises(WrongPassphrase):
            parse(_document(tampered), passphrase=PASS)


def test_changed_kdf_parameters_fail() -> None:
    sealed = _small_section()
    for name, value in (("log2N", LOW + 1), ("r", 7), ("p", 2)):
        tampered = copy.deepcopy(sealed)
        tampered["kdf"][name] = value
        with pytest.raises(WrongPassphrase):
            parse(_document(tampered), passphrase=PASS)


def test_a_version_2_section_never_opens_in_a_version_1_document() -> None:
    sealed = _small_section()
    with pytest.raises(WrongPassphrase):
        parse(_document(sealed, version=1), passphrase=PASS)
    v1 = crypto.seal(b'{"apiKeys": []}', passphrase=PASS, schema_version=1, log2_n=LOW)
    assert parse(_document(v1, version=1), passphrase=PASS).api_keys == []
    with pytest.raises(WrongPassphrase):
        parse(_document(v1, version=2), passphrase=PASS)


def test_ten_thousand_backups_never_reuse_a_nonce() -> None:
    nonces = set()
    salts = set()
    for _ in range(10_000):
        sealed = crypto.seal(b"{}", passphrase=PASS, schema_version=2, log2_n=LOW)
        nonces.add(sealed["nonce"])
        salts.add(sealed["kdf"]["salt"])
    assert len(nonces) == 10_000
    assert len(salts) == 10_000


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (lambda s: s.update(cipher="AES-128-CBC"), "$.secrets.cipher"),
        (lambda s: s.update(nonce="not base64!"), "$.secrets.nonce"),
        (lambda s: s.update(nonce=base64.b64encode(b"short").decode()), "$.secrets.nonce"),
        (lambda s: s["kdf"].update(log2N=30), "$.secrets.kdf.log2N"),
        (lambda s: s["kdf"].update(r=True), "$.secrets.kdf.r"),
        (lambda s: s["kdf"].update(name="pbkdf2"), "$.secrets.kdf.name"),
        (lambda s: s.pop("ciphertext"), "$.secrets.ciphertext"),
        (lambda s: s.update(ciphertext=""), "$.secrets.ciphertext"),
    ],
)
def test_a_malformed_section_names_its_field(change: Any, path: str) -> None:
    sealed = _small_section()
    change(sealed)
    with pytest.raises(BackupInvalid) as caught:
        parse(_document(sealed), passphrase=PASS)
    assert caught.value.path == path
    assert not isinstance(caught.value, WrongPassphrase)


@pytest.mark.parametrize("passphrase", ["short", "x" * 11, "twelve chars\x00!"])
def test_a_weak_passphrase_is_refused_before_sealing(passphrase: str) -> None:
    with pytest.raises(ValueError, match="passphrase"):
        crypto.seal(b"{}", passphrase=passphrase, schema_version=2)
