"""The sealed ``secrets`` section of a backup (docs/operator-guide.md, "Backups").

AES-256-GCM under a key derived from the operator's passphrase with scrypt. The
scrypt parameters and a random salt travel with the section, a fresh random 96-bit
nonce is drawn for every backup, and the associated data
``mirbadllm-backup/v{schemaVersion}`` binds the section to the document's version:
a version-2 section (which may hold the CA key) never opens inside a document that
claims version 1. GCM's tag makes any changed byte of the ciphertext, nonce, salt or
parameters fail as a whole; the reader then says "wrong passphrase" and nothing else,
because a wrong passphrase and a tampered section are indistinguishable by design.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from core.config import MIN_BACKUP_PASSPHRASE

CIPHER = "AES-256-GCM"
KDF = "scrypt"
NONCE_BYTES = 12
SALT_BYTES = 16

# The bounds a document's stored parameters must keep: a hostile file must not make
# the reader spend gigabytes (scrypt needs 128 * n * r bytes) or accept a trivial cost.
MIN_LOG2_N = 10
MAX_LOG2_N = 18
MAX_R = 16
MAX_P = 4
# 32 MiB and about 60 ms on the hardware this was measured on (docs/decisions.md D69).
DEFAULT_LOG2_N = 15
DEFAULT_R = 8
DEFAULT_P = 1
MIN_PASSPHRASE = MIN_BACKUP_PASSPHRASE


class WrongPassphrase(Exception):
    """The section did not open: a wrong passphrase or a changed byte, never said apart."""

    def __init__(self) -> None:
        super().__init__("wrong passphrase")


@dataclass(frozen=True, kw_only=True)
class KdfParams:
    """scrypt's cost parameters and salt, as stored beside the ciphertext."""

    log2_n: int = DEFAULT_LOG2_N
    r: int = DEFAULT_R
    p: int = DEFAULT_P
    salt: bytes = b""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": KDF,
            "log2N": self.log2_n,
            "r": self.r,
            "p": self.p,
            "salt": _b64(self.salt),
        }


def associated_data(schema_version: int) -> bytes:
    return f"mirbadllm-backup/v{schema_version}".encode()


def passphrase_problem(passphrase: str) -> str | None:
    """Why a passphrase cannot seal a backup, or None."""
    if len(passphrase) < MIN_PASSPHRASE:
        return f"must be at least {MIN_PASSPHRASE} characters"
    if "\x00" in passphrase:
        return "must not contain a NUL character"
    return None


def derive_key(passphrase: str, params: KdfParams) -> bytes:
    return Scrypt(salt=params.salt, length=32, n=2**params.log2_n, r=params.r, p=params.p).derive(
        passphrase.encode("utf-8")
    )


def seal(
    plaintext: bytes,
    *,
    passphrase: str,
    schema_version: int,
    log2_n: int = DEFAULT_LOG2_N,
) -> dict[str, Any]:
    """Encrypt one secrets section: a new salt, a new nonce, the version bound in."""
    problem = passphrase_problem(passphrase)
    if problem:
        raise ValueError(f"passphrase: {problem}")
    if not MIN_LOG2_N <= log2_n <= MAX_LOG2_N:
        raise ValueError(f"log2_n must be between {MIN_LOG2_N} and {MAX_LOG2_N}")
    params = KdfParams(log2_n=log2_n, salt=os.urandom(SALT_BYTES))
    nonce = os.urandom(NONCE_BYTES)
    ciphertext = AESGCM(derive_key(passphrase, params)).encrypt(
        nonce, plaintext, associated_data(schema_version)
    )
    return {
        "cipher": CIPHER,
        "kdf": params.to_json(),
        "nonce": _b64(nonce),
        "ciphertext": _b64(ciphertext),
    }


class SealedProblem(ValueError):
    """The sealed section is malformed; ``path`` is relative to the section."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def _field(sealed: dict[str, Any], name: str, kind: type) -> Any:
    value = sealed.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise SealedProblem(f".{name}", f"must be {'a string' if kind is str else 'an object'}")
    return value


def _bytes_field(holder: dict[str, Any], name: str, prefix: str, size: int | None) -> bytes:
    text = holder.get(name)
    if not isinstance(text, str):
        raise SealedProblem(f"{prefix}.{name}", "must be a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise SealedProblem(f"{prefix}.{name}", "is not valid base64") from None
    if size is not None and len(raw) != size:
        raise SealedProblem(f"{prefix}.{name}", f"must decode to {size} bytes, not {len(raw)}")
    return raw


def _int_field(kdf: dict[str, Any], name: str, low: int, high: int) -> int:
    value = kdf.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SealedProblem(f".kdf.{name}", f"must be an integer from {low} to {high}")
    return value


def read_params(sealed: dict[str, Any]) -> tuple[KdfParams, bytes, bytes]:
    """The KDF parameters, nonce and ciphertext of a section, checked (SealedProblem)."""
    if _field(sealed, "cipher", str) != CIPHER:
        raise SealedProblem(".cipher", f"must be {CIPHER!r}")
    kdf = _field(sealed, "kdf", dict)
    if kdf.get("name") != KDF:
        raise SealedProblem(".kdf.name", f"must be {KDF!r}")
    params = KdfParams(
        log2_n=_int_field(kdf, "log2N", MIN_LOG2_N, MAX_LOG2_N),
        r=_int_field(kdf, "r", 1, MAX_R),
        p=_int_field(kdf, "p", 1, MAX_P),
        salt=_bytes_field(kdf, "salt", ".kdf", SALT_BYTES),
    )
    nonce = _bytes_field(sealed, "nonce", "", NONCE_BYTES)
    ciphertext = _bytes_field(sealed, "ciphertext", "", None)
    if len(ciphertext) < 16:
        raise SealedProblem(".ciphertext", "is shorter than its 16-byte tag")
    return params, nonce, ciphertext


def open_sealed(sealed: dict[str, Any], *, passphrase: str, schema_version: int) -> bytes:
    """The plaintext of a section; WrongPassphrase when it does not authenticate."""
    params, nonce, ciphertext = read_params(sealed)
    try:
        return AESGCM(derive_key(passphrase, params)).decrypt(
            nonce, ciphertext, associated_data(schema_version)
        )
    except InvalidTag:
        raise WrongPassphrase() from None


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
