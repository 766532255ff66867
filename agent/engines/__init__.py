"""Engines: launch specs and their checks, engine builds, and the runtimes that run them.

``process/`` is the native-process runtime (llama-server); ``container/`` the container
runtime beside it (vLLM, or llama-server in an image); ``_runtimes`` sends each launch to
the runtime of its delivery. What every runtime shares is here: ``_spec`` (launch specs,
the flag allow-list check, model path confinement), ``_executables`` (the engine
builds a node offers), ``_install`` (building llama-server), ``_measure`` (memory).
"""

from agent.engines._executables import Catalogue
from agent.engines._install import install_llama_server
from agent.engines._runtimes import Runtimes
from agent.engines._spec import (
    check_folder_name,
    check_relative_name,
    confined_path,
    resolve_model_path,
)
from agent.engines.container import ContainerRuntime, list_images, stop_recorded_containers
from agent.engines.process import (
    ProcessRuntime,
    cap_log,
    engine_log_path,
    stop_recorded_engines,
)

__all__ = [
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
]
