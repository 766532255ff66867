"""Bootstrap bundle and single-use tokens, through the enroll listener's handlers."""

from __future__ import annotations

import datetime as dt
import json
import stat
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from django.utils import timezone

from nodes import pki, services
from nodes.enroll_listener import build_app
from nodes.models import JoinToken, Node

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_db_after")]


def _csr(node_id: str) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )


@pytest.fixture
def bundle() -> dict:
    path = services.write_bootstrap_bundle(force=True)
    assert path is not None
    return json.loads(path.read_text())


def test_bundle_is_private_and_complete(bundle: dict) -> None:
    path = services.bundle_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert set(bundle) >= {"nodeId", "token", "caCertPem", "caSpkiSha256", "enrollEndpoint"}
    ca = x509.load_pem_x509_certificate(bundle["caCertPem"].encode())
    assert pki.spki_sha256(ca) == bundle["caSpkiSha256"]
    # Only the hash of the token is stored.
    row = JoinToken.objects.get(purpose="bootstrap")
    assert row.token_hash == pki.hash_token(bundle["token"])
    assert bundle["token"] not in json.dumps(list(JoinToken.objects.values()), default=str)


def test_bundle_kept_while_valid_and_removed_after_enrollment(bundle: dict) -> None:
    again = json.loads(services.write_bootstrap_bundle().read_text())
    assert again["token"] == bundle["token"]
    services.enroll(
        token=bundle["token"], node_id=bundle["nodeId"], csr_pem=_csr("local"), addresses=[]
    )
    assert services.write_bootstrap_bundle() is None
    assert not services.bundle_path().exists()


def test_bootstrap_token_used_twice_is_refused(bundle: dict) -> None:
    result = services.enroll(
        token=bundle["token"], node_id="local", csr_pem=_csr("local"), addresses=[]
    )
    node = Node.objects.get(node_id="local")
    cert = x509.load_pem_x509_certificate(result["certPem"].encode())
    assert node.spki_pin == pki.spki_sha256(cert) and node.approved
    with pytest.raises(services.EnrollmentRefused) as refused:
        services.enroll(token=bundle["token"], node_id="local", csr_pem=_csr("local"), addresses=[])
    assert refused.value.code == "token_used" and refused.value.status == 401
    assert "already used" in str(refused.value)


def test_unknown_and_expired_tokens_are_refused(bundle: dict) -> None:
    with pytest.raises(services.EnrollmentRefused) as unknown:
        services.enroll(token="nope", node_id="local", csr_pem=_csr("local"), addresses=[])
    assert unknown.value.code == "token_invalid"
    JoinToken.objects.update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    with pytest.raises(services.EnrollmentRefused) as expired:
        services.enroll(token=bundle["token"], node_id="local", csr_pem=_csr("local"), addresses=[])
    assert expired.value.code == "token_expired"


def test_token_for_another_node_is_refused(bundle: dict) -> None:
    with pytest.raises(services.EnrollmentRefused, match="is for node 'local'"):
        services.enroll(token=bundle["token"], node_id="other", csr_pem=_csr("other"), addresses=[])
    assert JoinToken.objects.get(purpose="bootstrap").used_at is None


def test_bad_csr_does_not_burn_the_token(bundle: dict) -> None:
    with pytest.raises(services.EnrollmentRefused) as refused:
        services.enroll(token=bundle["token"], node_id="local", csr_pem="garbage", addresses=[])
    assert refused.value.code == "invalid_request"
    assert JoinToken.objects.get(purpose="bootstrap").used_at is None


def test_bootstrap_token_cannot_take_over_an_enrolled_node(bundle: dict) -> None:
    services.enroll(token=bundle["token"], node_id="local", csr_pem=_csr("local"), addresses=[])
    token = services.create_token(
        node_id="local", purpose="bootstrap", lifetime=dt.timedelta(hours=1)
    )
    with pytest.raises(services.EnrollmentRefused) as refused:
        services.enroll(token=token, node_id="local", csr_pem=_csr("local"), addresses=[])
    assert refused.value.code == "node_enrolled" and refused.value.status == 409


async def test_listener_answers_json_errors(bundle: dict, tmp_path: Path) -> None:
    async with TestClient(TestServer(build_app())) as client:
        ca = await client.get("/ca")
        assert (await ca.json())["caSpkiSha256"] == bundle["caSpkiSha256"]
        bad = await client.post("/enroll", data=b"{not json")
        assert bad.status == 400
        assert (await bad.json())["error"]["code"] == "invalid_request"
        missing = await client.post("/enroll", json={"token": "x"})
        assert (await missing.json())["error"]["message"] == "nodeId: required string."
        body = {"token": bundle["token"], "nodeId": "local", "csrPem": _csr("local")}
        ok = await client.post("/enroll", json=body)
        assert ok.status == 200, await ok.text()
        assert "BEGIN CERTIFICATE" in (await ok.json())["certPem"]
        again = await client.post("/enroll", json=body)
        assert again.status == 401
        assert (await again.json())["error"]["code"] == "token_used"
