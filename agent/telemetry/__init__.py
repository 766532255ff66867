"""What the agent reports about its machine: self-description (OS, CPU, memory, disks,
GPUs, engines), host telemetry and the node's health reasons."""

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
from agent.telemetry._host import HealthMonitor, Telemetry, host_facts

__all__ = [
    "GpuProbe",
    "GpuSampler",
    "HealthMonitor",
    "Telemetry",
    "describe",
    "disks",
    "docker_reachable",
    "group_rss",
    "host_facts",
    "memory",
    "memory_used_by_uuid",
    "probe_gpus",
]
