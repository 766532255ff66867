"""Announce the changes that make a router's cached keys or routes wrong."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_save

from router.invalidation import announce


def _key_changed(sender: type, **kwargs: Any) -> None:
    announce("keys")


def _model_changed(sender: type, instance: Any, **kwargs: Any) -> None:
    # A rename changes two names; dropping every route is simpler and still cheap.
    announce("routes")


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
