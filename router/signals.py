"""Announce the changes that make a router's cached keys or routes wrong."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save

from router.invalidation import announce, announce_node


def _key_changed(sender: type, **kwargs: Any) -> None:
    announce("keys")


def _model_changed(sender: type, instance: Any, **kwargs: Any) -> None:
    # A rename changes two names; dropping every route is simpler and still cheap.
    announce("routes")


def _node_saved(sender: type, instance: Any, **kwargs: Any) -> None:
    # Connections to it were verified under the pins it had: a rekey or a revocation
    # must not leave them pooled (router.app.RouterApp.apply).
    announce_node(instance.pk, list(instance.pins), gone=bool(instance.revoked))


def _node_deleted(sender: type, instance: Any, **kwargs: Any) -> None:
    announce_node(instance.pk, [], gone=True)


def connect() -> None:
    from models_registry.models import ModelDefinition, Placement
    from nodes.models import Node
    from router.models import ApiKey

    for signal in (post_save, post_delete):
        signal.connect(_key_changed, sender=ApiKey, dispatch_uid=f"router-key-{signal}")
        for model in (ModelDefinition, Placement, Node):
            signal.connect(
                _model_changed, sender=model, dispatch_uid=f"router-{model.__name__}-{signal}"
            )
    post_save.connect(_node_saved, sender=Node, dispatch_uid="router-node-pins-saved")
    post_delete.connect(_node_deleted, sender=Node, dispatch_uid="router-node-pins-deleted")
