"""Django settings, built from ``MIRBAD_*`` variables (see ``mirbad/config.py``).

Nothing here is a constant a deployment would need to edit: every value comes
from :func:`mirbad.config.load_master_config`, which fails at start with the
variable's name when a value is malformed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import dj_database_url
import django_stubs_ext

from core.config import load_master_config, load_secret_key
from core.envconf import SettingError
from mirbad_site.web_security import REDIRECT_EXEMPT, load_web_security

# Lets typed code subscript Django's generic classes at run time, e.g. a base
# class `admin.ModelAdmin[ApiKey]` (docs/decisions.md D47).
django_stubs_ext.monkeypatch()

try:
    MIRBAD = load_master_config()
    SECRET_KEY = load_secret_key(MIRBAD.data_path)
    WEB_SECURITY = load_web_security(MIRBAD.secure_cookies)
except SettingError as exc:
    # A traceback would bury the one line the operator needs.
    sys.stderr.write(f"mirbad: configuration error: {exc}\n")
    raise SystemExit(2) from None

BASE_DIR = Path(__file__).resolve().parent.parent
DEBUG = MIRBAD.debug
ALLOWED_HOSTS = MIRBAD.allowed_hosts

INSTALLED_APPS = [
    "console",  # first: its templates (registration/login.html) win over the admin's
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from here (no CDN)
    "channels",
    "nodes",
    "models_registry",
    "router",
    "backups",
]

# The largest form body read before the login is checked (the NUL guard reads it): per
# connection, so it bounds memory with MIRBAD_HTTP_MAX_CONNECTIONS. An uploaded backup is
# such a form; larger ones are restored with manage.py restore (docs/operator-guide.md).
DATA_UPLOAD_MAX_MEMORY_SIZE = 2_621_440

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "mirbad_site.nul_guard.RejectNulMiddleware",
    "mirbad_site.csp.ContentSecurityPolicyMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "nodes.audit.AuditContextMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
if MIRBAD.server_timing:  # first: it times every other middleware too
    MIDDLEWARE.insert(0, "mirbad_site.server_timing.ServerTimingMiddleware")

ROOT_URLCONF = "mirbad_site.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
ASGI_APPLICATION = "mirbad_site.asgi.application"

DATABASES = {"default": dj_database_url.parse(MIRBAD.database_url, conn_max_age=0)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes share the file: wait for the writer instead of failing.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
    # Tests use a file too: in-memory shared-cache SQLite fails concurrent writers at
    # once ("table is locked") instead of waiting, unlike the real file.
    DATABASES["default"]["TEST"] = {"NAME": str(MIRBAD.data_path / "test-db.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
SESSION_COOKIE_SECURE = MIRBAD.secure_cookies
CSRF_COOKIE_SECURE = MIRBAD.secure_cookies
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
# With MIRBAD_SECURE_COOKIES: HTTPS only, HSTS, /healthz exempt (mirbad_site/web_security.py).
SECURE_HSTS_SECONDS = WEB_SECURITY.hsts_seconds
SECURE_HSTS_INCLUDE_SUBDOMAINS = WEB_SECURITY.hsts_include_subdomains
SECURE_SSL_REDIRECT = WEB_SECURITY.ssl_redirect
SECURE_REDIRECT_EXEMPT = REDIRECT_EXEMPT
SECURE_PROXY_SSL_HEADER = WEB_SECURITY.proxy_ssl_header

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = MIRBAD.data_path / "static"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "mirbad_site.api_auth.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["mirbad_site.api_auth.IsOperator"],
    # DRF's JSON, encoded by orjson (core/api_renderers.py)
    "DEFAULT_RENDERER_CLASSES": ["core.api_renderers.FastJSONRenderer"],
    "DEFAULT_PARSER_CLASSES": [
        "core.api_parsers.JSONParser",  # 400, not 500, for deep nesting and surrogates
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "EXCEPTION_HANDLER": "core.api_errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

# /api/schema and /api/docs (mirbad_site/api_schema.py): the operators /api serves,
# the same authentication and permission (docs/decisions.md D41).
SPECTACULAR_SETTINGS = {
    "TITLE": "MirbadLLM operator API",
    "VERSION": "1",
    "DESCRIPTION": (
        "The master's /api: nodes, models, downloads, API keys and usage. A staff console "
        "login or an API key with the 'admin' scope (Authorization: Bearer). Every error is "
        '{"error": {"code", "message", ...}}. The OpenAI-compatible /v1 is not described '
        "here (docs/operator-guide.md)."
    ),
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["mirbad_site.api_auth.IsOperator"],
    "SCHEMA_PATH_PREFIX": "/api",
    "COMPONENT_SPLIT_REQUEST": True,
    # Bodies are JSON: the services judge JSON types (a form's "5" is not a number), so the
    # schema offers no form encodings (tests/e2e/test_api_fuzz.py).
    "PARSER_WHITELIST": ["core.api_parsers.JSONParser"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# redis-py 8 reads with a 5 s socket timeout by default, and channels_redis waits for a
# message with a blocking BZPOPMIN of 5 s: with nothing to receive, every receive()
# raised TimeoutError, which closed each idle console websocket and restarted the
# router's invalidation listener every few seconds (channels_redis issue 422). The read
# timeout must outlast the blocking wait (RedisChannelLayer.brpop_timeout); it still
# ends a read from a Redis that died.
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [
                {
                    "address": MIRBAD.redis_url,
                    "socket_timeout": 15,
                    "socket_connect_timeout": 5,
                }
            ],
            "prefix": "mirbad:asgi",
        },
    }
}

CELERY_BROKER_URL = (
    MIRBAD.redis_url.replace("unix://", "redis+socket://", 1)
    if MIRBAD.redis_url.startswith("unix://")
    else MIRBAD.redis_url
)
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_SERIALIZER = "json"
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE = {
    "renew-bootstrap-bundle": {
        "task": "nodes.tasks.renew_bootstrap_bundle",
        "schedule": 300.0,
    },
    "check-certificates": {
        "task": "nodes.tasks.check_certificates",
        "schedule": MIRBAD.cert_check_seconds,
    },
    "prune-audit-log": {
        "task": "nodes.tasks.prune_audit_log",
        "schedule": 3600.0,
    },
    "prune-usage-hours": {
        "task": "router.tasks.prune_usage_hours",
        "schedule": 3600.0,
    },
    "scheduled-backup": {
        "task": "backups.tasks.scheduled_backup",
        "schedule": MIRBAD.backup_check_seconds,
    },
    # Idle unload (docs/operator-guide.md, "Load on demand and idle unload").
    "unload-idle-models": {
        "task": "router.tasks.unload_idle_models",
        "schedule": 10.0,
        "options": {"expires": 10.0},  # a busy worker skips a pass, not piles them up
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": MIRBAD.log_level},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}
