"""The Downloads page: start, follow, cancel and retry downloads; weights per node.

Thin: every decision is models_registry.downloads' (the same functions /api/downloads
and /api/reclaim call). Every POST that changes something answers with a redirect
and says its outcome in a django.contrib.messages message, so a reload never sends
it twice (docs/decisions.md D67). A start form the service refuses is shown again
with the refusal at its field, and nothing was started.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from console.views import download_row, operator_required
from core.errors import ServiceError
from models_registry import downloads
from models_registry.models import ModelDefinition
from nodes import status as node_status
from nodes.models import Node

CANCELLABLE = ("Queued", "Running")

# The service names the fields of /api/downloads; the form's names differ for one.
_SERVICE_FIELDS = {"repoId": "repo", "revision": "revision", "variant": "variant"}
_SERVICE_FIELDS |= {"folder": "folder", "token": "token"}


def _approved_nodes() -> list[Node]:
    return list(Node.objects.filter(approved=True, revoked=False).order_by("node_id"))


class StartForm(forms.Form):
    """The start form; the rules of each value are the download service's."""

    repo = forms.CharField(max_length=200, help_text="owner/name on Hugging Face")
    revision = forms.CharField(max_length=200, required=False, help_text="empty: main")
    variant = forms.CharField(
        max_length=300, help_text="A GGUF variant as /api/downloads/inspect lists it"
    )
    node = forms.ChoiceField(choices=())
    folder = forms.CharField(
        max_length=200, required=False, help_text="empty: the repo's name after the slash"
    )
    # Never rendered back (render_value=False) and never put in a message.
    token = forms.CharField(
        max_length=400, required=False, widget=forms.PasswordInput(render_value=False)
    )

    def __init__(self, *args: Any, nodes: list[Node], **kwargs: Any) -> None:
        kwargs.setdefault("auto_id", "download-%s")  # the ids the browser tests use
        super().__init__(*args, **kwargs)
        choices = [(n.node_id, n.node_id) for n in nodes]
        self.fields["node"].choices = choices  # type: ignore[attr-defined]  # a ChoiceField

    def clean_repo(self) -> str:
        """The repo first: an empty folder is taken from it (the service's own pattern)."""
        repo = str(self.cleaned_data["repo"]).strip()
        if not downloads.REPO_RE.match(repo):
            raise forms.ValidationError("name a Hugging Face repo as owner/name")
        return repo

    def body(self) -> dict[str, Any]:
        """The /api/downloads body of this form (the service checks every value)."""
        data = self.cleaned_data
        repo = data["repo"]
        return {
            "folder": data["folder"].strip() or repo.rsplit("/", 1)[-1],
            "repoId": repo,
            "revision": data["revision"].strip() or "main",
            "variant": data["variant"].strip(),
            "token": data["token"] or None,
        }

    def add_refusal(self, exc: ServiceError) -> None:
        """The service's refusal at the field it names ("repoId: ..."), else above the form."""
        name, _, rest = exc.message.partition(": ")
        field = _SERVICE_FIELDS.get(name)
        self.add_error(field, rest if field else exc.message)


def size_text(value: object) -> str:
    """Bytes as the Weights table and the reclaim message print them ("" when unknown)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return ""
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    if value >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{value} bytes"


def download_actions(state: object) -> dict[str, bool]:
    """Which buttons a download's row has (downloads.js applies the same rule)."""
    return {"can_cancel": state in CANCELLABLE, "can_retry": state in downloads.RETRYABLE}


def _weights(nodes: list[Node], statuses: dict[str, Any]) -> list[dict[str, object]]:
    """Each node's model folders from its last heartbeat; reclaimable as the service says."""
    candidates = {(c["node"], c["folder"]) for c in downloads.reclaimable()["candidates"]}
    used: dict[str, list[str]] = {}
    for served, folder in ModelDefinition.objects.values_list("served_name", "source_folder"):
        used.setdefault(folder, []).append(served)
    rows = []
    for node in nodes:
        weights = ((statuses.get(node.node_id) or {}).get("telemetry") or {}).get("weights") or []
        for item in sorted(weights, key=lambda w: str(w.get("folder"))):
            rows.append(
                {
                    "node_id": node.node_id,
                    "folder": item.get("folder"),
                    "size": size_text(item.get("bytes")),
                    "fetched": bool(item.get("fetched")),
                    "used_by": ", ".join(sorted(used.get(str(item.get("folder")), []))),
                    "reclaimable": (node.node_id, item.get("folder")) in candidates,
                }
            )
    return rows


def _page(request: HttpRequest, form: StartForm, nodes: list[Node], status: int) -> HttpResponse:
    statuses = node_status.read_many(nodes)
    rows = [
        {"node_id": node_id, **download_row(d), **download_actions(d.get("state"))}
        for node_id, record in sorted(statuses.items())
        for d in sorted(
            ((record or {}).get("downloads") or {}).values(), key=lambda d: str(d.get("folder"))
        )
    ]
    context = {"form": form, "downloads": rows, "weights": _weights(nodes, statuses)}
    return render(request, "console/downloads.html", context, status=status)


@operator_required
@require_GET
def downloads_page(request: HttpRequest) -> HttpResponse:
    """The start form, the downloads per node (live over /ws/fleet/) and the weights."""
    nodes = _approved_nodes()
    return _page(request, StartForm(nodes=nodes, initial={"revision": "main"}), nodes, 200)


@operator_required
@require_POST
def start(request: HttpRequest) -> HttpResponse:
    """Start a download; a refusal shows the form again, its values kept but the token."""
    nodes = _approved_nodes()
    form = StartForm(request.POST, nodes=nodes)
    if not form.is_valid():
        return _page(request, form, nodes, 400)
    body = form.body()
    try:
        result = downloads.start_download(form.cleaned_data["node"], body)
    except ServiceError as exc:
        form.add_refusal(exc)
        return _page(request, form, nodes, exc.status)
    where = f"'{result.get('folder')}' on {result['node']}"
    if result.get("state") == "Failed":  # the hub refused: recorded Failed, not refused
        messages.error(request, f"The download into {where} failed: {result.get('error')}")
    else:
        messages.success(
            request,
            f"Download of {body['repoId']} ({body['variant']}) into {where} is "
            f"{result.get('state')}.",
        )
    return redirect("downloads")


def _act(request: HttpRequest, done: str, action: Any) -> HttpResponse:
    """Run one service call; its outcome or refusal becomes a message, then back."""
    try:
        action()
    except ServiceError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, done)
    return redirect("downloads")


@operator_required
@require_POST
def cancel(request: HttpRequest, node_id: str, folder: str) -> HttpResponse:
    return _act(
        request,
        f"The download into '{folder}' on {node_id} was cancelled.",
        lambda: downloads.cancel_download(node_id, folder),
    )


@operator_required
@require_POST
def retry(request: HttpRequest, node_id: str, folder: str) -> HttpResponse:
    return _act(
        request,
        f"The download into '{folder}' on {node_id} was started again.",
        lambda: downloads.retry_download(node_id, folder),
    )


@operator_required
@require_POST
def reclaim(request: HttpRequest, node_id: str, folder: str) -> HttpResponse:
    """Reclaim one folder; the node's answer for it (removed, or why not) is the message."""
    try:
        answer = downloads.reclaim({"node": node_id, "folders": [folder]})
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("downloads")
    [result] = answer["askedToRemove"]
    if not result["removed"]:
        messages.error(request, f"'{folder}' on {node_id} was not reclaimed: {result['reason']}.")
        return redirect("downloads")
    freed = result.get("bytesFreed")
    text = f"'{folder}' on {node_id} was reclaimed"
    text += f": {size_text(freed)} freed" if isinstance(freed, int) else ""
    if result.get("kept"):
        text += f"; kept (not fetched by MirbadLLM): {', '.join(result['kept'])}"
    messages.success(request, text + ".")
    return redirect("downloads")
