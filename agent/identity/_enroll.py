"""Enrollment: trade a single-use token and a CSR for the node certificate.

The token is a secret, so it is only ever sent over a TLS connection whose certificate
chains to the CA the agent was told to trust by hash (bundle ``caSpkiSha256`` or
``join --ca-hash``). For ``join`` the CA certificate itself is fetched from the enroll
listener's ``GET /ca`` without verification, and its SPKI hash is compared with
``--ca-hash`` before anything else happens; only then is a verified connection made for
``POST /enroll``. Two paths lead here:

- bootstrap mode (``BootstrapDirectory`` set, no identity yet): wait for the master's
  ``bootstrap.json``, enroll with it, delete it;
- ``python -m agent join``: the operator gives URL, CA hash and node id.

Only transient connection problems are retried; a refusal by the master (token used,
expired, node already enrolled) is final and surfaces the master's own message.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509

from agent._config import AgentConfig, validate_node_id
from agent._errors import (
    EnrollmentError,
    EnrollmentRefused,
    IdentityError,
    TokenRefused,
    UntrustedEnrollEndpoint,
)
from agent._version import PROTOCOL_VERSIONS, __version__
from agent.identity._rotation import RotationStore, drop_rotation_state
from agent.identity._tls import (
    Identity,
    generate_key_and_csr,
    has_identity,
    load_identity,
    store_identity,
    validate_issued_cert,
)
from protocol.identity import spki_sha256

__all__ = [
    "BOOTSTRAP_FILE",
    "BootstrapBundle",
    "bootstrap_enroll",
    "ca_client_context",
    "enroll",
    "fetch_ca",
    "join",
    "parse_ca_hash",
    "read_bundle",
    "verify_ca_pem",
]

log = logging.getLogger("mirbad.agent.enroll")

BOOTSTRAP_FILE = "bootstrap.json"
_TOKEN_CODES = {"token_invalid", "token_used", "token_expired"}


class _Transient(Exception):
    """A connection problem worth retrying."""


@dataclass(frozen=True, kw_only=True)
class BootstrapBundle:
    node_id: str
    token: str
    ca_cert_pem: str
    ca_spki_sha256: str
    enroll_endpoint: str

    def __repr__(self) -> str:  # never show the token
        return (
            f"BootstrapBundle(node_id={self.node_id!r}, enroll_endpoint={self.enroll_endpoint!r})"
        )


def read_bundle(path: Path) -> BootstrapBundle:
    """Parse bootstrap.json; raises EnrollmentError naming the bad field."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EnrollmentError(f"Cannot read the bootstrap bundle {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise EnrollmentError(f"The bootstrap bundle {path} is not a JSON object.")
    fields = {}
    for key in ("nodeId", "token", "caCertPem", "caSpkiSha256", "enrollEndpoint"):
        value = raw.get(key)
        if not isinstance(value, str) or not value:
            raise EnrollmentError(f"The bootstrap bundle {path} has no valid '{key}'.")
        fields[key] = value
    return BootstrapBundle(
        node_id=fields["nodeId"],
        token=fields["token"],
        ca_cert_pem=fields["caCertPem"],
        ca_spki_sha256=fields["caSpkiSha256"],
        enroll_endpoint=fields["enrollEndpoint"],
    )


def parse_ca_hash(text: str) -> str:
    """``sha256:<base64>`` -> the base64 part, checked to be a 32-byte digest."""
    prefix, sep, value = text.strip().partition(":")
    if not sep or prefix.lower() != "sha256":
        raise EnrollmentError(f"--ca-hash must look like sha256:<base64>, got {text!r}.")
    try:
        digest = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise EnrollmentError("--ca-hash is not valid base64 after 'sha256:'.") from None
    if len(digest) != 32:
        raise EnrollmentError(f"--ca-hash decodes to {len(digest)} bytes; a SHA-256 has 32.")
    return base64.b64encode(digest).decode("ascii")


def verify_ca_pem(ca_pem: str, expected_spki_sha256: str) -> x509.Certificate:
    """The CA certificate, if its SPKI hash is the expected one; else refuse."""
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_pem.encode())
    except ValueError as exc:
        raise UntrustedEnrollEndpoint(f"The CA certificate cannot be parsed: {exc}") from None
    actual = spki_sha256(ca_cert)
    if actual != expected_spki_sha256:
        raise UntrustedEnrollEndpoint(
            f"The CA certificate's SPKI SHA-256 is {actual}, not the expected "
            f"{expected_spki_sha256}; refusing to send the token to this master."
        )
    return ca_cert


def ca_client_context(ca_pem: str) -> ssl.SSLContext:
    """A client context trusting only ``ca_pem`` (the SPIFFE ids replace host names)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=ca_pem)
    return ctx


def _https_parts(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise EnrollmentError(f"The enroll URL must be https://host:port, got {url!r}.")
    return parts.hostname, parts.port or 443, parts.path.rstrip("/")


def _request(
    url: str, path: str, ctx: ssl.SSLContext, *, method: str, body: Any, timeout: float
) -> tuple[int, Any]:
    host, port, prefix = _https_parts(url)
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, prefix + path, body=payload, headers=headers)
        response = conn.getresponse()
        data = response.read()
    except ssl.SSLCertVerificationError as exc:
        raise UntrustedEnrollEndpoint(
            f"The enroll listener at {url} presented a certificate that does not chain to "
            f"the expected CA ({exc.verify_message}); the token was not sent."
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise _Transient(f"{url}: {exc}") from None
    finally:
        conn.close()
    try:
        parsed = json.loads(data) if data else None
    except ValueError:
        parsed = None
    return response.status, parsed


def fetch_ca(enroll_url: str, *, timeout: float = 10.0) -> str:
    """GET {enroll_url}/ca without verification (the caller checks the hash next)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    # Unverified on purpose: nothing secret is sent, and the answer is only used after
    # its SPKI hash matched the operator's --ca-hash.
    ctx.verify_mode = ssl.CERT_NONE
    status, body = _request(enroll_url, "/ca", ctx, method="GET", body=None, timeout=timeout)
    pem = body.get("caCertPem") if isinstance(body, dict) else None
    if status != 200 or not isinstance(pem, str):
        raise EnrollmentError(f"GET {enroll_url}/ca answered {status} without a caCertPem.")
    return pem


def _refusal(status: int, body: Any) -> EnrollmentError:
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    text = f"The master refused the enrollment ({status} {code or 'no code'})" + (
        f": {message}" if message else "."
    )
    if code in _TOKEN_CODES:
        return TokenRefused(text, code=code)
    return EnrollmentRefused(text, code=code)


def enroll(
    *,
    endpoint: str,
    ca_pem: str,
    token: str,
    node_id: str,
    addresses: list[str],
    state_dir: Path,
    timeout: float = 30.0,
) -> Identity:
    """One enrollment attempt against a CA already checked by hash.

    Raises _Transient for a retryable connection problem, EnrollmentError otherwise.
    """
    ca_cert = x509.load_pem_x509_certificate(ca_pem.encode())
    ctx = ca_client_context(ca_pem)
    key, csr_pem = generate_key_and_csr(node_id)
    body = {
        "token": token,
        "nodeId": node_id,
        "csrPem": csr_pem.decode(),
        "addresses": addresses,
        "agentVersion": __version__,
        "protocolVersions": list(PROTOCOL_VERSIONS),
    }
    status, answer = _request(endpoint, "/enroll", ctx, method="POST", body=body, timeout=timeout)
    if status != 200:
        raise _refusal(status, answer)
    if not isinstance(answer, dict) or not isinstance(answer.get("certPem"), str):
        raise EnrollmentError("The master's enrollment answer has no certPem.")
    answered_ca = answer.get("caCertPem")
    if isinstance(answered_ca, str) and spki_sha256(answered_ca.encode()) != spki_sha256(ca_cert):
        raise EnrollmentError(
            "The master answered with a different CA than the one it was verified with."
        )
    try:
        cert = x509.load_pem_x509_certificate(answer["certPem"].encode())
        validate_issued_cert(cert=cert, ca_cert=ca_cert, key=key, node_id=node_id)
    except (ValueError, IdentityError) as exc:
        raise EnrollmentError(f"The master's certificate is not usable: {exc}") from None
    store_identity(state_dir, key=key, cert_pem=answer["certPem"].encode(), ca_pem=ca_pem.encode())
    identity = load_identity(state_dir, node_id=node_id)
    log.info(
        "Enrolled as node %s with %s; certificate SPKI sha256 %s (approved: %s)",
        node_id,
        endpoint,
        identity.spki_sha256,
        answer.get("approved"),
    )
    return identity


def bootstrap_enroll(
    config: AgentConfig,
    *,
    poll_interval: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Identity:
    """Load the identity, enrolling from the bootstrap bundle first if there is none.

    A rotation a restart cut short is brought in line with its stage first (a torn
    promotion would otherwise be a key beside another key's certificate).
    """
    if config.state_directory.is_dir():
        done = RotationStore(state_dir=config.state_directory, node_id=config.node_id).recover()
        if done:
            log.info("Certificate rotation after the restart: %s", done)
    if has_identity(config.state_directory):
        return load_identity(config.state_directory, node_id=config.node_id)
    if config.bootstrap_directory is None:
        return load_identity(config.state_directory, node_id=config.node_id)  # raises
    bundle_path = config.bootstrap_directory / BOOTSTRAP_FILE
    deadline = time.monotonic() + config.bootstrap_wait_seconds
    waiting_logged = False
    last_problem = "no bundle appeared"
    while True:
        if bundle_path.is_file():
            bundle = read_bundle(bundle_path)
            if bundle.node_id != config.node_id:
                raise EnrollmentError(
                    f"The bootstrap bundle is for node '{bundle.node_id}', but the config says "
                    f"'{config.node_id}'."
                )
            verify_ca_pem(bundle.ca_cert_pem, bundle.ca_spki_sha256)
            try:
                identity = enroll(
                    endpoint=bundle.enroll_endpoint,
                    ca_pem=bundle.ca_cert_pem,
                    token=bundle.token,
                    node_id=config.node_id,
                    addresses=config.enroll_addresses,
                    state_dir=config.state_directory,
                )
            except _Transient as exc:
                last_problem = f"the enroll listener did not answer ({exc})"
                log.info("Enrollment not possible yet: %s; retrying", last_problem)
            else:
                try:
                    # The master may have removed it already once the node held a pin.
                    bundle_path.unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("Enrolled, but cannot delete %s: %s", bundle_path, exc)
                return identity
        elif not waiting_logged:
            log.info(
                "Not enrolled yet: waiting for the master's bootstrap bundle in %s",
                config.bootstrap_directory,
            )
            waiting_logged = True
        if time.monotonic() >= deadline:
            raise EnrollmentError(
                f"Not enrolled after {config.bootstrap_wait_seconds:g} s "
                f"(BootstrapWaitSeconds): {last_problem} in {config.bootstrap_directory}."
            )
        sleep(poll_interval)


def join(
    *,
    enroll_url: str,
    ca_hash: str,
    node_id: str,
    state_dir: Path,
    addresses: list[str],
    token: str,
    force: bool = False,
    retry_seconds: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Identity:
    """``python -m agent join``: check the CA by hash, then enroll once."""
    problem = validate_node_id(node_id)
    if problem:
        raise EnrollmentError(f"--node-id: {problem}.")
    expected = parse_ca_hash(ca_hash)
    if not token:
        raise EnrollmentError("No join token was given (MIRBAD_JOIN_TOKEN or the prompt).")
    if has_identity(state_dir) and not force:
        raise EnrollmentError(
            f"{state_dir} already holds an agent identity; pass --force to replace it."
        )
    if force:
        # A new identity: the old one's rotation (and its pending key) means nothing now.
        drop_rotation_state(state_dir)
    deadline = time.monotonic() + retry_seconds
    while True:
        try:
            ca_pem = fetch_ca(enroll_url)
            verify_ca_pem(ca_pem, expected)
            return enroll(
                endpoint=enroll_url,
                ca_pem=ca_pem,
                token=token,
                node_id=node_id,
                addresses=addresses,
                state_dir=state_dir,
            )
        except _Transient as exc:
            if time.monotonic() >= deadline:
                raise EnrollmentError(f"The enroll listener did not answer: {exc}") from None
            log.info("The enroll listener did not answer (%s); retrying", exc)
            sleep(1.0)
