"""MirbadLLM node agent.

Runs on every node, serves the mTLS API of docs/agent-api.md to the master, and starts,
supervises and proxies to local engines. It must not import Django or anything of the
master: it runs on machines that have Python and nothing else of the project.

Public surface (everything else lives in private modules and may change)::

    AgentConfig, ExecutableEntry, load_config     configuration
    AgentServer, run_agent, serve                 running the agent
    join, bootstrap_enroll                        enrollment
    install_llama_server                          building the engine
    write_tiny_gguf                               a tiny model for demos and tests
    stop_recorded_engines                         stop what a dead agent left running
    WirePool, WireResponse                        the proxy hops' lean HTTP/1.1 client
    check_extra_args, check_engine_argv, ...      engine flag allow-lists (also the master's)
    HttpLimits, HeadGuard, GuardedProtocol, ...   listener limits (also the master's)
    AgentError, WireError and their subclasses    errors (see agent._errors)
    __version__, PROTOCOL_VERSIONS
"""

from agent._config import AgentConfig, ExecutableEntry, load_config
from agent._engine_flags import (
    LOOPBACK,
    MODEL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    FlagRefused,
    check_chat_template,
    check_engine_argv,
    check_extra_args,
    engine_flags,
)
from agent._enroll import bootstrap_enroll, join
from agent._errors import (
    ERROR_HEADER,
    AgentError,
    ApiError,
    BadResponse,
    ClientNotMaster,
    ConfigError,
    Conflict,
    ConnectFailed,
    Disconnected,
    EnrollmentError,
    EnrollmentRefused,
    ExecutableUnverified,
    IdentityError,
    InstallError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotRunning,
    NotFound,
    ReadTimeout,
    ServerBusy,
    SpecRejected,
    StateUnavailable,
    TokenRefused,
    UntrustedEnrollEndpoint,
    UpstreamUnavailable,
    WireError,
)
from agent._http_limits import (
    ConnectionGate,
    GuardedProtocol,
    HeadGuard,
    HttpLimits,
    Refused,
    aiohttp_handler_limits,
    answer_and_close,
    refusal,
)
from agent._install import install_llama_server
from agent._leftovers import stop_recorded_engines
from agent._run import run_agent, serve
from agent._server import AgentServer
from agent._tinygguf import write_tiny_gguf
from agent._version import PROTOCOL_VERSIONS, __version__
from agent._wire import WirePool, WireResponse

__all__ = [
    "ERROR_HEADER",
    "LOOPBACK",
    "MODEL_PLACEHOLDER",
    "PORT_PLACEHOLDER",
    "PROTOCOL_VERSIONS",
    "AgentConfig",
    "AgentError",
    "AgentServer",
    "ApiError",
    "BadResponse",
    "ClientNotMaster",
    "ConfigError",
    "Conflict",
    "ConnectFailed",
    "ConnectionGate",
    "Disconnected",
    "EnrollmentError",
    "EnrollmentRefused",
    "ExecutableEntry",
    "ExecutableUnverified",
    "FlagRefused",
    "GuardedProtocol",
    "HeadGuard",
    "HttpLimits",
    "IdentityError",
    "InstallError",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotRunning",
    "NotFound",
    "ReadTimeout",
    "Refused",
    "ServerBusy",
    "SpecRejected",
    "StateUnavailable",
    "TokenRefused",
    "UntrustedEnrollEndpoint",
    "UpstreamUnavailable",
    "WireError",
    "WirePool",
    "WireResponse",
    "__version__",
    "aiohttp_handler_limits",
    "answer_and_close",
    "bootstrap_enroll",
    "check_chat_template",
    "check_engine_argv",
    "check_extra_args",
    "engine_flags",
    "install_llama_server",
    "join",
    "load_config",
    "refusal",
    "run_agent",
    "serve",
    "stop_recorded_engines",
    "write_tiny_gguf",
]
