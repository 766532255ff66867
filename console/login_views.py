"""The console's and the admin's login views: throttled, the password check off the shared thread.

Under ASGI, Django runs every sync view on one thread (``thread_sensitive``), so a
PBKDF2 check there (a million iterations) held up every other sync view: with 24
concurrent logins ``/api`` went from a few ms to seconds at p50 (docs/performance.md,
"Logins and /api"). These views are async and run Django's own login view, form,
backends and signals unchanged, in a small pool of their own: hashlib's PBKDF2
releases the GIL, so the shared thread serves ``/api`` meanwhile, and the pool's size
bounds how many cores password checks may take.

Before the password is checked, a POST is refused with 429 and ``Retry-After`` when
the account or the source address is past the failure limit (core.throttle).
Failures are counted and logged through Django's ``user_login_failed`` signal, so
every caller of ``authenticate`` is counted, whichever view it came through.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import UsernameField
from django.contrib.auth.signals import user_login_failed
from django.db import close_old_connections
from django.db.models import Field
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import render

from core import throttle

# Half the cores (at least one): logins queue among themselves instead of taking the
# whole machine from the requests that are not logins.
LOGIN_THREADS = max(1, (os.cpu_count() or 2) // 2)
_pool = ThreadPoolExecutor(max_workers=LOGIN_THREADS, thread_name_prefix="mirbad-login")

SyncView = Callable[..., HttpResponseBase]


def client_address(request: HttpRequest) -> str:
    """The peer address the web server saw (see core.throttle on proxies)."""
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def _account(request: HttpRequest) -> str:
    """The user name as the login form will pass it to ``authenticate`` (and so as a
    failure is counted): stripped and NFKC-normalised by Django's own field, so that
    a fullwidth "a" or a space cannot dodge the counter of "alice"."""
    name_field = get_user_model().USERNAME_FIELD
    raw = str(request.POST.get(name_field, ""))
    field = get_user_model()._meta.get_field(name_field)
    # USERNAME_FIELD names a concrete field; only a reverse relation would lack max_length.
    max_length = field.max_length if isinstance(field, Field) else None
    return str(UsernameField(max_length=max_length or 254).to_python(raw))


def _too_many(request: HttpRequest, wait: int) -> HttpResponse:
    response = render(
        request,
        "registration/login_throttled.html",
        {
            "retry_after": wait,
            "limit": throttle.MAX_FAILURES,
            "window_minutes": throttle.WINDOW_SECONDS // 60,
        },
        status=429,
    )
    response["Retry-After"] = str(wait)
    return response


def _login(view: SyncView, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
    """One login request, on a pool thread: the throttle, then Django's view."""
    try:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        account, address = _account(request), client_address(request)
        wait = throttle.login_wait(account, address)
        if wait is not None:
            throttle.login_refused(account, address, request.path, wait)
            return _too_many(request, wait)
        response = view(request, *args, **kwargs)
        user = getattr(request, "user", None)
        if response.status_code == 302 and user is not None and user.is_authenticated:
            throttle.forgive_login(account, address)
        return response
    finally:
        # This thread is not the one Django closes connections on at the end of a request.
        close_old_connections()


def throttled(view: SyncView) -> Callable[..., Coroutine[Any, Any, HttpResponseBase]]:
    """``view`` as an async view that runs it on the login pool, behind the throttle."""

    async def login_view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        run = sync_to_async(_login, thread_sensitive=False, executor=_pool)
        return await run(view, request, *args, **kwargs)

    return login_view


console_login = throttled(auth_views.LoginView.as_view())
admin_login = throttled(admin.site.login)


@receiver(user_login_failed, dispatch_uid="mirbad-login-failed")
def _count_failure(
    sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None, **kwargs: Any
) -> None:
    account = credentials.get(get_user_model().USERNAME_FIELD, credentials.get("username", ""))
    throttle.record_login_failure(
        str(account or ""),
        client_address(request) if request is not None else None,
        request.path if request is not None else "authenticate()",
    )
