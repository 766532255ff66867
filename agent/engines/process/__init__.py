"""The native-process runtime: engines as supervised child processes.

Split by concern: ``_runtime`` (ProcessRuntime: start, supervise, restart, stop),
``_gpus`` (the GPU start queue and memory measurement), ``_instance`` (one instance's
state), ``_records`` (``processes.json``, written atomically), ``_adoption`` and
``_reconcile`` (engines across agent restarts), ``_leftovers`` (what a dead agent left),
``_handle`` (the process handle, logs and ports).
"""

from agent.engines.process._handle import cap_log, engine_log_path
from agent.engines.process._leftovers import stop_recorded_engines
from agent.engines.process._runtime import ProcessRuntime

__all__ = ["ProcessRuntime", "cap_log", "engine_log_path", "stop_recorded_engines"]
