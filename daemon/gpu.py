"""GPU probing behind one small interface: NVML (production), the fake GPU (demo, tests), none.

Backends are synchronous; the supervisor calls them off the event loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from gpuwarden.standin import fakegpu

from .gpustate import GpuInfo, GpuProcess, GpuSnapshot
from .server import reaper


class GpuBackend(Protocol):
    name: str
    blocking: bool  # True: call it off the event loop

    def snapshot(self) -> GpuSnapshot: ...

    def close(self) -> None: ...


class NoGpuBackend:
    """No GPU information: every launch proceeds at once."""

    name = "none"
    blocking = False

    def snapshot(self) -> GpuSnapshot:
        return GpuSnapshot()

    def close(self) -> None:
        pass


class FakeGpuBackend:
    """The fake GPU folder (`GPUWARDEN_FAKE_GPU_DIR`), read with the format module's rules."""

    name = "fake"
    blocking = False  # a few small local files

    def __init__(self, root: Path) -> None:
        self.root = root
        self._reader = fakegpu.FakeGpuReader(root)
        self._last = GpuSnapshot()

    def snapshot(self) -> GpuSnapshot:
        try:
            usage = self._reader.usage()
        except (fakegpu.FakeGpuError, OSError) as exc:
            self._last = GpuSnapshot(self._last.gpus, self._last.taken_at, str(exc))
            return self._last
        self._last = GpuSnapshot(
            tuple(
                GpuInfo(
                    index=g.index,
                    uuid=g.uuid,
                    used_mib=g.used_mib,
                    total_mib=g.total_mib,
                    utilization_pct=None,
                    name="Fake GPU",
                    processes=tuple(
                        GpuProcess(h.pid, h.name, h.mib, reaper.create_time_of(h.pid))
                        for h in g.holders
                    ),
                )
                for g in usage
            )
        )
        return self._last

    def close(self) -> None:
        pass


def render_gpu_table(gpus: list[dict[str, Any]]) -> str:
    """GPUs as /status shows them, as a fixed-width text table (the diagnostic dump's)."""
    lines = [f"{'GPU':>3}  {'used MiB':>9}  {'total MiB':>9}  {'util':>5}  holders"]
    for g in gpus:
        holders = ", ".join(
            f"{p['pid']} {p.get('name') or '?'} {p['used_mib']} MiB"
            + (" (ours)" if p.get("ours") else "")
            for p in g.get("processes") or []
        )
        util = g.get("utilization_pct")
        util_s = "-" if util is None else f"{util:.0f}%"
        row = f"{g['index']:>3}  {g['used_mib']:>9}  {g['total_mib']:>9}  {util_s:>5}"
        lines.append(f"{row}  {holders or '-'}")
    return "\n".join(lines)


def make_backend(kind: str, fake_dir: Path | None) -> GpuBackend:
    """`auto`: NVML when it initialises, else the fake GPU when its folder is set, else none."""
    if kind == "fake":
        if fake_dir is None:
            raise ValueError(f"gpu.backend is fake but {fakegpu.ENV_DIR} is not set")
        return FakeGpuBackend(fake_dir)
    if kind == "none":
        return NoGpuBackend()
    if kind in ("nvml", "auto"):
        try:
            from gpuwarden.daemon.nvml import NvmlBackend  # noqa: PLC0415

            return NvmlBackend()
        except Exception:
            if kind == "nvml":
                raise
    if fake_dir is not None:
        return FakeGpuBackend(fake_dir)
    return NoGpuBackend()
