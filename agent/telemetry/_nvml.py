"""GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``), each probe bounded.

A wedged driver can hang any NVML call, so every probe runs on one worker thread and
the caller waits at most ``timeout`` seconds. While a probe is still stuck, the next
one does not queue behind it: it answers at once that NVML is not answering (the node
is then Degraded ``gpu_probe_failing``), until the stuck call returns.

:func:`probe` answers ``(gpus, problem)`` like the nvidia-smi probe, or None when NVML
is not there at all (no library, no driver): the caller then falls back to
nvidia-smi, whose absence in turn means "no NVIDIA GPU", a fact and not a failure.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Any

log = logging.getLogger("mirbad.agent.nvml")


class _Call:
    """One probe on a daemon thread of its own: a thread stuck in the driver never holds
    up the agent's exit (a pool's workers are joined at exit)."""

    def __init__(self, nvml: ModuleType) -> None:
        self.done = threading.Event()
        self.result: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(nvml,), name="nvml", daemon=True)
        self._thread.start()

    def _run(self, nvml: ModuleType) -> None:
        try:
            self.result = _read(nvml)
        except BaseException as exc:  # handed to the waiting caller
            self.error = exc
        finally:
            self.done.set()


_lock = threading.Lock()
_stuck: _Call | None = None
_initialised = False


class NvmlAbsent(Exception):
    """No NVML here (the library or the driver is missing): not a failure."""


def _module() -> ModuleType:
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlAbsent(f"pynvml is not installed ({exc})") from None
    module: ModuleType = pynvml
    return module


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(call: Any, *args: Any) -> Any:
    """One reading a GPU may not support (MIG instances, some boards): None then."""
    try:
        return call(*args)
    except Exception:  # pynvml raises NVMLError subclasses per code; any of them means "no"
        return None


def _read(nvml: ModuleType) -> list[dict[str, Any]]:
    """Every GPU's figures, in NVML's index order (runs on the NVML thread)."""
    global _initialised
    if not _initialised:
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            absent = (
                getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", None),
                getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", None),
            )
            if getattr(exc, "value", None) in absent:
                raise NvmlAbsent(f"NVML: {exc}") from None
            raise
        _initialised = True
    driver = _text(_optional(nvml.nvmlSystemGetDriverVersion) or "")
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        gpu: dict[str, Any] = {
            "index": index,
            "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
            "name": _text(nvml.nvmlDeviceGetName(handle)),
            "memoryTotalBytes": int(memory.total),
            "memoryUsedBytes": int(memory.used),
            "memoryFreeBytes": int(memory.free),
            "driverVersion": driver,
            "source": "nvml",
        }
        rates = _optional(nvml.nvmlDeviceGetUtilizationRates, handle)
        if rates is not None:
            gpu["utilizationPercent"] = float(rates.gpu)
        temperature = _optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        if temperature is not None:
            gpu["temperatureC"] = float(temperature)
        milliwatts = _optional(nvml.nvmlDeviceGetPowerUsage, handle)
        if milliwatts is not None:
            gpu["powerWatts"] = round(milliwatts / 1000.0, 1)
        processes = _optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        if processes is not None:
            gpu["processes"] = [
                {"pid": int(p.pid), "memoryUsedBytes": p.usedGpuMemory}
                for p in processes
                # None where the driver does not report it (no permission, WDDM).
                if getattr(p, "usedGpuMemory", None) is not None
            ]
        gpus.append(gpu)
    return gpus


def probe(timeout: float = 5.0) -> tuple[list[dict[str, Any]], str | None] | None:
    """The GPUs and None, or [] and why NVML failed; None when NVML is absent here."""
    global _stuck
    try:
        nvml = _module()
    except NvmlAbsent:
        return None
    with _lock:
        if _stuck is not None and not _stuck.done.is_set():
            return [], f"NVML has not answered for over {timeout:g} s (a wedged driver?)"
        call = _Call(nvml)
        _stuck = call
    if not call.done.wait(timeout):
        log.warning("NVML did not answer within %s s; GPU probes fail until it does", timeout)
        return [], f"NVML did not answer within {timeout:g} s"
    if isinstance(call.error, NvmlAbsent):
        return None
    if call.error is not None:  # an NVMLError of any code, or a broken binding
        return [], f"NVML failed: {call.error}"
    return call.result, None
