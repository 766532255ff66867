"""Restoring a backup (docs/operator-guide.md, "Restore"): preview, apply, rebuild.

- :func:`preview` changes nothing: each model new, changed (with its fields) or
  identical, whether it would be accepted, which folders its nodes hold and which must
  be downloaded (with sizes), the API keys that would be added, and the backup's nodes
  against this master's, with storage that differs flagged.
- :func:`apply` writes the selected definitions (a version 2 backup keeps its
  placements; a version 1 backup's models go to the bootstrap node) and merges the
  API keys by id; fetching the missing folders and starting the auto-start models is
  :mod:`backups.fleet_restore`'s job, run after it.
- :func:`rebuild` makes an empty master the master of the backup's fleet: the CA,
  the nodes, models and keys with their ids (the agents' engines keep the instance
  ids the old master gave them), an epoch above the backup's and above every
  reachable agent's (a takeover, in the audit log). Refused without the CA.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from django.conf import settings
from django.core.management.color import no_style
from django.db import connection, transaction
from django.utils.dateparse import parse_datetime

from backups import inventory
from backups.document import model_record
from backups.reader import Backup
from core.errors import ServiceError
from models_registry import services as model_services
from models_registry.models import MemorySample, ModelDefinition, Placement
from nodes import audit, fencing, master_store, takeover
from nodes import services as node_services
from nodes.models import Node
from nodes.pki import PkiError
from router.models import ApiKey

log = logging.getLogger("mirbad.backups")

# The fields a preview compares; ``id`` and ``desiredState`` describe the old master's
# rows and runtime, not the definition.
COMPARED = (
    "runtime", "delivery", "image", "source", "settings", "executableVersion", "autoStart",
    "memoryBudgetBytes", "placements",
)  # fmt: skip


def _placements_of(record: dict[str, Any], backup: Backup) -> list[dict[str, Any]]:
    """Where a backup's model goes: its placements, or the bootstrap node for version 1."""
    if backup.schema_version >= 2:
        return record["placements"]
    return [{"node": settings.MIRBAD.bootstrap_node_id, "gpuUuids": [], "gpuBudgets": []}]


def _settings(raw: dict[str, Any], runtime: str = "llamacpp") -> dict[str, Any]:
    """Settings as a saved definition holds them (defaults filled), so equal ones compare equal."""
    try:
        if runtime == "vllm":
            return model_services.clean_vllm_settings(raw).to_dict()
        return model_services.clean_settings(raw).to_dict()
    except ServiceError:
        return raw  # refused: the dry run says why


def _comparable(record: dict[str, Any], placements: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: record.get(k) for k in COMPARED}
    out["settings"] = _settings(record.get("settings") or {}, str(record.get("runtime")))
    out["placements"] = sorted(
        ({"node": p["node"], "gpuUuids": p["gpuUuids"], "gpuBudgets": p["gpuBudgets"]}
         for p in placements),
        key=lambda p: str(p["node"]),
    )  # fmt: skip
    return out


def _definition(record: dict[str, Any], placements: list[dict[str, Any]]) -> dict[str, Any]:
    """A backup's model as models_registry.services takes a definition."""
    return {
        "served_name": record["servedName"],
        "runtime": record["runtime"],
        "delivery": record["delivery"],
        "image": record["image"],
        "source_folder": record["source"]["folder"],
        "source_file": record["source"]["file"],
        "settings": record["settings"],
        "auto_start": record["autoStart"],
        "memory_budget_bytes": record["memoryBudgetBytes"],
        "placements": [
            {"node": p["node"], "gpuUuids": p["gpuUuids"], "gpuBudgets": p["gpuBudgets"]}
            for p in placements
        ],
    }


def _write_model(record: dict[str, Any], placements: list[dict[str, Any]]) -> str:
    """Create or change one definition; "created", "updated" or "unchanged"."""
    existing = ModelDefinition.objects.filter(served_name=record["servedName"]).first()
    data = _definition(record, placements)
    if existing is None:
        model_services.create_model(data)
        return "created"
    current = _comparable(model_record(existing), model_record(existing)["placements"])
    if current == _comparable(record, placements):
        return "unchanged"
    model_services.update_model(existing, data)
    return "updated"


def _dry_run(record: dict[str, Any], placements: list[dict[str, Any]]) -> str | None:
    """Why this definition would be refused here, or None: the write, rolled back."""
    try:
        with transaction.atomic():
            _write_model(record, placements)
            transaction.set_rollback(True)
    except ServiceError as exc:
        return exc.message
    return None


def _model_preview(
    record: dict[str, Any], backup: Backup, answers: dict[str, inventory.NodeFolders]
) -> dict[str, Any]:
    placements = _placements_of(record, backup)
    existing = ModelDefinition.objects.filter(served_name=record["servedName"]).first()
    wanted = _comparable(record, placements)
    changes: list[dict[str, Any]] = []
    if existing is None:
        status = "new"
    else:
        current = model_record(existing)
        have = _comparable(current, current["placements"])
        changes = [
            {"field": name, "current": have[name], "backup": wanted[name]}
            for name in COMPARED
            if have[name] != wanted[name]
        ]
        status = "changed" if changes else "identical"
    folder = record["source"]["folder"]
    source = backup.sources.get(folder)
    folders = []
    for p in placements:
        note: str | None
        present: bool | None
        answer = answers.get(p["node"])
        if answer is None:
            present, note = None, "this master has no such node"
        elif answer.folders is None:
            present, note = None, answer.problem
        else:
            present = inventory.holds(answer.folders, folder, record["source"]["file"])
            note = None
        folders.append({
            "node": p["node"], "folder": folder, "present": present, "note": note,
            "downloadBytes": None if present else (source or {}).get("bytes"),
            "downloadable": source is not None,
        })  # fmt: skip
    return {
        "servedName": record["servedName"],
        "status": status,
        "changes": changes,
        "autoStart": record["autoStart"],
        "problem": _dry_run(record, placements) if status != "identical" else None,
        "folders": folders,
    }


def _storage(node: dict[str, Any]) -> list[dict[str, Any]]:
    disks = (node.get("capabilities") or node.get("facts") or {}).get("disks") or []
    return [
        {"path": d.get("path"), "totalBytes": d.get("totalBytes")}
        for d in disks
        if isinstance(d, dict)
    ]


def _storage_differs(backup: list[dict[str, Any]], current: list[dict[str, Any]]) -> bool:
    if not backup or not current:
        return False
    if [d["path"] for d in backup] != [d["path"] for d in current]:
        return True
    for old, new in zip(backup, current, strict=True):
        a, b = old.get("totalBytes") or 0, new.get("totalBytes") or 0
        if a and b and abs(a - b) > 0.01 * max(a, b):
            return True
    return False


def _keys_preview(backup: Backup) -> dict[str, Any]:
    if not backup.sealed:
        return {"state": "none", "add": [], "present": [], "conflicts": []}
    if backup.secrets is None:
        return {"state": "locked", "add": [], "present": [], "conflicts": []}
    by_id = {k.pk: k for k in ApiKey.objects.filter(pk__in=[k["id"] for k in backup.api_keys])}
    hashes = set(
        ApiKey.objects.filter(key_hash__in=[k["keyHash"] for k in backup.api_keys]).values_list(
            "key_hash", flat=True
        )
    )
    add, present, conflicts = [], [], []
    for key in backup.api_keys:
        brief = {"id": key["id"], "name": key["name"], "prefix": key["prefix"]}
        if key["keyHash"] in hashes:
            present.append(brief)
        elif key["id"] in by_id:
            conflicts.append(brief | {"note": f"id {key['id']} is another key on this master"})
        else:
            add.append(brief)
    return {"state": "open", "add": add, "present": present, "conflicts": conflicts}


def preview(backup: Backup) -> dict[str, Any]:
    """What a restore of ``backup`` would do here; nothing is changed."""
    nodes = list(Node.objects.all())
    answers = inventory.ask_nodes([n for n in nodes if not n.revoked and n.approved])
    known = {n.node_id: n for n in nodes}
    node_rows = []
    for record in backup.nodes:
        here = known.get(record["nodeId"])
        old, new = _storage(record), _storage({"facts": here.facts}) if here else []
        node_rows.append({
            "nodeId": record["nodeId"],
            "status": "known" if here else "unknown",
            "samePin": bool(here and here.spki_pin and here.spki_pin == record["certSpkiSha256"]),
            "storage": {"backup": old, "current": new, "differs": _storage_differs(old, new)},
        })  # fmt: skip
    in_backup = {r["nodeId"] for r in backup.nodes}
    node_rows += [
        {"nodeId": n.node_id, "status": "not in backup", "samePin": False,
         "storage": {"backup": [], "current": _storage({"facts": n.facts}), "differs": False}}
        for n in nodes if n.node_id not in in_backup
    ]  # fmt: skip
    return {
        "schemaVersion": backup.schema_version,
        "createdAt": backup.created_at,
        "master": backup.master,
        "sealed": backup.sealed,
        "secretsOpened": backup.secrets is not None,
        "hasCa": backup.ca is not None,
        "models": [_model_preview(r, backup, answers) for r in backup.models],
        "apiKeys": _keys_preview(backup),
        "nodes": node_rows,
        "rebuild": rebuild_refusal(backup),
    }


# -- apply ------------------------------------------------------------------------------


def _reset_sequences(*models: type) -> None:
    """After rows were written with their own ids: PostgreSQL's sequences must pass them."""
    with connection.cursor() as cursor:
        for statement in connection.ops.sequence_reset_sql(no_style(), list(models)):
            cursor.execute(statement)


def _when(text: str | None) -> dt.datetime | None:
    return parse_datetime(text) if text else None


def _api_key_row(key: dict[str, Any]) -> ApiKey:
    return ApiKey(
        pk=key["id"], name=key["name"], prefix=key["prefix"], key_hash=key["keyHash"],
        scopes=key["scopes"], model_allowlist=key["modelAllowlist"],
        expires_at=_when(key["expiresAt"]), revoked_at=_when(key["revokedAt"]),
        rpm_limit=key["rpmLimit"], tpm_limit=key["tpmLimit"],
        concurrency_limit=key["concurrencyLimit"],
    )  # fmt: skip


def _keep_created(keys: list[dict[str, Any]]) -> None:
    """A restored key keeps its creation time (auto_now_add set "now" on insert)."""
    for key in keys:
        created = _when(key["createdAt"])
        if created is not None:
            ApiKey.objects.filter(pk=key["id"]).update(created_at=created)


def merge_keys(backup: Backup) -> list[int]:
    """Add the backup's API keys this master lacks, by id; the ids added."""
    plan = _keys_preview(backup)
    wanted = {k["id"] for k in plan["add"]}
    rows = [_api_key_row(k) for k in backup.api_keys if k["id"] in wanted]
    ApiKey.objects.bulk_create(rows)
    _keep_created([k for k in backup.api_keys if k["id"] in wanted])
    _reset_sequences(ApiKey)
    return sorted(wanted)


def apply(backup: Backup, *, served_names: list[str] | None, actor: str) -> dict[str, Any]:
    """Write the selected definitions and merge the keys; each model refused alone."""
    chosen = [r for r in backup.models if served_names is None or r["servedName"] in served_names]
    if served_names is not None:
        unknown = sorted(set(served_names) - {r["servedName"] for r in backup.models})
        if unknown:
            raise ServiceError(
                400, "invalid_request", f"models: {unknown[0]!r} is not a model of this backup"
            )
    results = []
    for record in chosen:
        try:
            with transaction.atomic():
                outcome = _write_model(record, _placements_of(record, backup))
        except ServiceError as exc:
            results.append({"servedName": record["servedName"], "result": "refused",
                            "reason": exc.message})  # fmt: skip
            continue
        results.append({"servedName": record["servedName"], "result": outcome})
    with transaction.atomic():
        added = merge_keys(backup) if backup.secrets is not None else []
    audit.record(
        "backup.restored", actor=actor,
        detail_models={r["servedName"]: r["result"] for r in results}, keys_added=added,
    )  # fmt: skip
    return {"models": results, "apiKeysAdded": added}


# -- rebuild ----------------------------------------------------------------------------


def rebuild_refusal(backup: Backup) -> str | None:
    """Why ``backup`` cannot rebuild this master, or None when it can."""
    if not backup.sealed:
        return (
            "the backup has no secrets section (made without a passphrase), so it holds no "
            "CA: the agents would refuse this master; restore the definitions and re-enroll"
        )
    if backup.secrets is None:
        return "give the backup's passphrase: the CA is in its sealed secrets"
    if backup.ca is None:
        return (
            "the backup holds no CA (made with MIRBAD_BACKUP_INCLUDE_CA=false): the agents "
            "would refuse this master; restore the definitions and re-enroll the nodes"
        )
    if backup.schema_version < 2:
        return "a version 1 backup holds no nodes to rebuild"
    enrolled = Node.objects.exclude(spki_pin="").exists()
    if enrolled or ModelDefinition.objects.exists():
        return (
            "this master is not empty (it has models or enrolled nodes); rebuild onto a new "
            "data directory and an empty database"
        )
    theirs = x509.load_pem_x509_certificate(backup.ca["certPem"].encode())
    for mine in master_store.stored_ca_certificates():
        if mine != theirs:
            return (
                "this master already has its own CA (in its database, or in "
                f"{settings.MIRBAD.pki_dir} to import); rebuild onto a new data directory "
                "and an empty database, before its first start"
            )
    return None


def _install_ca(ca: dict[str, str]) -> None:
    """The backup's CA into the database (D80), where every master host reads it."""
    cert = x509.load_pem_x509_certificate(ca["certPem"].encode())
    key = serialization.load_pem_private_key(ca["keyPem"].encode(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ServiceError(400, "invalid_backup", "$.secrets.ca: the key does not match the CA")
    try:
        master_store.install_ca(cert, key)
    except PkiError as exc:  # rebuild_refusal checked it; a racing start may not have been
        raise ServiceError(409, "rebuild_refused", f"Rebuild refused: {exc}.") from None
    # This process may have read a CA before (its own, made at a first use): not any more.
    node_services.forget_master_pki()


def _node_row(record: dict[str, Any]) -> Node:
    return Node(
        node_id=record["nodeId"], display_name=record["displayName"], address=record["address"],
        is_bootstrap=record["isBootstrap"], approved=record["approved"],
        draining=record["draining"], revoked=record["revoked"],
        memory_reserve_bytes=record["memoryReserveBytes"], gpu_reserves=record["gpuReserves"],
        labels=record["labels"], spki_pin=record["certSpkiSha256"], cert_serial=record["certSerial"],
        cert_not_after=_when(record["certNotAfter"]), enrolled_at=_when(record["enrolledAt"]),
        facts=record["capabilities"], agent_version=record["agentVersion"],
        protocol_version=record["protocolVersion"], os=record["os"], arch=record["arch"],
        memory_total_bytes=record["memoryTotalBytes"],
    )  # fmt: skip


def _restore_rows(backup: Backup) -> None:
    """Nodes, models with their placements and keys, every row with its old id."""
    Node.objects.filter(spki_pin="").exclude(
        node_id__in=[r["nodeId"] for r in backup.nodes]
    ).filter(is_bootstrap=True).delete()  # this host's unenrolled record, if it has one
    existing = set(Node.objects.values_list("node_id", flat=True))
    Node.objects.bulk_create([_node_row(r) for r in backup.nodes if r["nodeId"] not in existing])
    for record in backup.nodes:
        if record["nodeId"] in existing:  # the unenrolled bootstrap record: take the backup's
            row = _node_row(record)
            row.pk = Node.objects.get(node_id=record["nodeId"]).pk
            row.save()
    nodes = {n.node_id: n for n in Node.objects.all()}
    for record in backup.models:
        model = ModelDefinition.objects.create(
            pk=record["id"], served_name=record["servedName"], runtime=record["runtime"],
            delivery=record["delivery"], image=record["image"],
            source_folder=record["source"]["folder"],
            source_file=record["source"]["file"], settings=record["settings"],
            executable_version=record["executableVersion"], auto_start=record["autoStart"],
            memory_budget_bytes=record["memoryBudgetBytes"],
            desired_state=record["desiredState"],
        )  # fmt: skip
        for p in record["placements"]:
            if p["node"] not in nodes:
                raise ServiceError(
                    400, "invalid_backup",
                    f"model {record['servedName']!r} is placed on {p['node']!r}, which the "
                    "backup's nodes do not list",
                )  # fmt: skip
            Placement.objects.create(
                pk=p["id"], model=model, node=nodes[p["node"]],
                gpu_uuids=p["gpuUuids"], gpu_budgets=p["gpuBudgets"],
            )  # fmt: skip
    ApiKey.objects.bulk_create([_api_key_row(k) for k in backup.api_keys])
    _keep_created(backup.api_keys)
    by_name = {m.served_name: m for m in ModelDefinition.objects.all()}
    MemorySample.objects.bulk_create(
        [_sample_row(s, by_name) for s in backup.history.get("memorySamples") or []
         if isinstance(s, dict)],
        ignore_conflicts=True,
    )  # fmt: skip
    for sample in backup.history.get("memorySamples") or []:
        created = _when(sample.get("createdAt")) if isinstance(sample, dict) else None
        if created is not None:  # auto_now_add wrote "now": keep when it was measured
            MemorySample.objects.filter(
                instance_id=str(sample.get("instanceId") or "")[:64],
                ready_at=str(sample.get("readyAt") or "")[:40],
            ).update(created_at=created)
    _reset_sequences(Node, ModelDefinition, Placement, ApiKey)


def _sample_row(sample: dict[str, Any], models: dict[str, ModelDefinition]) -> MemorySample:
    """One measured start from the history section (checked loosely: it is history)."""

    def text(name: str, limit: int) -> str:
        return str(sample.get(name) or "")[:limit]

    def count(name: str) -> int:
        value = sample.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    return MemorySample(
        model=models.get(text("servedName", 200)), served_name=text("servedName", 200),
        node_id=text("nodeId", 40), instance_id=text("instanceId", 64),
        ready_at=text("readyAt", 40), architecture=text("architecture", 60),
        file_type=text("fileType", 20), budget_bytes=count("budgetBytes"),
        measured_bytes=count("measuredBytes"), kind=text("kind", 16),
    )  # fmt: skip


def rebuild(backup: Backup, *, actor: str) -> dict[str, Any]:
    """Make this empty master the master of the backup's fleet (see the module docstring)."""
    refusal = rebuild_refusal(backup)
    if refusal:
        raise ServiceError(409, "rebuild_refused", f"Rebuild refused: {refusal}.")
    if any(r.get("id") is None for r in backup.models) or any(
        p.get("id") is None for r in backup.models for p in r["placements"]
    ):
        raise ServiceError(
            400, "invalid_backup", "the backup's models carry no ids; it cannot rebuild a master"
        )
    assert backup.ca is not None
    _install_ca(backup.ca)
    with transaction.atomic():
        _restore_rows(backup)
    old_epoch = int((backup.master or {}).get("epoch") or 0)
    fencing.begin_epoch(
        settings.MIRBAD.data_path,
        at_least=old_epoch + 1,
        instance_id=(backup.master or {}).get("instanceId"),
    )
    # The agents may have seen a higher epoch since the backup: go above theirs too.
    taken = takeover.takeover()
    audit.record(
        "master.rebuilt", actor=actor, subject=str(backup.created_at or "")[:60],
        backupEpoch=old_epoch, epoch=taken["epoch"], nodes=taken["nodes"],
        models=len(backup.models), apiKeys=len(backup.api_keys),
    )  # fmt: skip
    log.warning("Master rebuilt from the backup of %s: %s", backup.created_at, json.dumps(taken))
    return {
        "epoch": taken["epoch"],
        "nodes": [r["nodeId"] for r in backup.nodes],
        "models": [r["servedName"] for r in backup.models],
        "apiKeys": len(backup.api_keys),
        "reached": taken["nodes"],
    }
