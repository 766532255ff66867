"""The console's pages (the URL names templates and redirects use)."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from console import (
    audit_views,
    backup_views,
    download_views,
    key_views,
    login_views,
    model_editor,
    model_views,
    node_views,
    route_views,
    usage_views,
    views,
)

urlpatterns = [
    path("", views.overview, name="overview"),
    path("nodes/", node_views.nodes_list, name="nodes"),
    path("nodes/add/", views.add_node, name="add-node"),
    path("takeover/", views.takeover, name="takeover"),
    path("nodes/<str:node_id>/", node_views.node_page, name="node"),
    path("overview/summary/", views.overview_summary, name="overview-summary"),
    path("nodes/<str:node_id>/current/", node_views.node_current, name="node-current"),
    path("nodes/<str:node_id>/row/", node_views.node_row_fragment, name="node-row"),
    path("nodes/<str:node_id>/history.json", node_views.node_history, name="node-history"),
    path("nodes/<str:node_id>/rekey/", views.rekey_node, name="node-rekey"),
    path("nodes/<str:node_id>/<str:action>/", views.node_action, name="node-action"),
    path("downloads/", download_views.downloads_page, name="downloads"),
    path("downloads/start/", download_views.start, name="download-start"),
    path(
        "downloads/<str:node_id>/<str:folder>/cancel/",
        download_views.cancel,
        name="download-cancel",
    ),
    path(
        "downloads/<str:node_id>/<str:folder>/retry/", download_views.retry, name="download-retry"
    ),
    path(
        "downloads/<str:node_id>/<str:folder>/reclaim/",
        download_views.reclaim,
        name="weights-reclaim",
    ),
    path("models/", model_views.models_list, name="models"),
    path("models/new/", model_editor.model_new, name="model-new"),
    path("models/estimate/", model_views.model_estimate, name="model-estimate"),
    path("models/<int:model_id>/", model_views.model_page, name="model"),
    path("models/<int:model_id>/row/", model_views.model_row_fragment, name="model-row"),
    path("models/<int:model_id>/history.json", model_views.model_history, name="model-history"),
    path("models/<int:model_id>/edit/", model_editor.model_edit, name="model-edit"),
    path("models/<int:model_id>/<str:action>/", model_views.model_action, name="model-action"),
    path("routes/", route_views.routes_page, name="routes"),
    path("routes/<int:route_id>/", route_views.route_edit, name="route-edit"),
    path("routes/<int:route_id>/delete/", route_views.route_delete, name="route-delete"),
    path("usage/", usage_views.usage_page, name="usage"),
    path("audit/", audit_views.audit_page, name="audit"),
    path("keys/", key_views.keys_page, name="keys"),
    path("keys/<int:key_id>/revoke/", key_views.revoke_key, name="key-revoke"),
    path("backups/", backup_views.backups_page, name="backups"),
    path("backups/restore/", backup_views.restore_page, name="restore"),
    path("backups/restore/<int:job_id>/", backup_views.restore_job, name="restore-job"),
    path("login/", login_views.console_login, name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
]
