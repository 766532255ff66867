"""The web port's HTTPS rules (MIRBAD_SECURE_COOKIES) and the pages' Content-Security-Policy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from django.contrib.auth.models import AbstractUser
from django.test import Client, override_settings

from core.envconf import SettingError
from mirbad_site.csp import CONTENT_SECURITY_POLICY
from mirbad_site.web_security import REDIRECT_EXEMPT, load_web_security
from tests.fresh_django import run_django

ROOT = Path(__file__).resolve().parent.parent
ON = load_web_security(True, env={})
SECURE = {
    "SECURE_HSTS_SECONDS": ON.hsts_seconds,
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": ON.hsts_include_subdomains,
    "SECURE_SSL_REDIRECT": ON.ssl_redirect,
    "SECURE_REDIRECT_EXEMPT": REDIRECT_EXEMPT,
    "SESSION_COOKIE_SECURE": True,
    "CSRF_COOKIE_SECURE": True,
}
# What `manage.py check --deploy` may still say with MIRBAD_SECURE_COOKIES on; each one
# is explained to operators in docs/security.md ("check --deploy warnings").
EXPLAINED_DEPLOY_WARNINGS = {"security.W005", "security.W021"}


# -- the rules ------------------------------------------------------------------------


def test_off_without_secure_cookies() -> None:
    off = load_web_security(False, env={"MIRBAD_HSTS_INCLUDE_SUBDOMAINS": "true"})
    assert (off.hsts_seconds, off.hsts_include_subdomains, off.ssl_redirect) == (0, False, False)
    assert off.proxy_ssl_header is None


def test_on_with_secure_cookies_and_tunable() -> None:
    assert (ON.hsts_seconds, ON.hsts_include_subdomains, ON.ssl_redirect) == (31536000, False, True)
    assert ON.proxy_ssl_header is None
    tuned = load_web_security(
        True,
        env={
            "MIRBAD_HSTS_SECONDS": "3600",
            "MIRBAD_HSTS_INCLUDE_SUBDOMAINS": "yes",
            "MIRBAD_BEHIND_TLS_PROXY": "true",
        },
    )
    assert (tuned.hsts_seconds, tuned.hsts_include_subdomains) == (3600, True)
    assert tuned.proxy_ssl_header == ("HTTP_X_FORWARDED_PROTO", "https")


@pytest.mark.parametrize(
    ("name", "value"),
    [("MIRBAD_HSTS_SECONDS", "-1"), ("MIRBAD_HSTS_SECONDS", "a year"),
     ("MIRBAD_BEHIND_TLS_PROXY", "maybe"), ("MIRBAD_HSTS_INCLUDE_SUBDOMAINS", "2")],
)  # fmt: skip
def test_malformed_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingError, match=f"^{name}: "):
        load_web_security(True, env={name: value})


def test_settings_follow_secure_cookies_and_deploy_check_says_only_what_is_explained(
    tmp_path: Path,
) -> None:
    code = (
        "import json, django; django.setup(); from django.conf import settings as s; "
        "from django.core import checks; "
        "found = checks.run_checks(include_deployment_checks=True); "
        "print(json.dumps({'hsts': s.SECURE_HSTS_SECONDS, 'redirect': s.SECURE_SSL_REDIRECT, "
        "'exempt': s.SECURE_REDIRECT_EXEMPT, 'proxy': s.SECURE_PROXY_SSL_HEADER, "
        "'warnings': sorted(m.id for m in found)}))"
    )
    on = run_django(tmp_path, code, MIRBAD_SECURE_COOKIES="true")
    assert on.returncode == 0, on.stderr
    got = json.loads(on.stdout.strip().splitlines()[-1])
    assert got["hsts"] == 31536000 and got["redirect"] is True
    assert got["exempt"] == [r"^healthz$"] and got["proxy"] is None
    assert set(got["warnings"]) == EXPLAINED_DEPLOY_WARNINGS, got["warnings"]
    bad = run_django(tmp_path, code, MIRBAD_SECURE_COOKIES="true", MIRBAD_HSTS_SECONDS="x")
    assert bad.returncode == 2 and "MIRBAD_HSTS_SECONDS" in bad.stderr


# -- what a client sees ---------------------------------------------------------------


@pytest.mark.django_db
def test_secure_mode_redirects_plain_http_and_sends_hsts() -> None:
    with override_settings(**SECURE):
        client = Client()
        plain = client.get("/login/")
        assert plain.status_code == 301 and plain["Location"] == "https://testserver/login/"
        secure = client.get("/login/", secure=True)
        assert secure.status_code == 200
        assert secure["Strict-Transport-Security"] == "max-age=31536000"
        # The launcher and load balancers probe /healthz over plain HTTP on the host.
        health = client.get("/healthz")
        assert health.status_code in (200, 503) and "Location" not in health


@pytest.mark.django_db
def test_behind_a_tls_proxy_the_forwarded_scheme_counts() -> None:
    with override_settings(**SECURE, SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https")):
        response = Client().get("/login/", HTTP_X_FORWARDED_PROTO="https")
    assert response.status_code == 200 and "Strict-Transport-Security" in response


@pytest.mark.django_db
def test_console_pages_carry_the_policy_and_json_does_not(operator: AbstractUser) -> None:
    client = Client()
    login = client.get("/login/")
    assert login["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
    client.force_login(operator)
    for page in ("/", "/keys/"):
        response = client.get(page)
        assert response.status_code == 200
        assert response["Content-Security-Policy"] == CONTENT_SECURITY_POLICY, page
    api = client.get("/api/keys")
    assert api.status_code == 200 and "Content-Security-Policy" not in api


INLINE = [
    (re.compile(r"<script(?![^>]*\ssrc=)[^>]*>", re.I), "an inline <script>"),
    (re.compile(r"\son[a-z]+\s*=", re.I), "an inline event handler"),
    (re.compile(r"\sstyle\s*=|<style", re.I), "an inline style"),
    (re.compile(r"javascript:", re.I), "a javascript: URL"),
]


def test_templates_need_no_inline_script_or_style() -> None:
    found = []
    templates = sorted((ROOT / "console" / "templates").rglob("*.html"))
    assert templates, "no console templates found: the check would pass on nothing"
    for template in templates:
        text = template.read_text()
        for pattern, what in INLINE:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{template.relative_to(ROOT)}:{line}: {what}")
    assert not found, "the Content-Security-Policy would block: " + "; ".join(found)
