"""The console's routes page: operators only; create, reorder, rename and delete."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AbstractUser
from django.test import Client

from models_registry import routes
from models_registry.models import Route
from tests.factories import make_model

pytestmark = pytest.mark.django_db


def _logged_in(user: AbstractUser) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture(autouse=True)
def _models(db: object) -> None:
    for name in ("a", "b"):
        make_model(name)


def test_needs_an_operator_login(viewer: AbstractUser) -> None:
    row = routes.create_route({"name": "r", "targets": ["a"]})
    for client in (Client(), _logged_in(viewer)):
        for path, data in (
            ("/routes/", None),
            ("/routes/", {"name": "s", "targets": "a"}),
            (f"/routes/{row.pk}/", {"name": "r", "targets": "b"}),
            (f"/routes/{row.pk}/delete/", {}),
        ):
            response = client.get(path) if data is None else client.post(path, data)
            assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert list(Route.objects.values_list("name", "targets")) == [("r", ["a"])]


def test_create_reorder_rename_delete(operator: AbstractUser) -> None:
    client = _logged_in(operator)
    page = client.get("/routes/")
    assert page.status_code == 200 and b"No routes yet" in page.content
    assert b'href="/routes/"' in page.content  # the nav link
    created = client.post("/routes/", {"name": "chat", "targets": "a\r\nb\r\n"})
    assert created.status_code == 302 and created["Location"] == "/routes/"
    row = Route.objects.get()
    assert (row.name, row.targets) == ("chat", ["a", "b"])
    listed = client.get("/routes/")
    assert b"a\nb\n</textarea>" in listed.content
    saved = client.post(f"/routes/{row.pk}/", {"name": "chat2", "targets": "b\na"})
    assert saved.status_code == 302
    row.refresh_from_db()
    assert (row.name, row.targets) == ("chat2", ["b", "a"])
    assert client.post(f"/routes/{row.pk}/delete/").status_code == 302
    assert not Route.objects.exists()
    assert client.post("/routes/999/delete/").status_code == 404


def test_a_refusal_is_shown_and_nothing_changes(operator: AbstractUser) -> None:
    client = _logged_in(operator)
    refused = client.post("/routes/", {"name": "r", "targets": "a\nnope"})
    assert refused.status_code == 400
    assert b"targets: no model is served as &#x27;nope&#x27;" in refused.content
    assert b"a\nnope</textarea>" in refused.content  # the form keeps what was typed
    row = routes.create_route({"name": "r", "targets": ["a"]})
    clash = client.post(f"/routes/{row.pk}/", {"name": "b", "targets": "a"})
    assert clash.status_code == 400 and b"name: &#x27;b&#x27; is a model" in clash.content
    assert Route.objects.get().name == "r"
