"""The web port's HTTPS rules: the redirect, HSTS and the proxy header.

``MIRBAD_SECURE_COOKIES`` says the master is reached over TLS (usually through a proxy
in front of the web port). With it on, Django's SecurityMiddleware also redirects plain
HTTP to HTTPS and sends HSTS, except on ``/healthz``: the launcher and load balancers
probe that over plain HTTP on the host itself. ``/v1``, ``/metrics`` and the websocket
are not Django views (``mirbad_site/asgi.py``) and are never redirected: an API client
that sent its key over plain HTTP has already sent it.

Behind a proxy on another host, uvicorn does not believe the proxy's
``X-Forwarded-Proto`` (it trusts only 127.0.0.1), so every request would look like plain
HTTP and be redirected for ever: ``MIRBAD_BEHIND_TLS_PROXY`` makes Django read that
header itself. It must only be set when that proxy is the only way in, since a client
that can reach the web port directly could send the header too.

The Content-Security-Policy of the pages is ``mirbad_site/csp.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from core.envconf import env_bool, env_int

__all__ = ["REDIRECT_EXEMPT", "WebSecurity", "load_web_security"]

ONE_YEAR = 365 * 24 * 3600
# Paths (without the leading slash, as SECURE_REDIRECT_EXEMPT matches them) answered
# over plain HTTP even with the redirect on.
REDIRECT_EXEMPT = [r"^healthz$"]


@dataclass(frozen=True, kw_only=True)
class WebSecurity:
    """What settings.py hands to Django's SecurityMiddleware."""

    hsts_seconds: int
    hsts_include_subdomains: bool
    ssl_redirect: bool
    proxy_ssl_header: tuple[str, str] | None


def load_web_security(secure_cookies: bool, env: Mapping[str, str] | None = None) -> WebSecurity:
    """The HTTPS rules for ``MIRBAD_SECURE_COOKIES`` and the settings that tune them.

    Raises ``SettingError`` naming the variable when one is malformed.
    """
    hsts_seconds = env_int(
        "MIRBAD_HSTS_SECONDS", ONE_YEAR, minimum=0, maximum=2 * ONE_YEAR, env=env
    )
    include_subdomains = env_bool("MIRBAD_HSTS_INCLUDE_SUBDOMAINS", False, env=env)
    behind_proxy = env_bool("MIRBAD_BEHIND_TLS_PROXY", False, env=env)
    return WebSecurity(
        # Browsers ignore HSTS over plain HTTP and Django sends it only on HTTPS requests;
        # without TLS there is nothing to pin.
        hsts_seconds=hsts_seconds if secure_cookies else 0,
        hsts_include_subdomains=secure_cookies and include_subdomains,
        ssl_redirect=secure_cookies,
        proxy_ssl_header=("HTTP_X_FORWARDED_PROTO", "https") if behind_proxy else None,
    )
