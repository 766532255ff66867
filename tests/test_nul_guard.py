"""A NUL in a query string or a form is a 400 naming the parameter, before any view."""

from __future__ import annotations

import pytest
from django.test import Client

from core.jsoninput import is_text


@pytest.mark.django_db
@pytest.mark.parametrize(
    "url",
    ["/nodes/?q=a%00b", "/admin/models_registry/modeldefinition/?desired_state__exact=%00",
     "/usage/?range=%00", "/api/nodes?x%00=1", "/login/?next=%00"],
)  # fmt: skip
def test_a_nul_in_the_query_is_a_400(url: str, operator: object) -> None:
    client = Client()
    client.force_login(operator)  # type: ignore[arg-type]
    answer = client.get(url)
    assert answer.status_code == 400
    assert "NUL character" in answer.content.decode()


@pytest.mark.django_db
def test_a_nul_in_a_form_is_a_400(operator: object) -> None:
    client = Client()
    client.force_login(operator)  # type: ignore[arg-type]
    answer = client.post("/nodes/add/", {"node_id": "gpu\x001"})
    assert answer.status_code == 400 and "'node_id'" in answer.content.decode()
    assert client.get("/nodes/?q=fine").status_code == 200


def test_json_text_refuses_a_nul() -> None:
    assert not is_text("a\x00b") and not is_text("\ud800") and is_text("ü")


@pytest.mark.django_db
@pytest.mark.parametrize("logged_in", [False, True])
def test_a_form_over_the_limit_is_a_413_that_says_what_to_do(
    logged_in: bool, operator: object
) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    client = Client()
    if logged_in:
        client.force_login(operator)  # type: ignore[arg-type]
    big = SimpleUploadedFile("backup.json", b" " * (2_621_440 + 1))
    answer = client.post("/backups/restore/", {"document": big})
    assert answer.status_code == 413
    text = answer.content.decode()
    assert "larger than 2621440 bytes" in text and "manage.py restore FILE" in text
