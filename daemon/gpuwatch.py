"""The host's GPU side: the wait for a launch's GPUs to be free (killing orphans of ours that
hold them, never a foreign holder), and the once-a-second sample of every GPU and the running
launch's process tree that the machine attributes and watches ranks with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuwarden.daemon import logsetup

from . import ownership
from .gpu import GpuBackend
from .gpustate import GpuSnapshot, busy_gpus, describe_busy
from .messages import EventNoted, GpuSampled, GpuWaitEnded, Message, OrphansKilled
from .settings import Settings
from .states import ServerState
from .tasks import Tasks

if TYPE_CHECKING:
    from .model import Launch
    from .views import Snapshot

log = logsetup.get_logger("gpuwarden.supervisor")
GPU_POLL_S = 1.0


class GpuWatch:
    def __init__(
        self,
        *,
        settings: Settings,
        gpu: GpuBackend,
        tasks: Tasks,
        post: Callable[[Message], None],
        view: Callable[[], Snapshot],
        sweep_deadline_s: float,
    ) -> None:
        self.settings, self.gpu, self.tasks, self.post, self.view = settings, gpu, tasks, post, view
        self.clock = tasks.clock
        self.sweep_deadline_s = sweep_deadline_s  # a sweep's orphan kills, within the wait's
        self._gpu_task: asyncio.Task[Any] | None = None

    def wait_for_gpus(self, launch: Launch) -> None:
        snap = self.gpu_snapshot_now()
        if snap is not None and not busy_gpus(
            snap, launch.config.gpus, self.settings.gpu.busy_above_mib
        ):
            # Free at the first look, with a backend that answers at once: no wait to run.
            self._gpu_task = None
            self.post(GpuSampled(launch.gen, snap, frozenset()))
            self.post(GpuWaitEnded(launch.gen, True))
            return
        deadline = self.settings.gpu.release_timeout_s + self.sweep_deadline_s
        self._gpu_task = self.tasks.task(
            self._wait_for_gpus(launch), gen=launch.gen, deadline_s=deadline
        )

    def cancel_gpu_wait(self) -> None:
        if self._gpu_task is not None:
            self._gpu_task.cancel()
            self._gpu_task = None

    async def _wait_for_gpus(self, launch: Launch) -> None:
        cfg = self.settings.gpu
        deadline = self.clock.monotonic() + cfg.release_timeout_s
        announced = False
        while True:
            snap = await self.gpu_snapshot()
            self.post(GpuSampled(launch.gen, snap, frozenset()))
            busy = busy_gpus(snap, launch.config.gpus, cfg.busy_above_mib)
            if not busy:
                self.post(GpuWaitEnded(launch.gen, True))
                return
            await self.kill_gpu_orphans(busy)
            if not announced:
                announced = True
                self.post(EventNoted("gpu_wait", {"detail": describe_busy(busy)}))
            if self.clock.monotonic() >= deadline:
                self.post(GpuWaitEnded(launch.gen, False, describe_busy(busy)))
                return
            await self.clock.sleep(cfg.poll_interval_s)

    async def kill_gpu_orphans(self, gpus: list[Any]) -> list[dict[str, Any]]:
        if not any(g.processes for g in gpus):
            return []  # the common case after an exit: no view taken on the restart path
        view = self.view()
        killed = await ownership.kill_gpu_orphans(
            gpus, view.pid, view.known_ours, view.gpu_pids_unresolved
        )
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
            return self.gpu.snapshot()
        except Exception:
            return None

    async def gpu_snapshot(self) -> GpuSnapshot:
        if self.gpus_answer_at_once:
            return self.gpu.snapshot()
        return await asyncio.to_thread(self.gpu.snapshot)

    def refresh_gpus(self) -> None:
        self.tasks.task(self._refresh_gpus())

    async def _refresh_gpus(self) -> None:
        """A sample out of turn (at ready): of no launch, but with the running tree's pids when
        some GPU lists a process, so status marks the server's holders from the first sample."""
        with contextlib.suppress(Exception):
            snap = await asyncio.to_thread(self.gpu.snapshot)
            pid = self.view().pid
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
            view = self.view()
            if view.state != ServerState.WAITING_GPU:  # the wait polls faster on its own
                try:
                    snap = await self.gpu_snapshot()
                    tree: frozenset[tuple[int, float]] = frozenset()
                    holders = any(g.processes for g in snap.gpus)
                    # The tree walk reads /proc: only worth it when some GPU lists a process, or
                    # when ranks are watched (a lost rank shows as a GPU that lists none).
                    if (holders or view.watching_ranks) and view.pid is not None:
                        tree = await asyncio.to_thread(ownership.launch_tree, view.pid)
                    unresolved: tuple[int, ...] = ()
                    if holders and self.gpu.name == "nvml" and not view.gpu_pids_unresolved:
                        unresolved = ownership.unresolved_pids(snap.gpus)
                    self.post(GpuSampled(view.gen, snap, tree, unresolved))
                except Exception:
                    log.exception("gpu.poll_failed")
            await self.tasks.real.sleep(GPU_POLL_S)
