"""Model definitions in the Django admin: saved through the services, started through the lifecycle.

``desired_state`` and the estimate belong to models_registry.lifecycle (the agents'
instances follow them), so they are read-only here and Start, Stop and Restart are
actions that call it, as POST /api/models/{id}/start does. A definition is checked
and saved by models_registry.services (the served-name rule, the llama.cpp flag
allow-list), so the admin cannot store what /api would refuse. Placements are shown,
not edited: changing them is services' job (approved nodes, GPUs the node reported,
no replica removed under a running model). The state column is the live one, from
``model_summary`` (docs/decisions.md D41, D60).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest

from core.errors import ServiceError
from models_registry import lifecycle, services
from models_registry.models import ModelDefinition, Placement
from nodes import status as node_status
from nodes.events import ModelSummary

# The fields an operator edits here; everything else is read-only.
EDITABLE = (
    "served_name",
    "runtime",
    "source_folder",
    "source_file",
    "settings",
    "auto_start",
    "memory_budget_bytes",
    *services.SERVING_FIELDS,
)
# Where a changelist row keeps its summary, read for the whole page at once.
_SUMMARY = "_admin_summary"


class PlacementInline(admin.TabularInline):
    """The replicas, read-only: POST/PATCH /api/models and the console change them."""

    model = Placement
    extra = 0
    fields = ("node", "gpu_uuids", "gpu_budgets", "instance_id", "created_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ModelDefinitionForm(forms.ModelForm):
    """A definition checked by models_registry.services, the same rules as /api."""

    # The model field would take 0 or a negative count; admission needs a positive one.
    memory_budget_bytes = forms.IntegerField(
        required=False, min_value=1, help_text="Bytes; empty for the estimate."
    )

    # Empty: the saved value or the default (the field has no null).
    load_timeout_seconds = forms.IntegerField(
        required=False, help_text="Seconds a request that started the model waits for Ready."
    )

    class Meta:
        model = ModelDefinition
        fields = EDITABLE

    definition: dict[str, Any]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        data = {field: cleaned[field] for field in EDITABLE if field in cleaned}
        if data.get("load_timeout_seconds") is None:
            data.pop("load_timeout_seconds", None)
        if "settings" in data and data["settings"] is None:
            data["settings"] = {}
        instance = self.instance if self.instance.pk else None
        try:
            self.definition = services.validate_definition(data, instance=instance)
        except ServiceError as exc:
            self.add_error(_field_of(exc, self.fields), exc.message)
        else:
            self.definition["memory_budget_bytes"] = data.get("memory_budget_bytes")
        return cleaned


def _field_of(exc: ServiceError, fields: dict[str, Any]) -> str | None:
    """The form field a refusal names ("settings.context_size: ..." is settings)."""
    named = exc.details.get("field") or exc.message.split(":", 1)[0]
    field = str(named).split(".", 1)[0]
    field = next((n for n, f in services.SERVING_FIELDS.items() if f[0] == field), field)
    return field if field in fields else None


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


@admin.action(description="Restart the selected models (applies a changed definition)")
def restart(
    modeladmin: admin.ModelAdmin, request: HttpRequest, models: QuerySet[ModelDefinition]
) -> None:
    _each(modeladmin, request, models, "Restarted", lifecycle.restart_model)


@admin.register(ModelDefinition)
class ModelDefinitionAdmin(admin.ModelAdmin):
    """Definitions with their live state; the lifecycle's fields are read-only."""

    form = ModelDefinitionForm
    list_display = (
        "served_name",
        "state",
        "desired_state",
        "runtime",
        "delivery",
        "replicas",
        "auto_start",
        "updated_at",
    )
    list_filter = ("desired_state", "runtime", "delivery", "auto_start", "placements__node")
    search_fields = ("served_name", "source_folder", "source_file")
    inlines = [PlacementInline]
    actions = [start, stop, restart]
    readonly_fields = (
        "state",
        "delivery",
        "desired_state",
        "executable_version",
        "estimate",
        "auto_start_note",
        "created_at",
        "updated_at",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[ModelDefinition]:
        return super().get_queryset(request).prefetch_related("placements__node")

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        """The page's rows with their summaries; the nodes' statuses in one Redis round trip."""
        changelist = super().get_changelist_instance(request)
        rows = list(changelist.result_list)  # evaluated once; the template reuses the rows
        statuses = node_status.read_many({p.node for m in rows for p in m.placements.all()})
        for model in rows:
            setattr(model, _SUMMARY, services.model_summary(model, statuses))
        return changelist

    @admin.display(description="state")
    def state(self, model: ModelDefinition) -> str:
        """The state over the replicas (Ready, Starting, ..., Offline, Unplaced)."""
        summary: ModelSummary | None = getattr(model, _SUMMARY, None)
        if summary is None:
            nodes = {p.node for p in model.placements.all()}
            summary = services.model_summary(model, node_status.read_many(nodes))
        if summary["error"]:
            return f"{summary['state']}: {summary['error']}"
        return summary["state"]

    @admin.display(description="replicas")
    def replicas(self, model: ModelDefinition) -> str:
        return ", ".join(p.node.node_id for p in model.placements.all()) or "-"

    def save_model(
        self, request: HttpRequest, obj: ModelDefinition, form: forms.ModelForm, change: bool
    ) -> None:
        """Save through the services (the form checked with them already)."""
        assert isinstance(form, ModelDefinitionForm)
        data = dict(form.definition)
        if change:
            fresh = services.get_model(obj.pk)
            saved = services.update_model(fresh, data)
        else:
            saved = services.create_model(data)
        # The admin's messages and redirect name the saved row.
        obj.pk = saved.pk
        obj.refresh_from_db()

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        # A bulk delete would take running models with it; /api refuses that per model.
        actions.pop("delete_selected", None)
        return actions

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # As DELETE /api/models/{id}: a running model is stopped first.
        if isinstance(obj, ModelDefinition) and obj.desired_state == "running":
            return False
        if isinstance(obj, ModelDefinition) and services.routes_naming(obj.served_name):
            return False  # as DELETE /api/models/{id}: change the routes naming it first
        return super().has_delete_permission(request, obj)
