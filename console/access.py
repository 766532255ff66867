"""Who may see the console: operators (staff users), everyone else goes to the login page."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpResponse

PageView = Callable[..., HttpResponse]
operator_required: Callable[[PageView], PageView] = staff_member_required(login_url="/login/")
