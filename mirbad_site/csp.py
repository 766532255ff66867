"""The Content-Security-Policy of every HTML page the web port serves.

Console, login and admin pages get :data:`CONTENT_SECURITY_POLICY`: scripts, styles,
images and connections (the console's websocket included) from this origin only, no
inline script or style, no plugins, no framing. The console's templates keep to it:
no inline handlers, ``console/static/console/confirm.js`` asks the confirmations. The admin
of Django 5.2 has no inline scripts either (its data rides on ``data-`` attributes).
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

__all__ = ["CONTENT_SECURITY_POLICY", "ContentSecurityPolicyMiddleware"]

# 'self' matches ws:// and wss:// of the page's own host and port (CSP level 3), which
# is where the console's live websocket goes.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "font-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


class ContentSecurityPolicyMiddleware(MiddlewareMixin):
    """Adds :data:`CONTENT_SECURITY_POLICY` to every HTML response that has none.

    Django 5.2 has no CSP of its own (6.0 adds one). JSON, CSV and static files are
    left alone: a policy only means something to a page a browser renders. The mixin
    makes it work in sync and async chains alike, as Django's own middlewares do.
    """

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        content_type = response.get("Content-Type", "")
        if content_type.startswith("text/html") and "Content-Security-Policy" not in response:
            response["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        return response
