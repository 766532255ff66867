"""Schemathesis hooks of tests/e2e/test_api_fuzz.py, loaded by its CLI (``SCHEMATHESIS_HOOKS``).

Two things keep the fuzzing meaningful to its end on a throwaway master:

- **No self-inflicted lockout by the failure throttle.** The ``ignored_auth`` check
  sends every operation once without a key and once with an unknown one; past 10
  unknown keys from one address in 15 minutes, /api answers 429 to that address
  without looking any key up (core/throttle.py, proven in
  tests/e2e/test_failure_throttle_e2e.py), which would turn the rest of the run into
  429s. Each request therefore carries its own ``X-Forwarded-For`` (uvicorn takes it
  from 127.0.0.1, as from a reverse proxy), so each counts against an address of its
  own. The probes inherit the request's headers.
- **Real resources, but never the fuzzer's own.** Half the path values and ``?node=``
  values (chosen by a hash of the drawn value, so a case replays the same) are
  swapped for ones that exist (``MIRBAD_FUZZ_PLAN``: a node, a model, a key, a model
  folder, a backup's one-time download), so the operations reach past their 404.
  Destructive operations get throwaway targets: ``DELETE /api/models/{id}`` a model
  of its own, ``POST /api/nodes/{id}/revoke`` an enrolled node no agent serves
  (revoking the one agent would leave every later node operation a 409), and
  ``PATCH``/``DELETE /api/keys/{id}`` never the fuzzer's key, however the id is
  spelled (``2``, ``"02"``: revoking it, or giving it a past expiry, ended a run in
  401s before this rule).

Negative cases (a wrong type, a route no converter matches) are left as drawn.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Any

import schemathesis
from schemathesis import Case
from schemathesis.hooks import HookContext

_PLAN: dict[str, Any] = json.loads(os.environ.get("MIRBAD_FUZZ_PLAN", "{}"))
_CALLS = itertools.count(1)  # next() on a count is atomic: the workers share it


def _forwarded_for() -> str:
    n = next(_CALLS)
    return f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


def _real(value: object) -> bool:
    """Whether to swap a drawn path value for a real one: half of them, by their hash."""
    return hashlib.sha256(repr(value).encode()).digest()[0] % 2 == 0


def _node(case: Case, value: object) -> object:
    if not isinstance(value, str):
        return value  # a negative case: its wrong type is the point
    if case.path.endswith("/revoke"):
        return _PLAN["spareNode"] if value == _PLAN["node"] or _real(value) else value
    return _PLAN["node"] if _real(value) else value


def _id(value: object) -> int | None:
    """The id Django's ``<int:...>`` route reads from a drawn value (``2``, ``"2"``,
    ``"002"``), or None for a value no route takes (a negative case)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def _model(case: Case, value: object) -> object:
    drawn = _id(value)
    if drawn is None:
        return value
    if case.method.upper() == "DELETE":
        return _PLAN["doomedModel"] if drawn == _PLAN["model"] or _real(value) else value
    return _PLAN["model"] if _real(value) else value


def _key(value: object) -> object:
    drawn = _id(value)
    if drawn is None:
        return value
    return _PLAN["spareKey"] if drawn == _PLAN["fuzzKey"] or _real(value) else value


def _string(value: object, real: str) -> object:
    return real if isinstance(value, str) and _real(value) else value


@schemathesis.hook
def before_call(context: HookContext, case: Case, kwargs: dict[str, Any]) -> None:
    case.headers = {**(case.headers or {}), "X-Forwarded-For": _forwarded_for()}
    if not _PLAN:
        return
    if case.query and "node" in case.query:
        # Several nodes exist, so a drawn ?node= is mostly "no such node": half reach one.
        case.query["node"] = _string(case.query["node"], _PLAN["node"])
    params = case.path_parameters
    if not params:
        return
    if "node_id" in params:
        params["node_id"] = _node(case, params["node_id"])
    if "model_id" in params:
        params["model_id"] = _model(case, params["model_id"])
    if "key_id" in params:
        params["key_id"] = _key(params["key_id"])
    if "folder" in params:
        params["folder"] = _string(params["folder"], _PLAN["folder"])
    if "token" in params:  # a backup's one-time download: the first real one answers 200
        params["token"] = _string(params["token"], _PLAN["backupToken"])
