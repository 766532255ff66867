"""The backup document a master writes: JSON, ``schemaVersion`` 2 (docs/operator-guide.md,
"Backups").

The open sections hold what is not secret: model definitions with their placements,
the non-secret part of each node record, the master's fencing identity, the models
meant to be running per node, settings and history. ``secrets`` is present only when
a passphrase is given, sealed by :mod:`backups.crypto`: API key records (their hashes,
never a key), the backup destination and, unless turned off, the CA certificate and
key. Join tokens, pending pins and node keys are never written.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import serialization
from django.conf import settings
from django.utils import timezone

from backups import crypto, inventory
from models_registry.models import MemorySample, ModelDefinition
from nodes import fencing
from nodes.models import Node
from nodes.services import master_pki
from router.models import ApiKey

FORMAT = "mirbadllm-backup"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
# History is the one section that grows with time: the newest samples up to this many
# (about 250 KB; 100 nodes and 500 models add about 400 KB more).
HISTORY_LIMIT = 2000


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def model_record(model: ModelDefinition) -> dict[str, Any]:
    """A definition as the backup keeps it (and as the restore preview compares it)."""
    return {
        # The ids name the engines the agents run (instance ``m{id}-p{placement}``): a
        # rebuilt master keeps them, so it recognises the engines as its own.
        "id": model.pk,
        "servedName": model.served_name,
        "runtime": model.runtime,
        "delivery": model.delivery,
        "image": model.image,
        "source": {"folder": model.source_folder, "file": model.source_file},
        "settings": model.settings,
        "executableVersion": model.executable_version,
        "autoStart": model.auto_start,
        "memoryBudgetBytes": model.memory_budget_bytes,
        "desiredState": model.desired_state,
        "placements": [
            {
                "id": placement.pk,
                "node": placement.node.node_id,
                "gpuUuids": placement.gpu_uuids,
                "gpuBudgets": placement.gpu_budgets,
            }
            for placement in model.placements.all()
        ],
    }


def node_record(node: Node) -> dict[str, Any]:
    """The non-secret part of a node: never a token, a pending pin or a key."""
    return {
        "nodeId": node.node_id,
        "displayName": node.display_name,
        "address": node.address,
        "isBootstrap": node.is_bootstrap,
        "approved": node.approved,
        "draining": node.draining,
        "revoked": node.revoked,
        "memoryReserveBytes": node.memory_reserve_bytes,
        "gpuReserves": node.gpu_reserves,
        "labels": node.labels,
        "certSpkiSha256": node.spki_pin,
        "certSerial": node.cert_serial,
        "certNotAfter": _iso(node.cert_not_after),
        "enrolledAt": _iso(node.enrolled_at),
        "capabilities": node.facts,
        "agentVersion": node.agent_version,
        "protocolVersion": node.protocol_version,
        "os": node.os,
        "arch": node.arch,
        "memoryTotalBytes": node.memory_total_bytes,
    }


def api_key_record(key: ApiKey) -> dict[str, Any]:
    """A key's record: its hash, never the key (which the master never had to keep)."""
    return {
        "id": key.pk,
        "name": key.name,
        "prefix": key.prefix,
        "keyHash": key.key_hash,
        "scopes": key.scopes,
        "modelAllowlist": key.model_allowlist,
        "expiresAt": _iso(key.expires_at),
        "revokedAt": _iso(key.revoked_at),
        "createdAt": _iso(key.created_at),
        "rpmLimit": key.rpm_limit,
        "tpmLimit": key.tpm_limit,
        "concurrencyLimit": key.concurrency_limit,
    }


def _history() -> dict[str, Any]:
    samples = MemorySample.objects.order_by("-created_at")[:HISTORY_LIMIT]
    return {
        "memorySamples": [
            {
                "servedName": s.served_name,
                "nodeId": s.node_id,
                "instanceId": s.instance_id,
                "readyAt": s.ready_at,
                "architecture": s.architecture,
                "fileType": s.file_type,
                "budgetBytes": s.budget_bytes,
                "measuredBytes": s.measured_bytes,
                "kind": s.kind,
                "createdAt": _iso(s.created_at),
            }
            for s in samples
        ]
    }


def _running_models(models: list[ModelDefinition]) -> dict[str, list[str]]:
    running: dict[str, list[str]] = {}
    for model in models:
        if model.desired_state != ModelDefinition.Desired.RUNNING:
            continue
        for placement in model.placements.all():
            running.setdefault(placement.node.node_id, []).append(model.served_name)
    return running


def _sources(models: list[ModelDefinition], nodes: list[Node]) -> dict[str, Any]:
    """Where each referenced folder came from, as the nodes holding it report it."""
    wanted = {m.source_folder for m in models}
    placed = {p.node_id for m in models for p in m.placements.all()}
    answers = inventory.ask_nodes([n for n in nodes if n.pk in placed and not n.revoked])
    sources: dict[str, Any] = {}
    for answer in answers.values():
        for folder, entry in (answer.folders or {}).items():
            source = inventory.source_of(entry) if folder in wanted else None
            if source is not None and folder not in sources:
                sources[folder] = source
    return sources


def backup_settings() -> dict[str, Any]:
    cfg = settings.MIRBAD
    return {
        "backup": {
            "dailyAt": cfg.backup_daily_at,
            "keep": cfg.backup_keep,
            "includeCa": cfg.backup_include_ca,
        }
    }


def _destination() -> dict[str, Any]:
    # A directory on the master host: no credential to carry (a network destination
    # with a password would put it in ``secrets`` only).
    return {"kind": "directory", "path": str(settings.MIRBAD.backup_directory)}


def _ca_section() -> dict[str, str]:
    ca = master_pki().ca
    key_pem = ca.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return {"certPem": ca.cert_pem, "keyPem": key_pem}


def secrets_plaintext(*, include_ca: bool) -> dict[str, Any]:
    section: dict[str, Any] = {
        "apiKeys": [api_key_record(k) for k in ApiKey.objects.order_by("pk")],
        "backupDestination": _destination(),
    }
    if include_ca:
        section["ca"] = _ca_section()
    return section


@dataclass(frozen=True, kw_only=True)
class Built:
    """One backup, ready to write: the bytes, and what the run record shows."""

    data: bytes
    has_secrets: bool
    has_ca: bool
    models: int
    nodes: int


def build(
    *,
    passphrase: str | None,
    include_ca: bool,
    log2_n: int = crypto.DEFAULT_LOG2_N,
) -> Built:
    """The document of the master as it is now, as UTF-8 JSON bytes."""
    models = list(
        ModelDefinition.objects.prefetch_related("placements__node").order_by("served_name")
    )
    nodes = list(Node.objects.order_by("node_id"))
    identity = fencing.read_identity(settings.MIRBAD.data_path)
    document: dict[str, Any] = {
        "format": FORMAT,
        "schemaVersion": SCHEMA_VERSION,
        "createdAt": timezone.now().isoformat(),
        "master": {
            "instanceId": identity.instance_id if identity else None,
            "epoch": identity.epoch if identity else 0,
        },
        "models": [model_record(m) for m in models],
        "nodes": [node_record(n) for n in nodes],
        "runningModels": _running_models(models),
        "sources": _sources(models, nodes),
        "settings": backup_settings(),
        "history": _history(),
    }
    if passphrase is not None:
        plaintext = json.dumps(secrets_plaintext(include_ca=include_ca)).encode()
        document["secrets"] = crypto.seal(
            plaintext, passphrase=passphrase, schema_version=SCHEMA_VERSION, log2_n=log2_n
        )
    return Built(
        # Compact: a backup is read by programs; the console's upload takes 2.5 MB.
        data=json.dumps(document, separators=(",", ":")).encode(),
        has_secrets=passphrase is not None,
        has_ca=passphrase is not None and include_ca,
        models=len(models),
        nodes=len(nodes),
    )
