"""Model definitions in the Django admin: start and stop are actions through the lifecycle.

``desired_state`` and the estimate belong to models_registry.lifecycle (the agents'
instances follow them), so they are read-only here (docs/decisions.md D41).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from core.errors import ServiceError
from models_registry import lifecycle
from models_registry.models import ModelDefinition, Placement


class PlacementInline(admin.TabularInline):
    model = Placement
    extra = 0


def _each(
    modeladmin: admin.ModelAdmin, request: HttpRequest, models: QuerySet[ModelDefinition],
    verb: str, command: Callable[[int], Any],
) -> None:  # fmt: skip
    """Run a lifecycle command per model; a refusal is reported, the others still run."""
    done = []
    for model in models:
        try:
            command(model.pk)
        except ServiceError as exc:
            modeladmin.message_user(request, f"{model.served_name}: {exc.message}", messages.ERROR)
        else:
            done.append(model.served_name)
    if done:
        modeladmin.message_user(request, f"{verb}: {', '.join(done)}", messages.SUCCESS)


@admin.action(description="Start the selected models")
def start(
    modeladmin: admin.ModelAdmin, request: HttpRequest, models: QuerySet[ModelDefinition]
) -> None:
    _each(modeladmin, request, models, "Started", lifecycle.start_model)


@admin.action(description="Stop the selected models")
def stop(
    modeladmin: admin.ModelAdmin, request: HttpRequest, models: QuerySet[ModelDefinition]
) -> None:
    _each(modeladmin, request, models, "Stopped", lifecycle.stop_model)


@admin.register(ModelDefinition)
class ModelDefinitionAdmin(admin.ModelAdmin):
    list_display = ("served_name", "runtime", "delivery", "desired_state")
    inlines = [PlacementInline]
    actions = [start, stop]
    readonly_fields = ("delivery", "desired_state", "estimate", "auto_start_note")
