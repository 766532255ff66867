"""/api answers made before any view, and the schema fixes the API fuzzer asked for.

tests/e2e/test_api_fuzz.py finds these against a live master; these pin each one
in seconds: Django's 404 and 500 and the NUL guard answer the ``{"error": {...}}``
JSON under /api (and their pages elsewhere), a body that is not an object is
refused, the list answers are objects, and nullable answers are declared so.
"""

from __future__ import annotations

import pytest
from django.test import Client, RequestFactory
from rest_framework.test import APIClient

from mirbad_site import api_pages

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("path", ["/api/models/abc", "/api/keys/-1", "/api/nope", "/api/nodes/"])
def test_a_path_no_api_route_matches_is_the_api_404(operator_client: APIClient, path: str) -> None:
    answer = operator_client.get(path)
    assert answer.status_code == 404
    assert answer["Content-Type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == "not_found" and path in error["message"]


def test_a_page_outside_api_keeps_django_404(operator: object) -> None:
    client = Client()
    client.force_login(operator)  # type: ignore[arg-type]
    answer = client.get("/no-such-console-page/")
    assert answer.status_code == 404
    assert answer["Content-Type"].startswith("text/html")


def test_an_uncaught_error_under_api_is_json_and_elsewhere_django_500() -> None:
    factory = RequestFactory()
    api = api_pages.server_error(factory.get("/api/nodes"))
    assert api.status_code == 500 and api["Content-Type"] == "application/json"
    assert b'"internal_error"' in api.content
    page = api_pages.server_error(factory.get("/nodes/"))
    assert page.status_code == 500 and page["Content-Type"].startswith("text/html")


def test_a_nul_in_an_api_query_is_the_api_400(operator_client: APIClient) -> None:
    answer = operator_client.get("/api/nodes?x%00=1")
    assert answer.status_code == 400
    assert answer["Content-Type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and "NUL character" in error["message"]


@pytest.mark.parametrize("body", ["[]", "null", "true", '"x"'])
@pytest.mark.parametrize("path", ["/api/join-tokens", "/api/models/1/start"])
def test_a_body_that_is_not_an_object_is_refused(
    operator_client: APIClient, path: str, body: str
) -> None:
    answer = operator_client.post(path, body, content_type="application/json")
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["message"] == "The body must be a JSON object."


def test_no_body_is_still_an_empty_object(operator_client: APIClient) -> None:
    answer = operator_client.post("/api/join-tokens")
    assert answer.status_code == 400  # no nodeId: the service's refusal, not the body's
    assert answer.json()["error"]["message"].startswith("nodeId:")


def test_schema_lists_are_objects_and_nullable_answers_say_so(
    operator_client: APIClient,
) -> None:
    schema = operator_client.get("/api/schema?format=json").json()
    for path, name in [("/api/nodes", "NodeList"), ("/api/models", "ModelList"),
                       ("/api/keys", "KeyList")]:  # fmt: skip
        ok = schema["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]
        assert ok["schema"] == {"$ref": f"#/components/schemas/{name}"}, path
    node = schema["components"]["schemas"]["Node"]["properties"]
    assert node["lastSeen"]["type"] == "number" and node["lastSeen"]["nullable"]
    for name in ("fingerprint", "fencing", "bootId", "statusAsOf", "memoryTotalBytes"):
        assert node[name].get("nullable"), name
    assert node["reasons"]["items"] == {"$ref": "#/components/schemas/NodeReason"}
    # Bodies are JSON only: the services judge JSON types.
    body = schema["paths"]["/api/keys"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json"}
