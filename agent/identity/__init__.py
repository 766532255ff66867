"""Who the agent is: its TLS identity (key, certificate, CA; the master-only client
check) and enrollment with a master (join tokens and the bootstrap bundle)."""

from agent.identity._enroll import bootstrap_enroll, join
from agent.identity._tls import (
    Identity,
    check_master_client_cert,
    ensure_state_directory,
    handshake_refusal,
    server_ssl_context,
)

__all__ = [
    "Identity",
    "bootstrap_enroll",
    "check_master_client_cert",
    "ensure_state_directory",
    "handshake_refusal",
    "join",
    "server_ssl_context",
]
