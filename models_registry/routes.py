"""Routes: stable names applications call, each an ordered list of served names.

A route (``models_registry.models.Route``) is what a client may put in ``model``
instead of a served name; the router sends the request to the first target that can
take it now and falls back to the next (router.routing ``candidates``, router.serving
``Serving.serve``). The rules, written here once:

* a route's name follows the served-name rule (``services.clean_served_name``) and
  never equals a served name (and no model may take a route's name:
  ``services.validate_definition``), so a ``model`` always means one thing;
* 1 to ``MAX_TARGETS`` distinct targets, each an existing served name (a route never
  names another route);
* a model that a route names is neither deleted nor renamed (``services.delete_model``
  refuses with 409 ``model_in_route``), so a target never dangles; the router still
  skips a target it cannot find, as a belt to those braces.

Every change is audited (``route.created``, ``route.changed``, ``route.deleted``) and
announced to every router process on commit by router.signals, which follows saves
and deletes of the row (this layer may not import the router).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from core.errors import ServiceError
from models_registry.models import ModelDefinition, Route
from models_registry.services import clean_served_name
from nodes import audit

log = logging.getLogger("mirbad.models")

MAX_TARGETS = 16
FIELDS = ("name", "targets")


def _invalid(field: str, message: str) -> ServiceError:
    return ServiceError(400, "invalid_request", f"{field}: {message}", details={"field": field})


def list_routes() -> list[Route]:
    """Every route, by name."""
    return list(Route.objects.all())


def get_route(ref: str | int) -> Route:
    """The route named ``ref``, else the one whose id it is; 404 otherwise.

    The name is tried first: a route may be called ``7`` (a served name may start with a
    digit), and the name is what operators and clients use.
    """
    text = str(ref)
    route = Route.objects.filter(name=text).first()
    if route is None and text.isdigit() and len(text) < 19:
        route = Route.objects.filter(pk=int(text)).first()
    if route is None:
        raise ServiceError(404, "not_found", f"Route '{text[:200]}' does not exist.")
    return route


def validate_route(data: dict[str, Any], *, instance: Route | None = None) -> dict[str, Any]:
    """Check a route's fields (absent ones keep ``instance``'s); returns them cleaned.

    400 naming the field for a bad value, 409 for a name already taken.
    """
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise _invalid(unknown[0], f"unknown field; a route has {', '.join(FIELDS)}")
    name = clean_served_name("name", data.get("name", instance.name if instance else None))
    if ModelDefinition.objects.filter(served_name=name).exists():
        raise ServiceError(
            409,
            "route_name_taken",
            f"name: '{name}' is a model's served name; a route needs a name of its own.",
            details={"field": "name"},
        )
    clash = Route.objects.filter(name=name)
    if instance is not None:
        clash = clash.exclude(pk=instance.pk)
    if clash.exists():
        raise ServiceError(
            409,
            "route_name_taken",
            f"name: the route '{name}' already exists; change it instead.",
            details={"field": "name"},
        )
    targets = clean_targets(data.get("targets", instance.targets if instance else None))
    return {"name": name, "targets": targets}


def clean_targets(value: Any) -> list[str]:
    """1..MAX_TARGETS distinct served names of existing models, in order; else 400."""
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise _invalid("targets", "must be a list of served names, the first preferred")
    if not 1 <= len(value) <= MAX_TARGETS:
        raise _invalid("targets", f"give 1 to {MAX_TARGETS} served names (got {len(value)})")
    seen: set[str] = set()
    for target in value:
        if target in seen:
            raise _invalid("targets", f"'{target[:200]}' is listed twice")
        seen.add(target)
    known = set(ModelDefinition.objects.filter(served_name__in=value).values_list(
        "served_name", flat=True))  # fmt: skip
    missing = [t for t in value if t not in known]
    if missing:
        shown = ", ".join(f"'{t[:200]}'" for t in missing[:3])
        raise _invalid("targets", f"no model is served as {shown}; name existing served names")
    return list(value)


@transaction.atomic
def create_route(data: dict[str, Any]) -> Route:
    """Create a route (every router follows on commit, router.signals)."""
    route = Route.objects.create(**validate_route(data))
    audit.record("route.created", subject=route.name, routeId=route.pk, targets=route.targets)
    return route


@transaction.atomic
def update_route(route: Route, data: dict[str, Any]) -> Route:
    """Rename or repoint a route; a change that changes nothing records nothing."""
    cleaned = validate_route(data, instance=route)
    before = {"name": route.name, "targets": list(route.targets)}
    if cleaned == before:
        return route
    route.name, route.targets = cleaned["name"], cleaned["targets"]
    route.save()
    audit.record("route.changed", subject=route.name, routeId=route.pk, before=before,
                 after=cleaned)  # fmt: skip
    return route


@transaction.atomic
def delete_route(route: Route) -> None:
    """Delete a route: clients calling its name get 404 model_not_found from then on."""
    audit.record("route.deleted", subject=route.name, routeId=route.pk, targets=route.targets)
    route.delete()
