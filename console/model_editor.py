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
from models_registry import admission, downloads, llamacpp, services, suggest
from models_registry.models import ModelDefinition
from nodes import status as node_status
from nodes.models import Node
from protocol.names import NODE_ID_RE

GIB = 2**30
SOURCE_KINDS = (("folder", "A folder on a node"), ("huggingface", "A Hugging Face repo"))
DEFAULTS = llamacpp.LlamaCppSettings()


def _select(options: tuple[str, ...], *, blank: bool = False) -> forms.Select:
    choices = [(o, o) for o in options]
    return forms.Select(choices=[("", "(none)"), *choices] if blank else choices)


class ModelForm(forms.Form):
    """Text to typed values only; the rules (ranges, names, allow-lists) are the services'."""

    served_name = forms.CharField(required=False, max_length=400)
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
    auto_start = forms.BooleanField(required=False)
    memory_budget_gib = forms.FloatField(required=False)

    def settings(self) -> dict[str, Any]:
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
        # One argument a line, so a value with spaces stays one argument.
        lines = (data.get("extra_args") or "").splitlines()
        out["extra_args"] = [line.strip() for line in lines if line.strip()]
        return out

    def budget_bytes(self) -> int | None:
        value = self.cleaned_data.get("memory_budget_gib")
        return None if value is None else round(value * GIB)


def initial_for(model: ModelDefinition) -> dict[str, Any]:
    """The form's values of a saved definition."""
    initial: dict[str, Any] = {
        "served_name": model.served_name,
        "source_kind": "folder",
        "source_folder": model.source_folder,
        "source_file": model.source_file,
        "auto_start": model.auto_start,
        "memory_budget_gib": (
            round(model.memory_budget_bytes / GIB, 3) if model.memory_budget_bytes else None
        ),
    }
    placements = list(model.placements.all())
    if placements:
        initial["source_node"] = placements[0].node.node_id
    saved = {**DEFAULTS.to_dict(), **(model.settings or {})}
    for key, value in saved.items():
        if key == "extra_args":
            initial[key] = "\n".join(value) if isinstance(value, list) else ""
        elif key in ModelForm.base_fields:
            initial[key] = "" if value is None else value
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
            form.add_error(name if name in form.fields else None, f"{name}: {message}")
        return
    match = PREFIX.match(exc.message)
    path = str((exc.details or {}).get("field") or (match.group(1) if match else ""))
    if path.startswith("placements") or path == "node" or (saving and not path):
        placement_errors.append(exc.message)
        return
    name = FIELD_NAMES.get(path) or path.removeprefix("settings.")
    message = exc.message[match.end() :] if match and match.group(1) == path else exc.message
    form.add_error(name if name in form.fields else None, message)


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
                "source_folder": form.cleaned_data["source_folder"],
                "source_file": form.cleaned_data["source_file"],
                "settings": form.settings(),
                "auto_start": form.cleaned_data["auto_start"],
                "memory_budget_bytes": form.budget_bytes(),
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
