"""Model definitions and where they are placed."""

from __future__ import annotations

from django.core.validators import RegexValidator
from django.db import models

from protocol.names import FOLDER_PATTERN

# The characters only (a migration holds the pattern); the services apply the whole rule,
# protocol.names.check_folder_name, before anything is saved.
folder_validator = RegexValidator(
    FOLDER_PATTERN, "Folder names use letters, digits, '.', '_' and '-' (max 200)."
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
    # The engine image of a container model (docs/operator-guide.md, "Containers").
    image = models.CharField(max_length=512, blank=True, help_text="Container image reference")
    source_folder = models.CharField(max_length=200, validators=[folder_validator])
    source_file = models.CharField(max_length=255)
    settings = models.JSONField(default=dict, blank=True, help_text="Typed runtime settings")
    executable_version = models.CharField(max_length=60, blank=True)
    auto_start = models.BooleanField(default=False)
    # Why auto-start last left this model stopped (empty when it did not).
    auto_start_note = models.CharField(max_length=500, blank=True)
    # Set by hand to override the estimate; admission uses it when present.
    memory_budget_bytes = models.BigIntegerField(null=True, blank=True)
    # The last estimate computed from the GGUF header: breakdown, header facts, when.
    estimate = models.JSONField(default=dict, blank=True)
    desired_state = models.CharField(max_length=16, choices=Desired.choices, default="stopped")
    # Serving policy (docs/operator-guide.md, "Serving"): load on demand, idle unload,
    # pinned (never unloaded to make room), and the fair queue's bounds (null: defaults).
    load_on_demand = models.BooleanField(default=False)
    idle_unload_seconds = models.PositiveIntegerField(null=True, blank=True)
    load_timeout_seconds = models.PositiveIntegerField(default=300)
    pinned = models.BooleanField(default=False)
    queue_max_length = models.PositiveIntegerField(null=True, blank=True)
    queue_timeout_seconds = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["served_name"]

    def __str__(self) -> str:
        return self.served_name


class Route(models.Model):
    """A stable name applications call, pointing at served names in order of preference.

    The router uses the first target that can take the request now and falls back
    to the next (router.routing). A route's name never equals a served name.
    """

    name = models.CharField(max_length=200, unique=True)
    targets = models.JSONField(default=list, help_text="Served names, first preferred")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} -> {', '.join(self.targets)}"


class Placement(models.Model):
    """One node a model runs on. Several placements of one model are replicas."""

    model = models.ForeignKey(ModelDefinition, on_delete=models.CASCADE, related_name="placements")
    node = models.ForeignKey("nodes.Node", on_delete=models.PROTECT, related_name="placements")
    gpu_uuids = models.JSONField(default=list, blank=True)
    # Bytes per GPU, in gpu_uuids order; empty means "the budget split by each
    # card's free memory". A map that names only some GPUs is refused.
    gpu_budgets = models.JSONField(default=list, blank=True)
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
        return self.instance_id_of(self.model_id, self.pk)

    @staticmethod
    def instance_id_of(model_id: int, pk: int) -> str:
        """:attr:`instance_id` from the two columns (a list read with ``values_list``)."""
        return f"m{model_id}-p{pk}"


class MemorySample(models.Model):
    """One start's budget beside what the instance really used once Ready.

    Kept so the estimate's error can be reported per architecture and
    quantisation (docs/operator-guide.md, "Admission, placement and replicas"): the estimate is deliberately on the
    safe side, and these pairs show by how much.
    """

    model = models.ForeignKey(
        ModelDefinition, on_delete=models.SET_NULL, null=True, related_name="memory_samples"
    )
    served_name = models.CharField(max_length=200)
    node_id = models.CharField(max_length=40)
    instance_id = models.CharField(max_length=64)
    ready_at = models.CharField(max_length=40, help_text="The instance's readyAt, one row a start")
    architecture = models.CharField(max_length=60, blank=True)
    file_type = models.CharField(max_length=20, blank=True, help_text="GGUF general.file_type")
    budget_bytes = models.BigIntegerField()
    measured_bytes = models.BigIntegerField()
    kind = models.CharField(max_length=16, help_text="rss or gpu-delta")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["instance_id", "ready_at"], name="one_sample_per_start")
        ]

    def __str__(self) -> str:
        return f"{self.served_name} on {self.node_id}: {self.measured_bytes}/{self.budget_bytes}"
