"""The agent's public surface and each room's face, pinned.

A name added to or dropped from a face is a change of what other rooms (or, for the
package itself, other programs) may rely on: it must show up here, on purpose.
"""

from __future__ import annotations

import importlib

import pytest

FACES: dict[str, set[str]] = {
    "agent": {
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
    },
    "agent.http": {"AgentServer"},
    "agent.engines": {
        "Catalogue",
        "ContainerRuntime",
        "ProcessRuntime",
        "Runtimes",
        "cap_log",
        "check_folder_name",
        "check_relative_name",
        "confined_path",
        "engine_log_path",
        "install_llama_server",
        "list_images",
        "resolve_model_path",
        "stop_recorded_containers",
        "stop_recorded_engines",
    },
    "agent.engines.process": {
        "ProcessRuntime",
        "cap_log",
        "engine_log_path",
        "stop_recorded_engines",
    },
    "agent.engines.container": {
        "CONTAINER_OFFERS",
        "ContainerRuntime",
        "list_images",
        "stop_recorded_containers",
    },
    "agent.weights": {"DownloadManager", "Weights", "is_model_file", "read_summary"},
    "agent.identity": {
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
    },
    "agent.state": {"OPERATION_HEADER", "EventBus", "Fencing", "OperationLog", "describe_request"},
    "agent.telemetry": {
        "EngineTarget",
        "GpuProbe",
        "GpuSampler",
        "HealthMonitor",
        "LogBook",
        "Telemetry",
        "describe",
        "disks",
        "docker_reachable",
        "group_rss",
        "host_facts",
        "install_agent_log",
        "memory",
        "memory_used_by_uuid",
        "probe_gpus",
    },
}


@pytest.mark.parametrize("module", sorted(FACES))
def test_face_is_pinned_and_every_name_exists(module: str) -> None:
    face = importlib.import_module(module)
    assert set(face.__all__) == FACES[module]
    missing = [name for name in face.__all__ if not hasattr(face, name)]
    assert not missing, f"{module}.__all__ names what it does not define: {missing}"


def test_the_package_does_not_re_export_the_protocol() -> None:
    """The contract both sides share is imported from protocol, not through the agent."""
    import agent

    for name in ("WirePool", "ERROR_HEADER", "HttpLimits", "check_extra_args", "write_tiny_gguf"):
        assert not hasattr(agent, name), f"agent re-exports {name}; import it from protocol"
