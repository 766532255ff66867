"""Model definitions and where they are placed."""

from __future__ import annotations

from django.core.validators import RegexValidator
from django.db import models

folder_validator = RegexValidator(
    r"^[A-Za-z0-9._-]{1,200}$", "Folder names use letters, digits, '.', '_' and '-' (max 200)."
)


class ModelDefinition(models.Model):
    """What to run and how: the served name clients use, the runtime and its settings.

    ``served_name`` is unique across all definitions, stopped ones included, so
    a client's ``model`` field always names at most one definition.
    """

    class Runtime(models.TextChoices):
        LLAMACPP = "llamacpp", "llama.cpp"
        VLLM = "vllm", "vLLM"

    class Delivery(models.TextChoices):
        PROCESS = "process"
        CONTAINER = "container"

    class Desired(models.TextChoices):
        RUNNING = "running"
        STOPPED = "stopped"

    served_name = models.CharField(max_length=200, unique=True)
    runtime = models.CharField(max_length=16, choices=Runtime.choices, default=Runtime.LLAMACPP)
    delivery = models.CharField(max_length=16, choices=Delivery.choices, default=Delivery.PROCESS)
    source_folder = models.CharField(max_length=200, validators=[folder_validator])
    source_file = models.CharField(max_length=255)
    settings = models.JSONField(default=dict, blank=True, help_text="Typed runtime settings")
    executable_version = models.CharField(max_length=60, blank=True)
    auto_start = models.BooleanField(default=False)
    desired_state = models.CharField(max_length=16, choices=Desired.choices, default="stopped")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["served_name"]

    def __str__(self) -> str:
        return self.served_name


class Placement(models.Model):
    """One node a model runs on. Several placements of one model are replicas."""

    model = models.ForeignKey(ModelDefinition, on_delete=models.CASCADE, related_name="placements")
    node = models.ForeignKey("nodes.Node", on_delete=models.PROTECT, related_name="placements")
    gpu_uuids = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["model", "node"], name="one_placement_per_node")
        ]

    def __str__(self) -> str:
        return f"{self.model} on {self.node}"

    @property
    def instance_id(self) -> str:
        """The id the agent knows this replica by (stable across restarts)."""
        return f"m{self.model_id}-p{self.pk}"
