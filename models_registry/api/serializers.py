"""/api/models, /api/downloads, /api/model-folders and /api/reclaim on the wire."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers
from rest_framework.exceptions import ValidationError

from core.api_serializers import (
    ApiSerializer,
    JsonBool,
    JsonInt,
    JsonObject,
    JsonObjectList,
    JsonStr,
    JsonStrList,
)
from models_registry import lifecycle, services
from models_registry.models import ModelDefinition, Placement
from nodes.api.serializers import PageFieldsSerializer


class ModelWriteSerializer(ApiSerializer):
    """POST /api/models and PATCH /api/models/{id}; ``source`` is the services' name.

    The definition's rules (names, the settings, placements, budgets) are
    models_registry.services': the console and the admin share them.
    """

    servedName = JsonStr(source="served_name", help_text="The /v1 model name.")
    sourceFolder = JsonStr(source="source_folder", help_text="The model folder on the node.")
    sourceFile = JsonStr(
        source="source_file",
        help_text="A .gguf file inside the folder (vLLM: empty or absent, the whole folder).",
    )
    autoStart = JsonBool(source="auto_start", help_text="Start when the node's agent boots.")
    runtime = JsonStr(help_text="'llamacpp' (default) or 'vllm'.")
    delivery = JsonStr(
        help_text="'process' (llama.cpp's default) or 'container' (vLLM's only delivery)."
    )
    image = JsonStr(help_text="The engine image of a container model: name[:tag][@sha256:...].")
    settings = JsonObject(
        help_text="llama.cpp or vLLM settings, by runtime (docs/operator-guide.md)."
    )
    node = JsonStr(help_text="Shorthand for one placement on this node; null for none.")
    placements = JsonObjectList(help_text="[{node, gpuUuids?, gpuBudgets?}], at most 64.")
    memoryBudgetBytes = JsonInt(
        source="memory_budget_bytes", help_text="A positive byte count, or null for the estimate."
    )
    # Serving policy (docs/operator-guide.md, "Serving"); services.clean_serving judges them.
    loadOnDemand = JsonBool(
        source="load_on_demand", help_text="A /v1 request starts the model when it is stopped."
    )
    idleUnloadSeconds = JsonInt(
        source="idle_unload_seconds",
        help_text="Stop the model after this long without a request (10-2592000); null: never.",
    )
    loadTimeoutSeconds = JsonInt(
        source="load_timeout_seconds",
        help_text="How long a request that started the model waits for Ready (1-3600).",
    )
    pinned = JsonBool(help_text="Never stopped to make room for another model, nor when idle.")
    queueMaxLength = JsonInt(
        source="queue_max_length",
        help_text="Requests that may wait for a slot (0-100000); null: MIRBAD_QUEUE_MAX.",
    )
    queueTimeoutSeconds = JsonInt(
        source="queue_timeout_seconds",
        help_text="How long a request waits for a slot (1-3600); null: MIRBAD_QUEUE_TIMEOUT.",
    )


class CommandSerializer(ApiSerializer):
    """The body of start, restart and stop: a JSON object or no body."""

    force = JsonBool(
        allow_null=False, help_text="Skip the memory admission (start and restart only)."
    )
    node = JsonStr(help_text="Act on this node's replica only.")

    def validate_force(self, value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValidationError("must be true or false")
        return value

    def validate_node(self, value: Any) -> Any:
        if value is not None and not isinstance(value, str):
            raise ValidationError("must be a node id")
        return value


class CommandResultSerializer(serializers.Serializer):
    modelId = serializers.IntegerField()
    servedName = serializers.CharField()
    instances = serializers.ListField(child=serializers.DictField())


class PlacementSerializer(serializers.Serializer):
    """A placement with its instance's live state; context holds ``model`` and ``statuses``."""

    node = serializers.CharField(source="node.node_id")
    instanceId = serializers.CharField(source="instance_id")
    gpuUuids = serializers.JSONField(source="gpu_uuids")
    gpuBudgets = serializers.JSONField(source="gpu_budgets")
    state = serializers.SerializerMethodField()
    restartCount = serializers.SerializerMethodField()
    restartPending = serializers.SerializerMethodField()
    measured = serializers.SerializerMethodField()
    overBudget = serializers.SerializerMethodField()
    error = serializers.SerializerMethodField()

    def _instance(self, placement: Placement) -> dict[str, Any] | None:
        status = (self.context["statuses"].get(placement.node.node_id)) or {}
        found: dict[str, Any] | None = (status.get("instances") or {}).get(placement.instance_id)
        return found

    @extend_schema_field(OpenApiTypes.STR)
    def get_state(self, placement: Placement) -> Any:
        inst = self._instance(placement)
        return (inst or {}).get("state") if inst else "Stopped"

    @extend_schema_field(OpenApiTypes.INT)
    def get_restartCount(self, placement: Placement) -> Any:
        return (self._instance(placement) or {}).get("restartCount", 0)

    def get_restartPending(self, placement: Placement) -> bool:
        return lifecycle.restart_pending(placement.model, placement, self._instance(placement))

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_measured(self, placement: Placement) -> Any:
        return (self._instance(placement) or {}).get("measured")

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_overBudget(self, placement: Placement) -> str | None:
        model = placement.model
        measured = self.get_measured(placement)
        budget = model.memory_budget_bytes or (model.estimate or {}).get("budgetBytes")
        return lifecycle.over_budget_text(
            budget, measured.get("bytes") if isinstance(measured, dict) else None
        )

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_error(self, placement: Placement) -> Any:
        return (self._instance(placement) or {}).get("error")


class ModelSerializer(serializers.Serializer):
    """A model definition with its placements and state; context holds ``statuses``."""

    id = serializers.IntegerField(source="pk")
    servedName = serializers.CharField(source="served_name")
    runtime = serializers.CharField()
    delivery = serializers.CharField()
    image = serializers.CharField()
    sourceFolder = serializers.CharField(source="source_folder")
    sourceFile = serializers.CharField(source="source_file")
    settings = serializers.JSONField()
    autoStart = serializers.BooleanField(source="auto_start")
    autoStartNote = serializers.SerializerMethodField()
    desiredState = serializers.CharField(source="desired_state")
    memoryBudgetBytes = serializers.IntegerField(source="memory_budget_bytes", allow_null=True)
    loadOnDemand = serializers.BooleanField(source="load_on_demand")
    idleUnloadSeconds = serializers.IntegerField(source="idle_unload_seconds", allow_null=True)
    loadTimeoutSeconds = serializers.IntegerField(source="load_timeout_seconds")
    pinned = serializers.BooleanField()
    queueMaxLength = serializers.IntegerField(source="queue_max_length", allow_null=True)
    queueTimeoutSeconds = serializers.IntegerField(source="queue_timeout_seconds", allow_null=True)
    estimate = serializers.SerializerMethodField()
    placements = serializers.SerializerMethodField()
    state = serializers.SerializerMethodField()
    nodeId = serializers.SerializerMethodField()
    error = serializers.SerializerMethodField()

    def _state(self, model: ModelDefinition) -> dict[str, Any]:
        # One state per model and answer: state, nodeId and error come from it. With
        # many=True one child serializer answers for every model, so it keeps them all.
        cache: dict[int, dict[str, Any]] = self.__dict__.setdefault("_model_states", {})
        if model.pk not in cache:
            cache[model.pk] = services.model_state(model, self.context["statuses"])
        return cache[model.pk]

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_autoStartNote(self, model: ModelDefinition) -> str | None:
        return model.auto_start_note or None

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_estimate(self, model: ModelDefinition) -> Any:
        return model.estimate or None

    @extend_schema_field(PlacementSerializer(many=True))
    def get_placements(self, model: ModelDefinition) -> Any:
        placements = list(model.placements.all())
        for placement in placements:
            placement.model = model  # the prefetched definition, not one query each
        return PlacementSerializer(placements, many=True, context=self.context).data

    @extend_schema_field(OpenApiTypes.STR)
    def get_state(self, model: ModelDefinition) -> Any:
        return self._state(model)["state"]

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_nodeId(self, model: ModelDefinition) -> Any:
        return self._state(model)["nodeId"]

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_error(self, model: ModelDefinition) -> Any:
        return self._state(model)["error"]


# many=False: the list action answers one object that holds the list, not a bare array.
@extend_schema_serializer(many=False)
class ModelListSerializer(PageFieldsSerializer):
    models = ModelSerializer(many=True)


class EstimateAccuracySerializer(serializers.Serializer):
    groups = serializers.ListField(child=serializers.DictField())


class DownloadRequestSerializer(ApiSerializer):
    """POST /api/downloads?node=: what to fetch from Hugging Face, and where.

    models_registry.downloads.start_download judges the values (it resolves the
    revision and the variant on the hub).
    """

    folder = JsonStr(help_text="The model folder to create on the node.")
    # A field called "source" (the API's name) hides Field.source only for the type checker:
    # DRF takes declared fields off the class.
    source = JsonStr(help_text="'huggingface' (the default); 'ollama' answers 501.")  # type: ignore[assignment]  # see above
    repoId = JsonStr(help_text="The Hugging Face repo, e.g. org/name-GGUF.")
    revision = JsonStr(help_text="A branch, tag or commit; 'main' when left out.")
    allowPatterns = JsonStrList(help_text="File patterns to fetch; or name a variant.")
    variant = JsonStr(help_text="A GGUF variant as GET /api/downloads/inspect lists it.")
    token = JsonStr(help_text="A Hugging Face token for a private repo.")


class ReclaimRequestSerializer(ApiSerializer):
    """POST /api/reclaim {node, folders}."""

    not_an_object = "The body must be a JSON object {node, folders}."

    node = JsonStr(help_text="The node; may be left out when there is one.")
    folders = JsonStrList(help_text="The fetched folders to delete.")

    def unknown_fields(self, unknown: list[str]) -> ValidationError:
        return ValidationError({unknown[0]: "unknown field; the body is {node, folders}"})
