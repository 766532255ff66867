"""The master's identity row (nodes_masterstate, D81) read and written from a test, on
SQLite or PostgreSQL as the stack's MIRBAD_DATABASE_URL says."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


def _execute(env: dict[str, str], sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    url = (
        env.get("MIRBAD_DATABASE_URL")
        or f"sqlite:///{Path(env['MIRBAD_DATA_PATH']) / 'db.sqlite3'}"
    )
    if url.startswith("sqlite"):
        path = urlsplit(url).path
        with sqlite3.connect(path, timeout=10) as conn:
            return conn.execute(sql, params).fetchall()
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(sql.replace("?", "%s"), params)
        return cursor.fetchall() if cursor.description else []


def identity(env: dict[str, str]) -> dict[str, Any] | None:
    """The row as the masters read it, or None before the first monitor start."""
    rows = _execute(env, "SELECT instance_id, epoch, boot_id FROM nodes_masterstate WHERE id = 1")
    if not rows:
        return None
    instance_id, epoch, boot_id = rows[0]
    return {"instanceId": instance_id, "epoch": int(epoch), "bootId": boot_id}


def epoch(env: dict[str, str]) -> int:
    row = identity(env)
    return row["epoch"] if row else 0


def set_epoch(env: dict[str, str], value: int) -> None:
    """An old identity, as a database restored from an old dump would hold."""
    _execute(env, "UPDATE nodes_masterstate SET epoch = ? WHERE id = 1", (value,))
