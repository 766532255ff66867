"""URL map of the Django side: console, /api, admin, /healthz. /v1 is not here (asgi.py)."""

from __future__ import annotations

from django.contrib import admin
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.urls import include, path

from console import login_views
from models_registry.api import downloads as download_api
from models_registry.api import views as model_api
from nodes import monitor, status_cache
from nodes.api import views as node_api
from router.api import usage as usage_api
from router.api import views as key_api


def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness, the two stores every request depends on, and the monitor's heartbeat.

    A monitor that stopped beating (dead, hung, or never started) is not-ok: the
    node statuses /v1 routes on are no longer refreshed.
    """
    checks: dict[str, str] = {}
    extra: dict[str, float] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        status_cache.read_client().ping()  # a stalled Redis: error within the timeout
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    try:
        age = monitor.heartbeat_age()
    except Exception as exc:
        checks["monitor"] = f"error: {type(exc).__name__}"
    else:
        if age is None:
            checks["monitor"] = "missing"
        else:
            checks["monitor"] = "stale" if age > monitor.HEARTBEAT_STALE_AFTER else "ok"
            extra["monitorBeatAgeSeconds"] = round(age, 1)
    ok = all(v == "ok" for v in checks.values())
    body = {"status": "ok" if ok else "error", **checks, **extra}
    return JsonResponse(body, status=200 if ok else 503)


urlpatterns = [
    path("", include("console.urls")),
    path("healthz", healthz),
    path("admin/login/", login_views.admin_login),  # ahead of the admin's own, unthrottled
    path("admin/", admin.site.urls),
    path("api/nodes", node_api.NodeList.as_view()),
    path("api/nodes/<str:node_id>", node_api.NodeDetail.as_view()),
    path("api/join-tokens", node_api.JoinTokenCreate.as_view()),
    path("api/takeover", node_api.Takeover.as_view()),
    path("api/model-folders", download_api.ModelFolderList.as_view()),
    path("api/model-folders/<str:folder>", download_api.ModelFolderDetail.as_view()),
    path("api/model-folders/<str:folder>/gguf", node_api.ModelFolderGguf.as_view()),
    path("api/downloads", download_api.DownloadList.as_view()),
    path("api/downloads/inspect", download_api.DownloadInspect.as_view()),
    path("api/downloads/<str:folder>", download_api.DownloadDetail.as_view()),
    path("api/reclaim", download_api.Reclaim.as_view()),
    path("api/nodes/<str:node_id>/approve", node_api.NodeAction.as_view(action="approve")),
    path("api/nodes/<str:node_id>/revoke", node_api.NodeAction.as_view(action="revoke")),
    path("api/nodes/<str:node_id>/drain", node_api.NodeAction.as_view(action="drain")),
    path("api/nodes/<str:node_id>/undrain", node_api.NodeAction.as_view(action="undrain")),
    path("api/nodes/<str:node_id>/rekey", node_api.NodeRekey.as_view()),
    path("api/nodes/<str:node_id>/maintenance", node_api.NodeMaintenance.as_view()),
    path("api/models", model_api.ModelList.as_view()),
    path("api/models/<int:model_id>", model_api.ModelDetail.as_view()),
    path("api/models/<int:model_id>/start", model_api.ModelStart.as_view()),
    path("api/models/<int:model_id>/stop", model_api.ModelStop.as_view()),
    path("api/models/<int:model_id>/restart", model_api.ModelRestart.as_view()),
    path("api/models/<int:model_id>/estimate", model_api.ModelEstimate.as_view()),
    path(
        "api/models/<int:model_id>/placement-suggestions",
        model_api.PlacementSuggestions.as_view(),
    ),
    path("api/estimate-accuracy", model_api.EstimateAccuracy.as_view()),
    path("api/keys", key_api.KeyList.as_view()),
    path("api/keys/<int:key_id>", key_api.KeyDetail.as_view()),
    path("api/usage", usage_api.UsageSummary.as_view()),
    path("api/usage.csv", usage_api.UsageCsv.as_view()),
]
