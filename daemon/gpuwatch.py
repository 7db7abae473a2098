"""The host's GPU side: the wait for a launch's GPUs to be free (killing orphans of ours that
hold them, never a foreign holder), and the once-a-second sample of every GPU and the running
launch's process tree that the machine attributes and watches ranks with. Which holders are
ours comes with the machine's calls (its own mapping, read on the loop when a kill is
decided); the sample, which runs on its own, asks `sample_target` what it is of.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from gpuwarden.daemon import logsetup

from . import ownership
from .gpu import GpuBackend
from .gpustate import GpuSnapshot, busy_gpus, describe_busy, select_gpus, without
from .messages import EventNoted, GpuSampled, GpuWaitEnded, Message, OrphansKilled
from .settings import GpuSettings
from .tasks import Tasks

if TYPE_CHECKING:
    from .gpustate import KnownOurs
    from .model import Launch

log = logsetup.get_logger("gpuwarden.supervisor")
GPU_POLL_S = 1.0


class SampleTarget(NamedTuple):
    """What the once-a-second sample is of, as the machine last said."""

    gen: int  # the machine's launch, whose tag the sample carries
    pid: int | None  # its server's main process, while it runs
    watching_ranks: bool  # its ranks are watched: its tree is walked at every sample
    unresolved_noted: bool  # holders' pids from another namespace were noted already
    waiting: bool  # the GPU wait samples faster on its own: no sample now


class GpuWatch:
    def __init__(
        self,
        *,
        settings: GpuSettings,
        gpu: GpuBackend,
        tasks: Tasks,
        post: Callable[[Message], None],
        sample_target: Callable[[], SampleTarget],
        sweep_deadline_s: float,
    ) -> None:
        self.settings, self.gpu, self.tasks, self.post = settings, gpu, tasks, post
        self.sample_target = sample_target
        self.clock = tasks.clock
        self.sweep_deadline_s = sweep_deadline_s  # a sweep's orphan kills, within the wait's
        self._gpu_task: asyncio.Task[Any] | None = None
        self.latest: GpuSnapshot | None = None  # the last sample taken here
        # Holders kept on purpose (the weight cache's sidecar): never killed, never waited for.
        self.kept: Callable[[], frozenset[int]] = frozenset

    def wait_for_gpus(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        """Post `GpuWaitEnded` once the launch's GPUs are free, killing the holders among them
        that are ours (`known_ours`; `unresolved`: NVML's pids are of another namespace)."""
        snap = self.gpu_snapshot_now()
        if snap is not None and not busy_gpus(
            without(snap, self.kept()), launch.config.gpus, self.settings.busy_above_mib
        ):
            # Free at the first look, with a backend that answers at once: no wait to run.
            self._gpu_task = None
            self.post(GpuSampled(launch.gen, snap, frozenset()))
            self.post(GpuWaitEnded(launch.gen, True))
            return
        deadline = self.settings.release_timeout_s + self.sweep_deadline_s
        self._gpu_task = self.tasks.task(
            self._wait_for_gpus(launch, known_ours, unresolved), gen=launch.gen, deadline_s=deadline
        )

    def waiting(self, task: asyncio.Task[Any]) -> None:
        """`task` leads to the GPU wait (it is cancelled as the wait would be)."""
        self._gpu_task = task

    def cancel_gpu_wait(self) -> None:
        if self._gpu_task is not None:
            self._gpu_task.cancel()
            self._gpu_task = None

    async def _wait_for_gpus(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        busy = await self.gpus_free(launch, known_ours, unresolved)
        self.post(GpuWaitEnded(launch.gen, busy is None, busy or ""))

    async def gpus_free(
        self, launch: Launch, known_ours: KnownOurs, unresolved: bool
    ) -> str | None:
        """Until `launch`'s GPUs are free (None), killing orphans of ours that hold them, or
        `release_timeout_s` has passed (what still holds them)."""
        cfg = self.settings
        deadline = self.clock.monotonic() + cfg.release_timeout_s
        announced = False
        while True:
            snap = await self.gpu_snapshot()
            self.post(GpuSampled(launch.gen, snap, frozenset()))
            busy = busy_gpus(without(snap, self.kept()), launch.config.gpus, cfg.busy_above_mib)
            if not busy:
                return None
            running = launch.child.pid if launch.running and launch.child is not None else None
            await self.kill_gpu_orphans(busy, running, known_ours, unresolved)
            if not announced:
                announced = True
                self.post(EventNoted("gpu_wait", {"detail": describe_busy(busy)}))
            if self.clock.monotonic() >= deadline:
                return describe_busy(busy)
            await self.clock.sleep(cfg.poll_interval_s)

    async def kill_gpu_orphans(
        self, gpus: list[Any], running: int | None, known_ours: KnownOurs, unresolved: bool
    ) -> list[dict[str, Any]]:
        """Kill the holders on `gpus` that are ours (`known_ours`) but not the running server's
        main process (`running`), and post what was killed."""
        kept = self.kept()
        gpus = [
            replace(g, processes=tuple(p for p in g.processes if p.pid not in kept)) for g in gpus
        ]
        if not any(g.processes for g in gpus):
            return []  # the common case after an exit
        killed = await ownership.kill_gpu_orphans(gpus, running, known_ours, unresolved)
        if killed:
            self.post(OrphansKilled(killed))
        return killed

    @property
    def gpus_answer_at_once(self) -> bool:
        """The backend's calls return at once (not NVML's, which can block on a wedged driver
        and so go to a thread)."""
        return not getattr(self.gpu, "blocking", True)

    def gpu_snapshot_now(self) -> GpuSnapshot | None:
        """A snapshot from a backend that answers at once; None for one that may block or that
        failed (the task's path then tries, and reports)."""
        if not self.gpus_answer_at_once:
            return None
        try:
            self.latest = self.gpu.snapshot()
        except Exception:
            return None
        return self.latest

    async def gpu_snapshot(self) -> GpuSnapshot:
        if self.gpus_answer_at_once:
            self.latest = self.gpu.snapshot()
        else:
            self.latest = await asyncio.to_thread(self.gpu.snapshot)
        return self.latest

    def gpu_model(self, wanted: list[str] | None) -> str | None:
        """The model of the first GPU of `wanted` (all: None), as last sampled."""
        gpus = select_gpus(self.latest, wanted) if self.latest is not None else []
        return (gpus[0].name or None) if gpus else None

    def refresh_gpus(self) -> None:
        self.tasks.task(self._refresh_gpus())

    async def _refresh_gpus(self) -> None:
        """A sample out of turn (at ready): of no launch, but with the running tree's pids when
        some GPU lists a process, so status marks the server's holders from the first sample."""
        with contextlib.suppress(Exception):
            snap = await asyncio.to_thread(self.gpu.snapshot)
            pid = self.sample_target().pid
            tree: frozenset[tuple[int, float]] = frozenset()
            if pid is not None and any(g.processes for g in snap.gpus):
                tree = await asyncio.to_thread(ownership.launch_tree, pid)
            self.post(GpuSampled(0, snap, tree))

    def poll_gpus(self) -> None:
        self.tasks.task(self._poll_gpus())

    async def _poll_gpus(self) -> None:
        """Once a second: a GPU snapshot and the running launch's process tree, posted to the
        owner (which attributes holders, notes ranks at ready and notices a lost rank)."""
        while True:
            target = self.sample_target()
            if not target.waiting:  # the wait polls faster on its own
                try:
                    snap = await self.gpu_snapshot()
                    tree: frozenset[tuple[int, float]] = frozenset()
                    holders = any(g.processes for g in snap.gpus)
                    # The tree walk reads /proc: only worth it when some GPU lists a process, or
                    # when ranks are watched (a lost rank shows as a GPU that lists none).
                    if (holders or target.watching_ranks) and target.pid is not None:
                        tree = await asyncio.to_thread(ownership.launch_tree, target.pid)
                    unresolved: tuple[int, ...] = ()
                    if holders and self.gpu.name == "nvml" and not target.unresolved_noted:
                        unresolved = ownership.unresolved_pids(snap.gpus)
                    self.post(GpuSampled(target.gen, snap, tree, unresolved))
                except Exception:
                    log.exception("gpu.poll_failed")
            await self.tasks.real.sleep(GPU_POLL_S)
