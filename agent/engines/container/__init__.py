"""The container runtime: engines as Docker containers (vLLM, or llama-server in an image).

Split by concern: ``_runtime`` (ContainerRuntime: launch, supervise, restart, stop,
adopt), ``_docker`` (the Docker API with a deadline on every call but pulls and
followed logs), ``_policy`` (the image policy and the mounts), ``_instance`` (one
instance's state), ``_records`` (``containers.json``), ``_adoption`` (after an agent
restart), ``_images`` (pulls), ``_leftovers`` (what a dead agent left).
"""

from agent.engines.container._images import list_images
from agent.engines.container._leftovers import stop_recorded_containers
from agent.engines.container._runtime import CONTAINER_OFFERS, ContainerRuntime

__all__ = ["CONTAINER_OFFERS", "ContainerRuntime", "list_images", "stop_recorded_containers"]
