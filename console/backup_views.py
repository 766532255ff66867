"""Console page for backups: the runs, a backup on demand, its one-time link."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.cache import add_never_cache_headers

from backups import fleet_restore, services
from backups.api.views import download_path
from backups.models import RestoreJob
from backups.reader import MAX_DOCUMENT_BYTES, BackupInvalid, WrongPassphrase
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


# -- restore ----------------------------------------------------------------------------


class UploadForm(forms.Form):
    document = forms.FileField(label="Backup file")
    passphrase = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="The backup's passphrase, to preview its API keys and CA; may be left empty.",
    )


def _uploaded_bytes(form: UploadForm) -> bytes | None:
    """The file's bytes, or None (and an error at the field) when it is too large."""
    upload = form.cleaned_data["document"]
    if upload.size > MAX_DOCUMENT_BYTES:
        form.add_error(
            "document", f"is {upload.size} bytes; a backup is at most {MAX_DOCUMENT_BYTES}"
        )
        return None
    return b"".join(upload.chunks())


@operator_required
def restore_page(request: HttpRequest) -> HttpResponse:
    """Upload a backup: it is read and previewed, and nothing changes until confirmed."""
    if request.method == "POST":
        form = UploadForm(request.POST, request.FILES)
        if form.is_valid():
            data = _uploaded_bytes(form)
            if data is not None:
                try:
                    job = fleet_restore.upload(
                        data,
                        passphrase=form.cleaned_data["passphrase"] or None,
                        file_name=form.cleaned_data["document"].name or "",
                        actor=request.user.get_username(),
                    )
                except BackupInvalid as exc:
                    form.add_error(
                        "passphrase" if isinstance(exc, WrongPassphrase) else "document", str(exc)
                    )
                else:
                    return redirect("restore-job", job_id=job.pk)
    elif request.method == "GET":
        form = UploadForm()
    else:
        return HttpResponseNotAllowed(["GET", "POST"])
    jobs = list(RestoreJob.objects.defer("document")[:20])
    return render(
        request, "console/restore.html", {"form": form, "jobs": jobs},
        status=400 if form.errors else 200,
    )  # fmt: skip


@operator_required
def restore_job(request: HttpRequest, job_id: int) -> HttpResponse:
    """A restore's preview (with the confirm form) or, once applied, its live progress."""
    job = get_object_or_404(RestoreJob.objects.defer("document"), pk=job_id)
    error = ""
    status = 200
    if request.method == "POST":
        chosen = request.POST.getlist("models")
        try:
            job = fleet_restore.confirm(
                RestoreJob.objects.get(pk=job.pk),
                passphrase=request.POST.get("passphrase") or None,
                served_names=chosen,
                actor=request.user.get_username(),
            )
        except (BackupInvalid, ServiceError) as exc:
            error = exc.message if isinstance(exc, ServiceError) else str(exc)
            status = 400
        else:
            return redirect("restore-job", job_id=job.pk)
    elif request.method != "GET":
        return HttpResponseNotAllowed(["GET", "POST"])
    steps = list(job.steps.all())
    context = {"job": job, "preview": job.preview, "steps": steps, "error": error}
    return render(request, "console/restore_job.html", context, status=status)
