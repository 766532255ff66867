"""MirbadLLM node agent.

Runs on every node, serves the mTLS API of docs/agent-api.md to the master, and starts,
supervises and proxies to local engines. It must not import Django or anything of the
master: it runs on machines that have Python and nothing else of the project. What the
master and the agent must read alike (the wire client, error codes and header, fencing
triple, identities, names, listener limits, the engine flag allow-lists) lives in the
``protocol`` package, which the agent imports and this package does not re-export.

Public surface (everything else lives in private modules and may change)::

    AgentConfig, ExecutableEntry, load_config     configuration
    AgentServer, run_agent, serve                 running the agent
    join, bootstrap_enroll                        enrollment
    install_llama_server                          building the engine
    stop_recorded_engines                         stop what a dead agent left running
    AgentError and its subclasses                 errors (the tree is drawn in agent._errors)
    __version__, PROTOCOL_VERSIONS
"""

from agent._config import AgentConfig, ExecutableEntry, load_config
from agent._errors import (
    AgentError,
    ApiError,
    ClientNotMaster,
    ConfigError,
    Conflict,
    EnrollmentError,
    EnrollmentRefused,
    ExecutableUnverified,
    IdentityError,
    InstallError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotRunning,
    NotFound,
    ServerBusy,
    SpecRejected,
    StateUnavailable,
    TokenRefused,
    UntrustedEnrollEndpoint,
    UpstreamUnavailable,
)
from agent._run import run_agent, serve
from agent._version import PROTOCOL_VERSIONS, __version__
from agent.engines import install_llama_server, stop_recorded_engines
from agent.http import AgentServer
from agent.identity import bootstrap_enroll, join

__all__ = [
    "PROTOCOL_VERSIONS",
    "AgentConfig",
    "AgentError",
    "AgentServer",
    "ApiError",
    "ClientNotMaster",
    "ConfigError",
    "Conflict",
    "EnrollmentError",
    "EnrollmentRefused",
    "ExecutableEntry",
    "ExecutableUnverified",
    "IdentityError",
    "InstallError",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotRunning",
    "NotFound",
    "ServerBusy",
    "SpecRejected",
    "StateUnavailable",
    "TokenRefused",
    "UntrustedEnrollEndpoint",
    "UpstreamUnavailable",
    "__version__",
    "bootstrap_enroll",
    "install_llama_server",
    "join",
    "load_config",
    "run_agent",
    "serve",
    "stop_recorded_engines",
]
