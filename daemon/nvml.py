"""The NVML backend (nvidia-ml-py, ``import pynvml``): what each GPU holds, from the driver.

Initialised once; every call happens in `snapshot()`, which the supervisor runs off the event
loop. An NVML error never raises out of `snapshot()`: the last good snapshot is returned with
the error attached (its `taken_at` tells its age).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from gpuwarden.daemon import logsetup
from gpuwarden.daemon.gpustate import GpuInfo, GpuProcess, GpuSnapshot
from gpuwarden.daemon.server import reaper

log = logsetup.get_logger("gpuwarden.nvml")


class NvmlBackend:
    name = "nvml"
    blocking = True

    def __init__(self, module: Any = None) -> None:
        if module is None:
            import pynvml  # noqa: PLC0415 - only GPU hosts need it

            module = pynvml
        self._nvml: Any = module
        module.nvmlInit()
        self._lock = threading.Lock()
        self._last = GpuSnapshot()
        self._closed = False

    def snapshot(self) -> GpuSnapshot:
        nv = self._nvml
        with self._lock:
            if self._closed:
                return self._last
            try:
                gpus = []
                for index in range(nv.nvmlDeviceGetCount()):
                    handle = nv.nvmlDeviceGetHandleByIndex(index)
                    mem = nv.nvmlDeviceGetMemoryInfo(handle)
                    try:
                        util: float | None = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
                    except nv.NVMLError:
                        util = None
                    procs = []
                    for p in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                        used = getattr(p, "usedGpuMemory", None)
                        procs.append(
                            GpuProcess(
                                pid=int(p.pid),
                                name=_process_name(int(p.pid)),
                                used_mib=int(used // (1024 * 1024)) if used else 0,
                                create_time=reaper.create_time_of(int(p.pid)),
                            )
                        )
                    uuid = nv.nvmlDeviceGetUUID(handle)
                    name = nv.nvmlDeviceGetName(handle)
                    gpus.append(
                        GpuInfo(
                            index=index,
                            uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                            used_mib=int(mem.used // (1024 * 1024)),
                            total_mib=int(mem.total // (1024 * 1024)),
                            utilization_pct=util,
                            processes=tuple(procs),
                            name=name.decode() if isinstance(name, bytes) else str(name),
                        )
                    )
                self._last = GpuSnapshot(tuple(gpus), time.monotonic())
            except nv.NVMLError as exc:
                # Keep the last good snapshot; its taken_at tells its age.
                self._last = GpuSnapshot(self._last.gpus, self._last.taken_at, f"NVML: {exc}")
                log.warning("gpu.nvml_error", error=str(exc))
            return self._last

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(self._nvml.NVMLError):
                    self._nvml.nvmlShutdown()


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
