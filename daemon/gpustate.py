"""What a GPU sample says: the GPUs, the processes holding their memory, and which of those
are ours. Plain data and pure functions; the backends that take samples are in `gpu.py`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

KnownOurs = Mapping[tuple[int, float], str]


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: int
    # When it started, read as it was sampled (None: gone, or of another pid namespace): a
    # holder is known as ours by pid and create time, without reading /proc again.
    create_time: float | None = None


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    used_mib: int
    total_mib: int
    utilization_pct: float | None = None
    processes: tuple[GpuProcess, ...] = ()
    name: str = ""  # its model, as NVML names it ("NVIDIA H100 80GB HBM3")


@dataclass(frozen=True)
class GpuSnapshot:
    gpus: tuple[GpuInfo, ...] = ()
    taken_at: float = field(default_factory=time.monotonic)
    error: str | None = None  # the last error, with the snapshot kept from before it


def select_gpus(snapshot: GpuSnapshot, wanted: list[str] | None) -> list[GpuInfo]:
    """The GPUs a config uses, by index or UUID; all of them when `wanted` is None."""
    if wanted is None:
        return list(snapshot.gpus)
    by_index = {str(g.index): g for g in snapshot.gpus}
    by_uuid = {g.uuid: g for g in snapshot.gpus}
    out = []
    for token in wanted:
        gpu = by_uuid.get(token) or by_index.get(token)
        if gpu is not None and gpu not in out:
            out.append(gpu)
    return out


def without(snapshot: GpuSnapshot, kept: frozenset[int]) -> GpuSnapshot:
    """The snapshot less the memory of the holders in `kept` (ours, kept on purpose)."""
    if not kept:
        return snapshot
    gpus = []
    for g in snapshot.gpus:
        held = sum(p.used_mib for p in g.processes if p.pid in kept)
        procs = tuple(p for p in g.processes if p.pid not in kept)
        gpus.append(replace(g, used_mib=max(0, g.used_mib - held), processes=procs))
    return replace(snapshot, gpus=tuple(gpus))


def busy_gpus(
    snapshot: GpuSnapshot, wanted: list[str] | None, busy_above_mib: int
) -> list[GpuInfo]:
    return [g for g in select_gpus(snapshot, wanted) if g.used_mib > busy_above_mib]


def describe_busy(gpus: list[GpuInfo]) -> str:
    parts = []
    for g in gpus:
        holders = ", ".join(f"pid {p.pid} ({p.name or '?'}, {p.used_mib} MiB)" for p in g.processes)
        parts.append(f"GPU {g.index}: {g.used_mib} MiB used by {holders or 'unknown processes'}")
    return "; ".join(parts)


def owner_of(proc: GpuProcess, known: KnownOurs, unresolved: bool) -> str | None:
    """The launch id a GPU holder belongs to, if it is ours (pid and create time). Where
    NVML's pids are of another namespace (`unresolved`), no holder is ours."""
    if unresolved or proc.create_time is None:
        return None
    for (kpid, kct), launch_id in known.items():
        if kpid == proc.pid and abs(kct - proc.create_time) < 0.05:
            return launch_id
    return None
