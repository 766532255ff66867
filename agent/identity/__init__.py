"""Who the agent is: its TLS identity (key, certificate, CA; the master-only client
check), enrollment with a master (join tokens and the bootstrap bundle) and the
agent's half of a certificate rotation (``RotationStore``)."""

from agent.identity._enroll import bootstrap_enroll, join
from agent.identity._rotation import RotationStore, check_rotation_id
from agent.identity._tls import (
    Identity,
    ServerContext,
    check_master_client_cert,
    ensure_state_directory,
    handshake_refusal,
    load_identity,
    presented_spki,
    server_ssl_context,
)

__all__ = [
    "Identity",
    "RotationStore",
    "ServerContext",
    "bootstrap_enroll",
    "check_master_client_cert",
    "check_rotation_id",
    "ensure_state_directory",
    "handshake_refusal",
    "join",
    "load_identity",
    "presented_spki",
    "server_ssl_context",
]
