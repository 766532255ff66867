"""Console page for API keys (thin: parsing here, decisions in router.keys)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_POST

from console.views import operator_required
from router import budgets, keys
from router.models import SCOPES, ApiKey

DEFAULT_SCOPES = ["chat", "completions", "embeddings", "rerank"]
# The session entry carrying a new key to the one GET after its create.
NEW_KEY = "console.new_key"


class KeyForm(forms.Form):
    """The create form; limits left empty mean no limit."""

    name = forms.CharField(max_length=100)
    scopes = forms.MultipleChoiceField(
        choices=[(s, s) for s in SCOPES], widget=forms.CheckboxSelectMultiple
    )
    models = forms.CharField(
        required=False, help_text="Served names, comma-separated; empty allows every model"
    )
    expires_at = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="UTC",
    )
    rpm_limit = forms.IntegerField(required=False, min_value=1, label="Requests per minute")
    tpm_limit = forms.IntegerField(required=False, min_value=1, label="Tokens per minute")
    concurrency_limit = forms.IntegerField(required=False, min_value=1, label="Concurrent requests")
    # Bounds and zone names are router.keys' to judge, so the page words them as the API.
    priority = forms.IntegerField(required=False, label="Queue priority", initial=0)
    queue_timeout_seconds = forms.IntegerField(required=False, label="Queue timeout (s)")
    daily_token_budget = forms.IntegerField(required=False, label="Tokens per day")
    monthly_token_budget = forms.IntegerField(required=False, label="Tokens per month")
    budget_timezone = forms.CharField(
        required=False, max_length=64, label="Budget time zone", initial="UTC"
    )

    def field_for(self, service_field: str) -> str | None:
        """The form field a service refusal is about (None: the form as a whole)."""
        name = "models" if service_field == "model_allowlist" else service_field
        return name if name in self.fields else None

    def key_arguments(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {
            "name": data["name"],
            "scopes": data["scopes"],
            "model_allowlist": [m for m in data["models"].split(",") if m.strip()],
            "expires_at": data["expires_at"],
            "rpm_limit": data["rpm_limit"],
            "tpm_limit": data["tpm_limit"],
            "concurrency_limit": data["concurrency_limit"],
            "priority": data["priority"],
            "queue_timeout_seconds": data["queue_timeout_seconds"],
            "daily_token_budget": data["daily_token_budget"],
            "monthly_token_budget": data["monthly_token_budget"],
            "budget_timezone": data["budget_timezone"] or None,
        }


@operator_required
def keys_page(request: HttpRequest) -> HttpResponse:
    """List keys; a POST creates one and redirects to the list (post/redirect/get).

    The new key's plaintext rides in the (database-backed) session to exactly the next
    GET, which pops it: a reload shows it no more and creates nothing, and it is never
    in a URL or a cookie (docs/decisions.md D67). A refused form is shown again, its
    errors at their fields, with status 400 (nothing was created, so a reload is harmless).
    """
    context: dict[str, Any] = {}
    if request.method == "POST":
        form = KeyForm(request.POST)
        if form.is_valid():
            try:
                row, plaintext = keys.create_key(**form.key_arguments())
            except keys.KeyError_ as exc:
                field = form.field_for(exc.field)
                form.add_error(field, exc.reason if field else str(exc))
            else:
                request.session[NEW_KEY] = {"id": row.pk, "name": row.name, "key": plaintext}
                return redirect("keys")
    elif request.method == "GET":
        form = KeyForm(initial={"scopes": DEFAULT_SCOPES})
        context["created"] = request.session.pop(NEW_KEY, None)
    else:
        return HttpResponseNotAllowed(["GET", "POST"])
    context["form"] = form
    rows = list(ApiKey.objects.all())
    states = budgets.status(rows)
    # (key, its budgets or None): the template shows use and the 80 % warning.
    context["keys"] = [(row, states.get(row.pk)) for row in rows]
    context["base_url"] = request.build_absolute_uri("/v1")
    response = render(request, "console/keys.html", context, status=400 if form.errors else 200)
    if context.get("created"):
        add_never_cache_headers(response)  # no copy of the secret in any cache
    return response


@operator_required
@require_POST
def revoke_key(request: HttpRequest, key_id: int) -> HttpResponse:
    try:
        keys.revoke_key(key_id)
    except keys.KeyNotFound as exc:
        return HttpResponse(str(exc), status=404, content_type="text/plain")
    return redirect("keys")
