"""The console's pages (the URL names templates and redirects use)."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from console import key_views, login_views, views

urlpatterns = [
    path("", views.overview, name="overview"),
    path("nodes/add/", views.add_node, name="add-node"),
    path("takeover/", views.takeover, name="takeover"),
    path("nodes/<str:node_id>/", views.node_page, name="node"),
    path("nodes/<str:node_id>/rekey/", views.rekey_node, name="node-rekey"),
    path("nodes/<str:node_id>/<str:action>/", views.node_action, name="node-action"),
    path("keys/", key_views.keys_page, name="keys"),
    path("keys/<int:key_id>/revoke/", key_views.revoke_key, name="key-revoke"),
    path("login/", login_views.console_login, name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
]
