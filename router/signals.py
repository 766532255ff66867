"""Announce the changes that make a router's cached keys or routes wrong."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save, pre_save

from router.invalidation import announce, announce_node


def _key_changed(sender: type, **kwargs: Any) -> None:
    announce("keys")


def _model_changed(sender: type, instance: Any, **kwargs: Any) -> None:
    # A rename changes two names; dropping every route is simpler and still cheap.
    announce("routes")


def _route_renaming(sender: type, instance: Any, **kwargs: Any) -> None:
    # A rename leaves the old name cached too: announce it as well (a query per save;
    # routes change rarely).
    if instance.pk is not None:
        rows = type(instance).objects.filter(pk=instance.pk)
        old = rows.values_list("name", flat=True).first()
        if old is not None and old != instance.name:
            announce("routes", old)


def _route_changed(sender: type, instance: Any, **kwargs: Any) -> None:
    # Only that name's entries: an alias's targets resolve through the served names'
    # own cached routes, which model changes drop.
    announce("routes", instance.name)


def _node_saved(sender: type, instance: Any, **kwargs: Any) -> None:
    # Connections to it were verified under the pins it had: a rekey or a revocation
    # must not leave them pooled (router.app.RouterApp.apply).
    announce_node(instance.pk, list(instance.pins), gone=bool(instance.revoked))


def _node_deleted(sender: type, instance: Any, **kwargs: Any) -> None:
    announce_node(instance.pk, [], gone=True)


def connect() -> None:
    from models_registry.models import ModelDefinition, Placement, Route
    from nodes.models import Node
    from router.models import ApiKey

    for signal in (post_save, post_delete):
        signal.connect(_key_changed, sender=ApiKey, dispatch_uid=f"router-key-{signal}")
        for model in (ModelDefinition, Placement, Node):
            signal.connect(
                _model_changed, sender=model, dispatch_uid=f"router-{model.__name__}-{signal}"
            )
    pre_save.connect(_route_renaming, sender=Route, dispatch_uid="router-route-renaming")
    for signal in (post_save, post_delete):
        signal.connect(_route_changed, sender=Route, dispatch_uid=f"router-route-{signal}")
    post_save.connect(_node_saved, sender=Node, dispatch_uid="router-node-pins-saved")
    post_delete.connect(_node_deleted, sender=Node, dispatch_uid="router-node-pins-deleted")
