"""/api/schema and /api/docs: a schema without warnings, for operators only, no CDN, CSP kept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from django.contrib.staticfiles import finders
from django.core.management import call_command
from rest_framework.test import APIClient

from mirbad_site.urls import urlpatterns

pytestmark = pytest.mark.django_db


def _api_routes() -> set[str]:
    routes = set()
    for pattern in urlpatterns:
        route = str(pattern.pattern)
        if route.startswith("api/") and route not in ("api/schema", "api/docs"):
            routes.add("/" + re.sub(r"<\w+:(\w+)>", r"{\1}", route))
    return routes


def test_schema_generates_without_warnings_and_validates(tmp_path: Path) -> None:
    """``manage.py spectacular --validate --fail-on-warn``: a warning is a failure."""
    out = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    schema = yaml.safe_load(out.read_text())
    assert set(schema["paths"]) == _api_routes()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method == "parameters":
                continue
            assert operation["responses"], f"{method} {path} has no response"
            if method in ("post", "patch") and path.endswith(("/api/models", "/api/keys")):
                assert "requestBody" in operation, f"{method} {path} has no request shape"


def test_schema_names_the_wire_fields(operator_client: APIClient) -> None:
    answer = operator_client.get("/api/schema?format=json")
    assert answer.status_code == 200
    schema = answer.json()
    components = schema["components"]["schemas"]
    assert {"nodeId", "memoryReserveBytes", "gpuReserves", "statusSource"} <= set(
        components["Node"]["properties"]
    )
    assert set(components["PatchedModelWriteRequest"]["properties"]) == {
        "servedName", "sourceFolder", "sourceFile", "autoStart", "runtime", "delivery",
        "image", "settings", "node", "placements", "memoryBudgetBytes", "loadOnDemand",
        "idleUnloadSeconds", "loadTimeoutSeconds", "pinned", "queueMaxLength",
        "queueTimeoutSeconds",
    }  # fmt: skip
    assert "key" in components["NewKey"]["properties"]
    assert set(components["Error"]["properties"]) == {"error"}
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


def test_schema_is_yaml_by_default_for_an_admin_key(admin_key: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    answer = client.get("/api/schema")
    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("application/vnd.oai.openapi")
    assert yaml.safe_load(answer.content)["info"]["title"] == "MirbadLLM operator API"


@pytest.mark.parametrize("path", ["/api/schema", "/api/docs", "/api/docs?script"])
def test_schema_and_docs_refuse_non_operators_with_the_api_error(
    anon_client: APIClient, viewer_client: APIClient, chat_key: str, path: str
) -> None:
    browser = "text/html,application/xhtml+xml,*/*;q=0.8"
    anonymous = anon_client.get(path, HTTP_ACCEPT=browser)
    assert anonymous.status_code == 401
    assert anonymous["Content-Type"] == "application/json"
    assert anonymous.json()["error"]["code"] == "unauthorized"
    viewer = viewer_client.get(path, HTTP_ACCEPT=browser)
    assert viewer.status_code == 403
    assert viewer.json()["error"]["code"] == "forbidden"
    keyed = APIClient()
    keyed.credentials(HTTP_AUTHORIZATION=f"Bearer {chat_key}")
    assert keyed.get(path).status_code == 403


def test_docs_page_has_no_inline_script_and_no_cdn(operator_client: APIClient) -> None:
    page = operator_client.get("/api/docs")
    assert page.status_code == 200 and page["Content-Type"].startswith("text/html")
    html = page.content.decode()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="' in attrs and not body.strip() for attrs, body in scripts)
    assert "<style" not in html and "style=" not in html
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources and all(s.startswith("/") for s in sources), sources
    policy = page["Content-Security-Policy"]
    assert "script-src 'self';" in policy and "unsafe-inline" not in policy
    assert "img-src 'self' data:;" in policy and "frame-ancestors 'none'" in policy
    for source in sources:
        if source.startswith("/static/"):
            assert finders.find(source.removeprefix("/static/")), f"{source} is not served"
    script = operator_client.get("/api/docs?script")
    assert script.status_code == 200
    assert script["Content-Type"].startswith("application/javascript")
    assert "SwaggerUIBundle" in script.content.decode()
