"""The model editor: create and edit a definition, its source and placement (thin: the
form only turns text into typed values; models_registry.services judges them, as it
does for /api/models; docs/decisions.md D65)."""

from __future__ import annotations

import re
from typing import Any

from django import forms
from django.contrib import messages
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from console.access import operator_required
from core.errors import ServiceError
from models_registry import admission, downloads, drafts, llamacpp, services, suggest, vllm
from models_registry.models import ModelDefinition
from nodes import status as node_status
from nodes.models import Node
from protocol.engine_flags import DELIVERIES
from protocol.names import NODE_ID_RE

GIB = 2**30
SOURCE_KINDS = (("folder", "A folder on a node"), ("huggingface", "A Hugging Face repo"))
DEFAULTS = llamacpp.LlamaCppSettings()
VLLM_DEFAULTS = vllm.VllmSettings()
# The form's names of the llama.cpp section (the settings of the same names).
LLAMACPP_FIELDS = (
    "context_size", "parallel", "gpu_layers", "flash_attention", "cache_type_k",
    "cache_type_v", "batch_size", "ubatch_size", "threads", "reasoning", "embedding",
    "pooling", "causal_attention", "emulate_dimensions", "chat_template", "extra_args",
)  # fmt: skip
# The vLLM section: prefixed, since chat_template and extra_args are llama.cpp's names too.
VLLM_PREFIX = "vllm_"
VLLM_FIELDS = tuple(VLLM_PREFIX + name for name in VLLM_DEFAULTS.to_dict())
# Prefix caching is three-valued: vLLM's default when unset.
PREFIX_CACHING = {"": None, "on": True, "off": False}


def _select(options: tuple[str, ...], *, blank: bool = False) -> forms.Select:
    choices = [(o, o) for o in options]
    return forms.Select(choices=[("", "(none)"), *choices] if blank else choices)


def _lines(text: str | None) -> list[str]:
    """One argument a line, so a value with spaces stays one argument."""
    return [line.strip() for line in (text or "").splitlines() if line.strip()]


class ModelForm(forms.Form):
    """Text to typed values only; the rules (ranges, names, allow-lists) are the services'."""

    served_name = forms.CharField(required=False, max_length=400)
    runtime = forms.CharField(
        required=False,
        initial=ModelDefinition.Runtime.LLAMACPP,
        widget=forms.Select(choices=ModelDefinition.Runtime.choices),
    )
    delivery = forms.CharField(required=False, initial="process", widget=_select(DELIVERIES))
    image = forms.CharField(required=False, max_length=1000)
    source_kind = forms.ChoiceField(
        choices=SOURCE_KINDS, initial="folder", widget=forms.RadioSelect
    )
    source_node = forms.CharField(required=False, max_length=100)
    source_folder = forms.CharField(
        required=False, max_length=400, widget=forms.TextInput(attrs={"list": "folders"})
    )
    source_file = forms.CharField(required=False, max_length=400)
    hf_repo = forms.CharField(required=False, max_length=300)
    hf_revision = forms.CharField(required=False, max_length=300, initial="main")
    hf_variant = forms.CharField(required=False, max_length=400)
    hf_token = forms.CharField(
        required=False, max_length=400, widget=forms.PasswordInput(render_value=False)
    )
    context_size = forms.IntegerField(initial=DEFAULTS.context_size)
    parallel = forms.IntegerField(initial=DEFAULTS.parallel)
    gpu_layers = forms.IntegerField(initial=DEFAULTS.gpu_layers)
    flash_attention = forms.CharField(
        initial=DEFAULTS.flash_attention, widget=_select(llamacpp.FLASH_ATTENTION)
    )
    cache_type_k = forms.CharField(initial=DEFAULTS.cache_type_k, widget=_select(llamacpp.KV_TYPES))
    cache_type_v = forms.CharField(initial=DEFAULTS.cache_type_v, widget=_select(llamacpp.KV_TYPES))
    batch_size = forms.IntegerField(required=False)
    ubatch_size = forms.IntegerField(required=False)
    threads = forms.IntegerField(required=False)
    reasoning = forms.CharField(initial=DEFAULTS.reasoning, widget=_select(llamacpp.REASONING))
    embedding = forms.BooleanField(required=False)
    pooling = forms.CharField(required=False, widget=_select(llamacpp.POOLING, blank=True))
    causal_attention = forms.BooleanField(required=False, initial=True)
    emulate_dimensions = forms.BooleanField(required=False, initial=True)
    chat_template = forms.CharField(required=False, max_length=300)
    extra_args = forms.CharField(
        required=False, max_length=10_000, widget=forms.Textarea(attrs={"rows": 3})
    )
    vllm_max_model_len = forms.IntegerField(required=False)
    vllm_max_num_seqs = forms.IntegerField(initial=VLLM_DEFAULTS.max_num_seqs)
    # Text, not a number input: Chromium scrolls back to a number input holding a decimal
    # when it loses focus, so a click on Save right after editing it could miss.
    vllm_gpu_memory_utilization = forms.FloatField(
        initial=VLLM_DEFAULTS.gpu_memory_utilization,
        widget=forms.TextInput(attrs={"inputmode": "decimal", "size": 6}),
    )
    vllm_tensor_parallel_size = forms.IntegerField(required=False)
    vllm_dtype = forms.CharField(initial=VLLM_DEFAULTS.dtype, widget=_select(vllm.DTYPES))
    vllm_quantization = forms.CharField(
        required=False, widget=_select(vllm.QUANTIZATIONS, blank=True)
    )
    vllm_kv_cache_dtype = forms.CharField(
        initial=VLLM_DEFAULTS.kv_cache_dtype, widget=_select(vllm.KV_CACHE_DTYPES)
    )
    vllm_enable_prefix_caching = forms.CharField(
        required=False,
        widget=forms.Select(choices=[("", "engine default"), ("on", "on"), ("off", "off")]),
    )
    vllm_chat_template = forms.CharField(required=False, max_length=300)
    vllm_tool_call_parser = forms.CharField(
        required=False, widget=_select(vllm.TOOL_CALL_PARSERS, blank=True)
    )
    vllm_reasoning_parser = forms.CharField(
        required=False, widget=_select(vllm.REASONING_PARSERS, blank=True)
    )
    vllm_extra_args = forms.CharField(
        required=False, max_length=10_000, widget=forms.Textarea(attrs={"rows": 3})
    )
    auto_start = forms.BooleanField(required=False)
    memory_budget_gib = forms.FloatField(required=False)
    # Serving policy: empty number fields are null (services.SERVING_FIELDS says what that
    # means for each).
    load_on_demand = forms.BooleanField(required=False)
    idle_unload_seconds = forms.IntegerField(required=False)
    load_timeout_seconds = forms.IntegerField(
        required=False, initial=ModelDefinition._meta.get_field("load_timeout_seconds").default
    )
    pinned = forms.BooleanField(required=False)
    queue_max_length = forms.IntegerField(required=False)
    queue_timeout_seconds = forms.IntegerField(required=False)

    def clean(self) -> dict[str, Any] | None:
        # Only the chosen runtime's section goes to the services, so what the other one
        # holds (hidden by editor.js, or shown without it) cannot block a save.
        unsent = LLAMACPP_FIELDS if self.is_vllm() else VLLM_FIELDS
        for name in unsent:
            self.errors.pop(name, None)
        return super().clean()

    def is_vllm(self) -> bool:
        return getattr(self, "cleaned_data", {}).get("runtime") == ModelDefinition.Runtime.VLLM

    def field_of_setting(self, name: str) -> str:
        """The form field of a setting the services name, in the chosen runtime's section."""
        return VLLM_PREFIX + name if self.is_vllm() else name

    def runtime_values(self) -> dict[str, str]:
        """``runtime``, ``delivery`` and ``image`` as posted; one not posted is left to the
        services (the saved value, or the default). A process has no image: the field may
        still hold text typed before the delivery changed (hidden by editor.js)."""
        out = {
            name: str(self.cleaned_data.get(name) or "")
            for name in ("runtime", "delivery", "image")
            if name in self.data
        }
        if out.get("delivery") == "process":
            out["image"] = ""
        return out

    def settings(self) -> dict[str, Any]:
        """The chosen runtime's settings as the services take them."""
        return self.vllm_settings() if self.is_vllm() else self.llamacpp_settings()

    def vllm_settings(self) -> dict[str, Any]:
        """Empty optional fields: None (vLLM's own default, docs/operator-guide.md)."""
        data = self.cleaned_data
        out = {
            name: data.get(VLLM_PREFIX + name)
            for name in ("max_model_len", "max_num_seqs", "gpu_memory_utilization",
                         "tensor_parallel_size", "dtype", "kv_cache_dtype")
        }  # fmt: skip
        for name in ("quantization", "chat_template", "tool_call_parser", "reasoning_parser"):
            out[name] = data.get(VLLM_PREFIX + name) or None
        caching = data.get("vllm_enable_prefix_caching") or ""
        # A word the select does not offer goes as it is, for the services to refuse.
        out["enable_prefix_caching"] = PREFIX_CACHING.get(caching, caching)
        out["extra_args"] = _lines(data.get("vllm_extra_args"))
        return out

    def llamacpp_settings(self) -> dict[str, Any]:
        """The llama.cpp settings as the services take them (empty optional fields: None)."""
        data = self.cleaned_data
        out: dict[str, Any] = {
            name: data.get(name)
            for name in (
                "context_size", "parallel", "gpu_layers", "flash_attention", "cache_type_k",
                "cache_type_v", "batch_size", "ubatch_size", "threads", "reasoning",
                "embedding", "causal_attention", "emulate_dimensions",
            )
        }  # fmt: skip
        out["pooling"] = data.get("pooling") or None
        out["chat_template"] = data.get("chat_template") or None
        out["extra_args"] = _lines(data.get("extra_args"))
        return out

    def serving(self) -> dict[str, Any]:
        """The serving policy's fields as the services take them; an empty load timeout
        (it has no null) keeps the saved value or the default."""
        out = {name: self.cleaned_data.get(name) for name in services.SERVING_FIELDS}
        if out["load_timeout_seconds"] is None:
            del out["load_timeout_seconds"]
        return out

    def budget_bytes(self) -> int | None:
        value = self.cleaned_data.get("memory_budget_gib")
        return None if value is None else round(value * GIB)


def initial_for(model: ModelDefinition) -> dict[str, Any]:
    """The form's values of a saved definition."""
    initial: dict[str, Any] = {
        "served_name": model.served_name,
        "runtime": model.runtime,
        "delivery": model.delivery,
        "image": model.image,
        "source_kind": "folder",
        "source_folder": model.source_folder,
        "source_file": model.source_file,
        "auto_start": model.auto_start,
        **{name: getattr(model, name) for name in services.SERVING_FIELDS},
        "memory_budget_gib": (
            round(model.memory_budget_bytes / GIB, 3) if model.memory_budget_bytes else None
        ),
    }
    placements = list(model.placements.all())
    if placements:
        initial["source_node"] = placements[0].node.node_id
    vllm_model = model.runtime == ModelDefinition.Runtime.VLLM
    prefix = VLLM_PREFIX if vllm_model else ""
    defaults = VLLM_DEFAULTS.to_dict() if vllm_model else DEFAULTS.to_dict()
    for key, value in {**defaults, **(model.settings or {})}.items():
        name = prefix + key
        if key == "extra_args":
            initial[name] = "\n".join(value) if isinstance(value, list) else ""
        elif key == "enable_prefix_caching" and vllm_model:
            initial[name] = {True: "on", False: "off"}.get(value, "")
        elif name in ModelForm.base_fields:
            initial[name] = "" if value is None else value
    return initial


def _budget_text(value: str) -> float | str | None:
    """A per-GPU budget in GiB: a number, None when empty, the text when it is not one."""
    value = value.strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        return value


def posted_placements(post: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """``place`` (node ids), ``gpus-<node>`` (UUIDs) and ``budget-<node>-<uuid>`` (GiB) as
    the services' ``placements``; returns them and the budget texts that are not numbers."""
    out, errors = [], []
    for node_id in post.getlist("place"):
        item: dict[str, Any] = {"node": node_id}
        if NODE_ID_RE.fullmatch(node_id):
            uuids = post.getlist(f"gpus-{node_id}")
            item["gpuUuids"] = uuids
            budgets = []
            for uuid in uuids:
                value = _budget_text(post.get(f"budget-{node_id}-{uuid}", ""))
                if isinstance(value, str):
                    errors.append(f"{node_id}, {uuid}: the budget '{value}' is not a number of GiB")
                elif value is not None:
                    budgets.append(round(value * GIB))
            if budgets:
                item["gpuBudgets"] = budgets
        out.append(item)
    return out, errors


# Where a service's field name shows in the form.
FIELD_NAMES = {
    "served_name": "served_name",
    "source_folder": "source_folder",
    "sourceFolder": "source_folder",
    "folder": "source_folder",
    "source_file": "source_file",
    "memoryBudgetBytes": "memory_budget_gib",
    "auto_start": "auto_start",
    **{api: name for name, (api, _, _) in services.SERVING_FIELDS.items()},
    "repoId": "hf_repo",
    "revision": "hf_revision",
    "variant": "hf_variant",
    "token": "hf_token",
}
PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


def attach_error(
    form: ModelForm, placement_errors: list[str], exc: ServiceError, *, saving: bool
) -> None:
    """Put a service's refusal next to the field it names, else above the form.

    While ``saving``, a refusal that names no field is the placement's: the definition's
    own checks all name theirs (a node that does not exist or is not approved, a replica
    removed from a running model do not)."""
    fields = (exc.details or {}).get("fields")
    if isinstance(fields, dict):
        for path, message in fields.items():
            name = str(path).removeprefix("settings.")
            form.add_error(_field(form, str(path)), f"{name}: {message}")
        return
    match = PREFIX.match(exc.message)
    path = str((exc.details or {}).get("field") or (match.group(1) if match else ""))
    if path.startswith("placements") or path == "node" or (saving and not path):
        placement_errors.append(exc.message)
        return
    message = exc.message[match.end() :] if match and match.group(1) == path else exc.message
    form.add_error(_field(form, path), message)


def _field(form: ModelForm, path: str) -> str | None:
    """The form field a service's path names (a setting: in the chosen runtime's
    section), None when the form has none."""
    name = FIELD_NAMES.get(path) or path
    if name.startswith("settings."):
        name = form.field_of_setting(name.removeprefix("settings."))
    return name if name in form.fields else None


def _nodes(model: ModelDefinition | None, post: Any | None) -> list[dict[str, Any]]:
    """The approved nodes as the placement grid shows them (checked: placed or posted)."""
    nodes = list(Node.objects.filter(approved=True, revoked=False).order_by("node_id"))
    statuses = node_status.read_many(nodes)
    placed = {p.node.node_id: p for p in model.placements.all()} if model else {}
    rows = []
    for node in nodes:
        status = statuses[node.node_id]
        placement = placed.get(node.node_id)
        if post is not None:
            checked = node.node_id in post.getlist("place")
            chosen = set(post.getlist(f"gpus-{node.node_id}"))
        else:
            checked = placement is not None
            chosen = set(placement.gpu_uuids) if placement else set()
        saved_budgets = (
            dict(zip(placement.gpu_uuids, placement.gpu_budgets, strict=False)) if placement else {}
        )
        gpus = []
        for uuid, gpu in admission.node_gpus(node, status).items():
            if post is not None:
                budget = post.get(f"budget-{node.node_id}-{uuid}", "")
            else:
                saved = saved_budgets.get(uuid)
                budget = f"{saved / GIB:.2f}" if saved else ""
            total = gpu.get("memoryTotalBytes")
            gpus.append(
                {
                    "uuid": uuid,
                    "index": gpu.get("index"),
                    "name": gpu.get("name") or "",
                    "total_gib": total / GIB if isinstance(total, int) else None,
                    "checked": uuid in chosen,
                    "budget": budget,
                }
            )
        weights = (status.get("telemetry") or {}).get("weights") or []
        rows.append(
            {
                "node_id": node.node_id,
                "state": node_status.state_of(status),
                "checked": checked,
                "gpus": gpus,
                "folders": [w.get("folder") for w in weights if isinstance(w, dict)],
            }
        )
    return rows


def _suggestions(model: ModelDefinition | None) -> tuple[list[dict[str, Any]], str]:
    """The ranked suggestions with their reasons (suggest.py), or why there are none."""
    if model is None:
        return [], "Name a folder and a file: the nodes are ranked as you type."
    if model.runtime == ModelDefinition.Runtime.VLLM:
        return [], drafts.VLLM_SUGGESTIONS_NOTE
    try:
        ranked = list(suggest.suggest_placements(model.pk)["suggestions"])
    except ServiceError as exc:
        return [], exc.message
    return ranked, "" if ranked else "No node to suggest."


def _hub_values(form: ModelForm) -> dict[str, Any]:
    values = form.cleaned_data
    return {
        "repoId": values.get("hf_repo") or None,
        "revision": values.get("hf_revision") or "main",
        "variant": values.get("hf_variant") or None,
        "token": values.get("hf_token") or None,
    }


def _variant_file(form: ModelForm) -> str:
    """The model file of the variant the form names, from the hub's listing
    (models_registry.downloads.inspect: the variants a download can take)."""
    hub = _hub_values(form)
    listed = downloads.inspect(hub["repoId"], hub["revision"], hub["token"])["variants"]
    for variant in listed:
        if variant["name"] == hub["variant"]:
            return str(variant["modelFile"])
    names = ", ".join(sorted(v["name"] for v in listed)) or "none (no .gguf files)"
    raise ServiceError(
        400,
        "invalid_request",
        f"variant: {hub['variant']!r} is not a GGUF variant of {hub['repoId']}; "
        f"choose one of: {names}",
    )


def _start_download(form: ModelForm, folder: str) -> str:
    """Start the form's Hugging Face download on its node (models_registry.downloads
    judges every value); returns what was started, for the next page's message."""
    hub = _hub_values(form)
    if hub["variant"] is None:
        raise ServiceError(400, "invalid_request", "variant: name the GGUF variant to download")
    started = downloads.start_download(
        form.cleaned_data.get("source_node") or None, {"folder": folder, **hub}
    )
    return (
        f"Download of {hub['repoId']} ({hub['variant']}) into '{started.get('folder')}' "
        f"started on {started['node']}."
    )


def _editor(request: HttpRequest, model: ModelDefinition | None) -> HttpResponse:
    placement_errors: list[str] = []
    status = 200
    if request.method == "POST":
        form = ModelForm(request.POST)
        placements, budget_errors = posted_placements(request.POST)
        placement_errors.extend(budget_errors)
        if form.is_valid() and not budget_errors:
            data: dict[str, Any] = {
                "served_name": form.cleaned_data["served_name"],
                **form.runtime_values(),
                "source_folder": form.cleaned_data["source_folder"],
                "source_file": form.cleaned_data["source_file"],
                "settings": form.settings(),
                "auto_start": form.cleaned_data["auto_start"],
                "memory_budget_bytes": form.budget_bytes(),
                **form.serving(),
                "placements": placements,
            }
            hub = form.cleaned_data["source_kind"] == "huggingface"
            started = None
            saving = False
            try:
                if hub and not data["source_file"] and form.cleaned_data["hf_variant"]:
                    data["source_file"] = _variant_file(form)
                with transaction.atomic():
                    saving = True
                    if model is None:
                        saved = services.create_model(data)
                    else:
                        saved = services.update_model(model, data)
                    saving = False
                    if hub:
                        # Last, inside the transaction: a refused download saves nothing,
                        # and a refused definition starts no download.
                        started = _start_download(form, saved.source_folder)
            except ServiceError as exc:
                attach_error(form, placement_errors, exc, saving=saving)
            else:
                verb = "Created" if model is None else "Saved"
                messages.success(request, f"{verb} model '{saved.served_name}'.")
                if started:
                    messages.info(request, started)
                return redirect("model", model_id=saved.pk)
        status = 400
    elif request.method == "GET":
        form = ModelForm(initial=initial_for(model) if model else None)
    else:
        return HttpResponse(status=405, headers={"Allow": "GET, POST"})
    nodes = _nodes(model, request.POST if request.method == "POST" else None)
    suggestions, note = _suggestions(model)
    return render(
        request,
        "console/model_edit.html",
        {
            "form": form,
            "model": model,
            "nodes": nodes,
            "folders": sorted({f for n in nodes for f in n["folders"] if f}),
            "placement_errors": placement_errors,
            "suggestions": suggestions,
            "suggestions_note": note,
        },
        status=status,
    )


@operator_required
def model_new(request: HttpRequest) -> HttpResponse:
    """/models/new/: the editor for a new definition."""
    return _editor(request, None)


@operator_required
def model_edit(request: HttpRequest, model_id: int) -> HttpResponse:
    """/models/<id>/edit/: the editor for a saved definition (what runs shows
    "restart pending" until it is restarted)."""
    model = ModelDefinition.objects.prefetch_related("placements__node").filter(pk=model_id).first()
    if model is None:
        raise Http404(f"No model {model_id}.")
    return _editor(request, model)
