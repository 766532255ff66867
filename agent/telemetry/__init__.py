"""What the agent reports about its machine: self-description (OS, CPU, memory, disks,
GPUs, engines), host telemetry, the node's health reasons and the logs (agent, engines)."""

from agent.telemetry._describe import (
    GpuProbe,
    GpuSampler,
    describe,
    disks,
    docker_reachable,
    group_rss,
    memory,
    memory_used_by_uuid,
    probe_gpus,
)
from agent.telemetry._engines import EngineTarget
from agent.telemetry._host import HealthMonitor, Telemetry, host_facts
from agent.telemetry._logs import LogBook, install_agent_log

__all__ = [
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
]
