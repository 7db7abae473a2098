"""Which processes are ours: a launch's tree, the orphans of earlier launches that hold GPU
memory (by pid and create time, remembered across daemon lives), and the killing of those.

Foreign holders of a GPU are never ours and never killed. Everything here reads /proc: it runs
in the host's tasks or threads, never inside the machine.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil

from .gpustate import GpuInfo, KnownOurs, owner_of
from .server import reaper


def launch_tree(main_pid: int) -> frozenset[tuple[int, float]]:
    """(pid, create_time) of a launch's main process, its descendants, and the orphans that
    reparented to this daemon (a subreaper runs one server at a time, so they are its)."""
    out: set[tuple[int, float]] = set()
    roots = [main_pid]
    helpers = reaper.helper_pids()
    with contextlib.suppress(psutil.Error):
        me = psutil.Process()
        roots += [c.pid for c in me.children() if c.pid != main_pid and c.pid not in helpers]
    for root in roots:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(root)
            out.add((proc.pid, proc.create_time()))
            for c in proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    out.add((c.pid, c.create_time()))
    return frozenset(out)


def unresolved_pids(gpus: tuple[GpuInfo, ...] | list[GpuInfo]) -> tuple[int, ...]:
    """Holders' pids that do not exist here (NVML reporting another pid namespace)."""
    return tuple(p.pid for g in gpus for p in g.processes if not psutil.pid_exists(p.pid))


async def kill_gpu_orphans(
    gpus: list[GpuInfo], running: int | None, known: KnownOurs, unresolved: bool
) -> list[dict[str, Any]]:
    """Kill the GPU holders that are ours but not the running server (`running`): an earlier
    launch's orphans. Returns what was killed, for the record."""
    targets = []
    for g in gpus:
        for p in g.processes:
            if p.pid == running:
                continue
            launch_id = owner_of(p, known, unresolved)
            if launch_id is not None and p.create_time is not None:
                leftover = reaper.Leftover(p.pid, p.create_time, p.name, "")
                targets.append((leftover, g.index, p.used_mib, launch_id))
    if not targets:
        return []
    killed = await reaper.kill_leftovers([t[0] for t in targets])
    return [
        {"pid": t[0].pid, "name": t[0].name, "gpu": t[1], "used_mib": t[2], "launch_id": t[3]}
        for t in targets
        if t[0] in killed
    ]
