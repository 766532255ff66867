"""Join tokens, approval, revoke and drain through /api, and the 50-client race."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from django.db import connections
from rest_framework.test import APIClient

from nodes import services
from nodes.models import JoinToken, Node


def _csr(node_id: str) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path",
    [
        "/api/join-tokens",
        "/api/nodes/n1/approve",
        "/api/nodes/n1/revoke",
        "/api/nodes/n1/drain",
        "/api/nodes/n1/undrain",
    ],
)
def test_without_permission(anon_client: APIClient, viewer_client: APIClient, path: str) -> None:
    assert anon_client.post(path, {}, format="json").status_code == 401
    assert viewer_client.post(path, {}, format="json").status_code == 403


@pytest.mark.django_db
def test_join_token_shown_once_with_the_command(operator_client: APIClient) -> None:
    response = operator_client.post("/api/join-tokens", {"nodeId": "gpu-1"}, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert len(body["token"]) >= 22  # 128+ random bits, URL-safe
    assert body["caHash"].startswith("sha256:")
    assert "--node-id gpu-1" in body["command"] and body["token"] not in body["command"]
    assert "MIRBAD_JOIN_TOKEN" in body["command"]
    row = JoinToken.objects.get(node_id="gpu-1")
    assert row.token_hash != body["token"]
    lifetime = row.expires_at - row.created_at
    assert dt.timedelta(minutes=59) < lifetime <= dt.timedelta(minutes=61)
    bad = operator_client.post("/api/join-tokens", {"nodeId": "Bad Id"}, format="json")
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("nodeId:")
    # One rule with the agent's (protocol.names): a trailing newline is not a node id.
    newline = operator_client.post("/api/join-tokens", {"nodeId": "gpu-3\n"}, format="json")
    assert newline.status_code == 400 and newline.json()["error"]["message"].startswith("nodeId:")
    life = operator_client.post(
        "/api/join-tokens", {"nodeId": "gpu-2", "lifetimeMinutes": 0}, format="json"
    )
    assert life.status_code == 400 and "lifetimeMinutes" in life.json()["error"]["message"]


@pytest.mark.django_db
def test_join_then_approve_then_revoke(operator_client: APIClient, status_redis: object) -> None:
    token = services.create_join_token(node_id="gpu-1")["token"]
    answer = services.enroll(
        token=token, node_id="gpu-1", csr_pem=_csr("gpu-1"), addresses=["https://127.0.0.2:9443"]
    )
    assert answer["approved"] is False
    node = operator_client.get("/api/nodes/gpu-1").json()
    assert node["state"] == "PendingApproval" and node["address"] == "https://127.0.0.2:9443"
    assert node["fingerprint"] == answer["fingerprint"]
    approved = operator_client.post("/api/nodes/gpu-1/approve").json()
    assert approved["approved"] is True and approved["state"] == "Offline"  # not reached yet
    drained = operator_client.post("/api/nodes/gpu-1/drain").json()
    assert drained["draining"] is True
    assert operator_client.post("/api/nodes/gpu-1/undrain").json()["draining"] is False
    revoked = operator_client.post("/api/nodes/gpu-1/revoke").json()
    assert revoked["state"] == "Revoked" and revoked["fingerprint"] is None
    assert Node.objects.get(node_id="gpu-1").pins == []
    # Revoked: refused from then on, new token or not.
    again = operator_client.post("/api/join-tokens", {"nodeId": "gpu-1"}, format="json")
    assert again.status_code == 409 and again.json()["error"]["code"] == "node_revoked"
    stale = services.create_token(node_id="gpu-1", purpose="join", lifetime=dt.timedelta(hours=1))
    with pytest.raises(services.EnrollmentRefused) as refused:
        services.enroll(token=stale, node_id="gpu-1", csr_pem=_csr("gpu-1"), addresses=[])
    assert refused.value.code == "node_revoked"
    assert operator_client.post("/api/nodes/gpu-1/approve").status_code == 409
    assert operator_client.post("/api/nodes/nope/approve").status_code == 404


@pytest.mark.django_db
def test_enrolled_node_needs_rekey_not_a_join_token(operator_client: APIClient) -> None:
    token = services.create_join_token(node_id="gpu-1")["token"]
    services.enroll(token=token, node_id="gpu-1", csr_pem=_csr("gpu-1"), addresses=[])
    response = operator_client.post("/api/join-tokens", {"nodeId": "gpu-1"}, format="json")
    assert response.status_code == 409 and response.json()["error"]["code"] == "node_enrolled"


@pytest.mark.django_db(transaction=True)
def test_fifty_clients_one_token_exactly_one_wins() -> None:
    token = services.create_join_token(node_id="race")["token"]
    csrs = [_csr("race") for _ in range(50)]
    barrier = threading.Barrier(50)
    outcomes: list[str] = []
    lock = threading.Lock()

    def redeem(csr: str) -> None:
        barrier.wait()
        try:
            services.enroll(token=token, node_id="race", csr_pem=csr, addresses=[])
            result = "ok"
        except services.EnrollmentRefused as exc:
            result = exc.code
        except Exception as exc:  # a database lock error would show here
            result = f"error: {type(exc).__name__}: {exc}"
        finally:
            connections.close_all()
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=redeem, args=(c,)) for c in csrs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert outcomes.count("ok") == 1, outcomes
    assert set(outcomes) == {"ok", "token_used"}, outcomes
    assert Node.objects.filter(node_id="race").count() == 1


@pytest.mark.django_db
def test_rekey_replaces_the_pin_and_keeps_approval(
    operator_client: APIClient, anon_client: APIClient
) -> None:
    assert anon_client.post("/api/nodes/gpu-1/rekey").status_code == 401
    token = services.create_join_token(node_id="gpu-1")["token"]
    services.enroll(token=token, node_id="gpu-1", csr_pem=_csr("gpu-1"), addresses=[])
    services.approve_node("gpu-1")
    old_pin = Node.objects.get(node_id="gpu-1").spki_pin
    rekey = operator_client.post("/api/nodes/gpu-1/rekey").json()
    assert "--force" in rekey["command"]
    services.enroll(token=rekey["token"], node_id="gpu-1", csr_pem=_csr("gpu-1"), addresses=[])
    node = Node.objects.get(node_id="gpu-1")
    assert node.spki_pin != old_pin and node.approved
    with pytest.raises(services.EnrollmentRefused) as used:
        services.enroll(token=rekey["token"], node_id="gpu-1", csr_pem=_csr("gpu-1"), addresses=[])
    assert used.value.code == "token_used"
    assert operator_client.post("/api/nodes/nope/rekey").status_code == 404
