"""The master's configuration, read once from ``MIRBAD_*`` variables.

``settings.py``, the launcher (``./mirbad up``) and the management commands
all build their view of the deployment from :func:`load_master_config`, so a
value means the same thing in every process and is validated in one place.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from core.envconf import (
    SettingError,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_path,
    env_port,
    env_secret,
    env_str,
    env_url,
)
from protocol.http_limits import HttpLimits
from protocol.names import NODE_ID_RE

# The shortest passphrase that may seal a backup's secrets (backups/crypto.py reads it).
MIN_BACKUP_PASSPHRASE = 12


@dataclass(frozen=True, kw_only=True)
class MasterConfig:
    data_path: Path
    bind: str
    port: int
    enroll_port: int
    agent_port: int
    database_url: str
    redis_url: str
    redis_embedded: bool
    # Seconds a node-status read waits for Redis before serving the last known status.
    redis_status_timeout: float = 0.5
    # Seconds the router waits for the next byte from an agent before answering 504 or
    # cutting the stream (docs/decisions.md D42): past the agent's own engine timeout.
    upstream_read_timeout: float = 1260.0
    debug: bool
    allowed_hosts: list[str]
    secure_cookies: bool
    # Server-Timing on every answer: the view's wall and CPU time (bench/fleet.py reads
    # it). Off by default: it tells a caller how long the server worked.
    server_timing: bool = False
    bootstrap_node_id: str
    bootstrap_agent_address: str
    enroll_endpoint: str
    enroll_addresses: list[str]
    bootstrap_token_hours: int
    join_token_minutes: int
    bootstrap_directory: Path
    log_level: str
    # Each process ``./mirbad up`` starts logs to <data>/logs/<name>.log, copy-truncated
    # past log_max_bytes with log_files rotated copies kept (protocol/logcap.py).
    log_max_bytes: int = 64 * 1024 * 1024
    log_files: int = 3
    # The limits of the web port and of the enroll listener, each its own (the agent's
    # HttpLimits defaults; docs/operator-guide.md, "Limits").
    http_max_head_bytes: int = HttpLimits.max_head_bytes
    http_max_headers: int = HttpLimits.max_headers
    http_head_timeout_seconds: float = HttpLimits.head_timeout_seconds
    http_body_idle_timeout_seconds: float = HttpLimits.body_idle_timeout_seconds
    http_max_connections: int = HttpLimits.max_connections
    # Certificate lifetimes (docs/operator-guide.md, "Certificates"): the nodes' (signed
    # at enrollment) and the master's own client and enroll certificates, re-issued at
    # half life by every running process that checks them every pki_check_seconds.
    node_cert_seconds: int = 90 * 86400
    master_cert_seconds: int = 30 * 86400
    pki_check_seconds: float = 60.0
    # Node certificate renewal (nodes/rotation.py): due this long before expiry, spread
    # over a jitter window; the router and the monitor get the pending pin this long
    # before the agent presents it; Celery beat looks for due and open rotations this
    # often.
    cert_renew_before_seconds: int = 30 * 86400
    cert_renew_jitter_seconds: int = 6 * 3600
    rotation_pin_grace_seconds: float = 12.0
    # One driver per rotation: a pass holds this lease, renewed before each step, so a
    # pass killed mid-way holds the rotation no longer than this.
    rotation_lease_seconds: float = 60.0
    cert_check_seconds: float = 3600.0
    cert_expiring_seconds: int = 14 * 86400  # Degraded certificate_expiring from then on
    # Scheduled backups (backups/): once a day at this local time into the directory,
    # the newest ``backup_keep`` kept; sealed secrets only with a passphrase. Beat asks
    # every ``backup_check_seconds`` whether the day's backup is due.
    backup_daily_at: str = "03:00"
    backup_directory: Path = Path("./var/backups")
    backup_keep: int = 14
    backup_passphrase: str | None = field(default=None, repr=False)
    backup_include_ca: bool = True
    backup_check_seconds: float = 60.0
    # The audit log (nodes/audit.py) keeps events this many days; beat prunes it daily.
    audit_keep_days: int = 365
    # The fair queue (router/queue.py): requests waiting for a free slot per served
    # name, at most ``queue_max`` of them, each at most ``queue_timeout`` seconds;
    # a model or a key may set its own (docs/operator-guide.md, "Serving").
    queue_enabled: bool = True  # off: no slots counted, least-in-flight as before
    queue_max: int = 512
    queue_timeout: float = 60.0
    # Usage rows per hour are kept this many days; the day and month rollups stay
    # (router/usage.py, docs/operator-guide.md, "Budgets").
    usage_hourly_keep_days: int = 400
    # The key that seals the master's private keys in the database (nodes/master_store.py,
    # D80): the same value on every master host. None: ``DATA_PATH/master.key``, made
    # once by the first start of a single-host master.
    master_key: str | None = field(default=None, repr=False)

    @property
    def http_limits(self) -> HttpLimits:
        """The listener limits as the shared rules take them."""
        return HttpLimits(
            max_head_bytes=self.http_max_head_bytes,
            max_headers=self.http_max_headers,
            head_timeout_seconds=self.http_head_timeout_seconds,
            body_idle_timeout_seconds=self.http_body_idle_timeout_seconds,
            max_connections=self.http_max_connections,
        )

    @property
    def pki_dir(self) -> Path:
        return self.data_path / "pki"

    @property
    def bootstrap_dir(self) -> Path:
        return self.bootstrap_directory

    @property
    def run_dir(self) -> Path:
        return self.data_path / "run"

    @property
    def console_url(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::") else self.bind
        return f"http://{host}:{self.port}/"


def embedded_redis_socket(data_path: Path) -> Path:
    """Where the embedded Redis listens; short enough for a unix socket path."""
    candidate = data_path / "run" / "redis.sock"
    if len(str(candidate)) < 100:
        return candidate
    # sun_path is 108 bytes on Linux; fall back to a stable name under /tmp.
    import hashlib

    digest = hashlib.sha256(str(data_path).encode()).hexdigest()[:16]
    return Path("/tmp") / f"mirbad-{digest}.sock"  # noqa: S108 - private name, 0700 parent not needed


def load_master_config(env: Mapping[str, str] | None = None) -> MasterConfig:
    """Parse every ``MIRBAD_*`` setting; raises :class:`SettingError` naming the variable."""
    data_path = env_path("MIRBAD_DATA_PATH", "./var", env=env)
    port = env_port("MIRBAD_PORT", 8080, env=env)
    enroll_port = env_port("MIRBAD_ENROLL_PORT", 8443, env=env)
    agent_port = env_port("MIRBAD_AGENT_PORT", 9443, env=env)
    bind = env_str("MIRBAD_BIND", "127.0.0.1", env=env)
    default_db = f"sqlite:///{data_path / 'db.sqlite3'}"
    database_url = env_url(
        "MIRBAD_DATABASE_URL", default_db, schemes=("sqlite", "postgres", "postgresql"), env=env
    )
    redis_env = env_url("MIRBAD_REDIS_URL", None, schemes=("redis", "rediss", "unix"), env=env)
    redis_embedded = redis_env is None
    redis_url = redis_env or f"unix://{embedded_redis_socket(data_path)}"
    node_id = env_str("MIRBAD_BOOTSTRAP_NODE_ID", "local", env=env)
    if not NODE_ID_RE.fullmatch(node_id):
        raise SettingError(
            f"MIRBAD_BOOTSTRAP_NODE_ID: {node_id!r} is not a valid node id; use lower-case "
            "letters, digits and '-', starting with a letter or digit, at most 40 characters."
        )
    agent_address = env_url(
        "MIRBAD_BOOTSTRAP_AGENT_ADDRESS",
        f"https://127.0.0.1:{agent_port}",
        schemes=("https",),
        env=env,
    )
    enroll_endpoint = env_url(
        "MIRBAD_ENROLL_ENDPOINT", f"https://127.0.0.1:{enroll_port}", schemes=("https",), env=env
    )
    level = env_str("MIRBAD_LOG_LEVEL", "INFO", env=env).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise SettingError(f"MIRBAD_LOG_LEVEL: {level!r}; use DEBUG, INFO, WARNING or ERROR.")
    assert database_url is not None and agent_address is not None and enroll_endpoint is not None
    config = MasterConfig(
        data_path=data_path,
        bind=bind,
        port=port,
        enroll_port=enroll_port,
        agent_port=agent_port,
        database_url=database_url,
        redis_url=redis_url,
        redis_embedded=redis_embedded,
        redis_status_timeout=env_float("MIRBAD_REDIS_STATUS_TIMEOUT", 0.5, minimum=0.05, env=env),
        upstream_read_timeout=env_float(
            "MIRBAD_UPSTREAM_READ_TIMEOUT", 1260.0, minimum=0.1, env=env
        ),
        debug=env_bool("MIRBAD_DEBUG", False, env=env),
        allowed_hosts=env_list("MIRBAD_ALLOWED_HOSTS", ["127.0.0.1", "localhost"], env=env),
        secure_cookies=env_bool("MIRBAD_SECURE_COOKIES", False, env=env),
        server_timing=env_bool("MIRBAD_SERVER_TIMING", False, env=env),
        bootstrap_node_id=node_id,
        bootstrap_agent_address=agent_address,
        enroll_endpoint=enroll_endpoint,
        enroll_addresses=env_list("MIRBAD_ENROLL_ADDRESSES", ["127.0.0.1", "localhost"], env=env),
        bootstrap_token_hours=env_int(
            "MIRBAD_BOOTSTRAP_TOKEN_HOURS", 24, minimum=1, maximum=24 * 30, env=env
        ),
        join_token_minutes=env_int(
            "MIRBAD_JOIN_TOKEN_MINUTES", 60, minimum=1, maximum=7 * 24 * 60, env=env
        ),
        bootstrap_directory=env_path(
            "MIRBAD_BOOTSTRAP_DIRECTORY", str(data_path / "bootstrap"), env=env
        ),
        log_level=level,
        log_max_bytes=env_int(
            "MIRBAD_LOG_MAX_BYTES", 64 * 1024 * 1024, minimum=64 * 1024, maximum=2**40, env=env
        ),
        log_files=env_int("MIRBAD_LOG_FILES", 3, minimum=0, maximum=100, env=env),
        http_max_head_bytes=env_int(
            "MIRBAD_HTTP_MAX_HEAD_BYTES",
            HttpLimits.max_head_bytes,
            minimum=1024,
            maximum=16 * 1024 * 1024,
            env=env,
        ),
        http_max_headers=env_int(
            "MIRBAD_HTTP_MAX_HEADERS", HttpLimits.max_headers, minimum=8, maximum=10_000, env=env
        ),
        http_head_timeout_seconds=env_float(
            "MIRBAD_HTTP_HEAD_TIMEOUT_SECONDS",
            HttpLimits.head_timeout_seconds,
            minimum=0.1,
            env=env,
        ),
        http_body_idle_timeout_seconds=env_float(
            "MIRBAD_HTTP_BODY_IDLE_TIMEOUT_SECONDS",
            HttpLimits.body_idle_timeout_seconds,
            minimum=0.1,
            env=env,
        ),
        http_max_connections=env_int(
            "MIRBAD_HTTP_MAX_CONNECTIONS",
            HttpLimits.max_connections,
            minimum=1,
            maximum=1_000_000,
            env=env,
        ),
        # Seconds, not days, so a test can run through several lifetimes in a minute.
        node_cert_seconds=env_int(
            "MIRBAD_NODE_CERT_SECONDS", 90 * 86400, minimum=60, maximum=825 * 86400, env=env
        ),
        master_cert_seconds=env_int(
            "MIRBAD_MASTER_CERT_SECONDS", 30 * 86400, minimum=10, maximum=825 * 86400, env=env
        ),
        pki_check_seconds=env_float("MIRBAD_PKI_CHECK_SECONDS", 60.0, minimum=0.1, env=env),
        cert_renew_before_seconds=env_int(
            "MIRBAD_CERT_RENEW_BEFORE_SECONDS", 30 * 86400, minimum=10, env=env
        ),
        cert_renew_jitter_seconds=env_int(
            "MIRBAD_CERT_RENEW_JITTER_SECONDS", 6 * 3600, minimum=0, env=env
        ),
        rotation_pin_grace_seconds=env_float(
            "MIRBAD_ROTATION_PIN_GRACE_SECONDS", 12.0, minimum=0.0, env=env
        ),
        rotation_lease_seconds=env_float(
            "MIRBAD_ROTATION_LEASE_SECONDS", 60.0, minimum=40.0, env=env
        ),
        cert_check_seconds=env_float("MIRBAD_CERT_CHECK_SECONDS", 3600.0, minimum=1.0, env=env),
        cert_expiring_seconds=env_int(
            "MIRBAD_CERT_EXPIRING_SECONDS", 14 * 86400, minimum=0, env=env
        ),
        backup_daily_at=env_str("MIRBAD_BACKUP_DAILY_AT", "03:00", env=env),
        backup_directory=env_path("MIRBAD_BACKUP_DIRECTORY", str(data_path / "backups"), env=env),
        backup_keep=env_int("MIRBAD_BACKUP_KEEP", 14, minimum=1, maximum=10_000, env=env),
        backup_passphrase=env_secret("MIRBAD_BACKUP_PASSPHRASE", env=env),
        backup_include_ca=env_bool("MIRBAD_BACKUP_INCLUDE_CA", True, env=env),
        backup_check_seconds=env_float("MIRBAD_BACKUP_CHECK_SECONDS", 60.0, minimum=1.0, env=env),
        audit_keep_days=env_int("MIRBAD_AUDIT_KEEP_DAYS", 365, minimum=1, maximum=36_500, env=env),
        queue_enabled=env_bool("MIRBAD_QUEUE", True, env=env),
        queue_max=env_int("MIRBAD_QUEUE_MAX", 512, minimum=0, maximum=1_000_000, env=env),
        queue_timeout=env_float("MIRBAD_QUEUE_TIMEOUT", 60.0, minimum=0.1, env=env),
        usage_hourly_keep_days=env_int(
            "MIRBAD_USAGE_HOURLY_KEEP_DAYS", 400, minimum=32, maximum=36_500, env=env
        ),
        master_key=env_secret("MIRBAD_MASTER_KEY", env=env),
    )
    if config.master_key is not None and len(config.master_key) < 32:
        raise SettingError(
            "MIRBAD_MASTER_KEY: use at least 32 characters (e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)."
        )
    daily_at = config.backup_daily_at
    if not re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", daily_at):
        raise SettingError(
            f"MIRBAD_BACKUP_DAILY_AT: {daily_at!r} is not a time of day; use HH:MM, 24-hour, "
            "e.g. 03:00."
        )
    if (
        config.backup_passphrase is not None
        and len(config.backup_passphrase) < MIN_BACKUP_PASSPHRASE
    ):
        raise SettingError(
            f"MIRBAD_BACKUP_PASSPHRASE: shorter than {MIN_BACKUP_PASSPHRASE} characters; use a longer passphrase "
            "(or unset it: scheduled backups then carry no secrets)."
        )
    if config.cert_renew_before_seconds >= config.node_cert_seconds:
        raise SettingError(
            f"MIRBAD_CERT_RENEW_BEFORE_SECONDS: {config.cert_renew_before_seconds} is not "
            f"shorter than MIRBAD_NODE_CERT_SECONDS ({config.node_cert_seconds}); a node "
            "would renew the moment it enrolls."
        )
    return config


def load_secret_key(data_path: Path, env: Mapping[str, str] | None = None) -> str:
    """``MIRBAD_SECRET_KEY`` (or ``_FILE``), else one generated once into the data directory."""
    configured = env_secret("MIRBAD_SECRET_KEY", env=env)
    if configured is not None:
        if len(configured) < 32:
            raise SettingError("MIRBAD_SECRET_KEY: use at least 32 characters.")
        return configured
    path = data_path / "secret_key"
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        pass
    from protocol.atomic import write_atomic

    data_path.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_urlsafe(48)
    try:
        write_atomic(path, key.encode(), mode=0o600, exclusive=True, parents=True)
    except FileExistsError:
        return path.read_text(encoding="utf-8").strip()
    return key


def env_for_children(config: MasterConfig) -> dict[str, str]:
    """The environment the launcher hands to every master process it starts."""
    env = dict(os.environ)
    env["MIRBAD_DATA_PATH"] = str(config.data_path)
    env["MIRBAD_REDIS_URL"] = config.redis_url
    env["MIRBAD_DATABASE_URL"] = config.database_url
    return env
