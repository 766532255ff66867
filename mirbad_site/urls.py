"""URL map of the Django side: console, /api, admin, /healthz. /v1 is not here (asgi.py)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.urls import include, path

from backups.api import views as backup_api
from console import login_views
from mirbad_site import api_schema
from models_registry.api import downloads as download_api
from models_registry.api import routes as route_api
from models_registry.api import views as model_api
from nodes import monitor, status_cache
from nodes.api import audit as audit_api
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


# The /api viewsets, each action on the path it always had: flat paths (no router)
# keep every route's converter and keep tests/test_api.py's list of routes complete.
nodes_api = node_api.NodeViewSet
models_api = model_api.ModelViewSet
keys_api = key_api.KeyViewSet
downloads_api = download_api.DownloadViewSet
folders_api = download_api.ModelFolderViewSet
_LIST_CREATE: dict[str, Any] = {"get": "list", "post": "create"}
_READ_CHANGE: dict[str, Any] = {"get": "retrieve", "patch": "partial_update"}
_READ_DELETE: dict[str, Any] = {"get": "retrieve", "delete": "destroy"}
_DELETE: dict[str, Any] = {"delete": "destroy"}

urlpatterns = [
    path("", include("console.urls")),
    path("healthz", healthz),
    path("admin/login/", login_views.admin_login),  # ahead of the admin's own, unthrottled
    path("admin/", admin.site.urls),
    path("api/schema", api_schema.SchemaView.as_view(), name="api-schema"),
    path("api/docs", api_schema.DocsView.as_view(), name="api-docs"),
    path("api/nodes", nodes_api.as_view({"get": "list"})),
    path("api/nodes/<str:node_id>", nodes_api.as_view(_READ_CHANGE)),
    path("api/join-tokens", node_api.JoinTokenView.as_view()),
    path("api/takeover", node_api.TakeoverView.as_view()),
    path("api/model-folders", folders_api.as_view({"get": "list"})),
    path("api/model-folders/<str:folder>", folders_api.as_view({"get": "retrieve"})),
    path("api/model-folders/<str:folder>/gguf", node_api.ModelFolderGguf.as_view()),
    path("api/downloads", downloads_api.as_view(_LIST_CREATE)),
    path("api/downloads/inspect", downloads_api.as_view({"get": "inspect"})),
    path("api/downloads/<str:folder>", downloads_api.as_view(_READ_DELETE)),
    path("api/reclaim", download_api.ReclaimViewSet.as_view(_LIST_CREATE)),
    path("api/nodes/<str:node_id>/approve", nodes_api.as_view({"post": "approve"})),
    path("api/nodes/<str:node_id>/revoke", nodes_api.as_view({"post": "revoke"})),
    path("api/nodes/<str:node_id>/drain", nodes_api.as_view({"post": "drain"})),
    path("api/nodes/<str:node_id>/undrain", nodes_api.as_view({"post": "undrain"})),
    path("api/nodes/<str:node_id>/rekey", nodes_api.as_view({"post": "rekey"})),
    path("api/nodes/<str:node_id>/rotate", nodes_api.as_view({"post": "rotate"})),
    path("api/nodes/<str:node_id>/operations", nodes_api.as_view({"get": "operations"})),
    path("api/nodes/<str:node_id>/images", nodes_api.as_view({"get": "images"})),
    path(
        "api/nodes/<str:node_id>/maintenance",
        nodes_api.as_view({"post": "maintenance", "delete": "end_maintenance"}),
    ),
    path("api/models", models_api.as_view(_LIST_CREATE)),
    path("api/models/<int:model_id>", models_api.as_view(_READ_CHANGE | _DELETE)),
    path("api/models/<int:model_id>/start", models_api.as_view({"post": "start"})),
    path("api/models/<int:model_id>/stop", models_api.as_view({"post": "stop"})),
    path("api/models/<int:model_id>/restart", models_api.as_view({"post": "restart"})),
    path("api/models/<int:model_id>/estimate", models_api.as_view({"get": "estimate"})),
    path(
        "api/models/<int:model_id>/placement-suggestions",
        models_api.as_view({"get": "placement_suggestions"}),
    ),
    path("api/estimate-accuracy", model_api.EstimateAccuracyView.as_view()),
    path("api/routes", route_api.RouteViewSet.as_view(_LIST_CREATE)),
    # <path:>: a route's name may hold a '/' (as a served name may).
    path("api/routes/<path:route>", route_api.RouteViewSet.as_view(_READ_CHANGE | _DELETE)),
    path("api/keys", keys_api.as_view(_LIST_CREATE)),
    path("api/keys/<int:key_id>", keys_api.as_view({"patch": "partial_update"} | _DELETE)),
    path("api/audit", audit_api.AuditList.as_view()),
    path("api/audit.csv", audit_api.AuditCsv.as_view()),
    path("api/usage", usage_api.UsageSummary.as_view()),
    path("api/usage.csv", usage_api.UsageCsv.as_view()),
    path("api/backups", backup_api.BackupsView.as_view()),
    path("api/backups/download/<str:token>", backup_api.BackupDownloadView.as_view()),
]

# Under /api, Django's own 404 and 500 answer the {"error": {...}} JSON too.
handler404 = "mirbad_site.api_pages.page_not_found"
handler500 = "mirbad_site.api_pages.server_error"
