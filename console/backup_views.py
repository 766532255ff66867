"""Console page for backups: the runs, a backup on demand, its one-time link."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers

from backups import services
from backups.api.views import download_path
from console.access import operator_required
from core.errors import ServiceError

# The session entry carrying a new link to the one GET after the POST that made it.
NEW_LINK = "console.backup_link"


class BackupForm(forms.Form):
    passphrase = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="At least 12 characters. Without one, the backup has no secrets section "
        "(no API keys, no CA).",
    )
    include_ca = forms.BooleanField(
        required=False, initial=True, label="Seal the CA certificate and key too"
    )


@operator_required
def backups_page(request: HttpRequest) -> HttpResponse:
    """List the runs; a POST makes a backup now and redirects (post/redirect/get).

    The link rides in the session to exactly the next GET (as a new key does,
    docs/decisions.md D67): a reload shows it no more and makes no second backup.
    """
    context: dict[str, Any] = {}
    if request.method == "POST":
        form = BackupForm(request.POST)
        if form.is_valid():
            try:
                passphrase = services.check_passphrase(form.cleaned_data["passphrase"])
                made = services.create_on_demand(
                    actor=request.user.get_username(),
                    passphrase=passphrase,
                    include_ca=form.cleaned_data["include_ca"],
                )
            except ServiceError as exc:
                form.add_error("passphrase", exc.message)
            else:
                request.session[NEW_LINK] = {
                    "url": download_path(made.token),
                    "expires": made.expires_at.isoformat(),
                    "name": made.run.file_name,
                    "secrets": made.run.has_secrets,
                }
                return redirect("backups")
    elif request.method == "GET":
        form = BackupForm()
        context["link"] = request.session.pop(NEW_LINK, None)
    else:
        return HttpResponseNotAllowed(["GET", "POST"])
    cfg = settings.MIRBAD
    context.update(
        form=form,
        runs=services.recent_runs(),
        daily_at=cfg.backup_daily_at,
        directory=cfg.backup_directory,
        keep=cfg.backup_keep,
        scheduled_secrets=cfg.backup_passphrase is not None,
        include_ca=cfg.backup_include_ca,
    )
    response = render(request, "console/backups.html", context, status=400 if form.errors else 200)
    if context.get("link"):
        add_never_cache_headers(response)
    return response
