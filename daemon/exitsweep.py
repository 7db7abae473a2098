"""A part of the host: the sweep after a server's exit. Its last output is let in (bounded: a
grandchild may hold the pipes), what is left of its launch is killed, and so are the GPU
holders of ours the tree walk could not reach (an earlier launch's orphans); then
`SweepFinished`, with what was killed. The usual end, with nothing left, is known without a
wait and posted at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .gpuwatch import GpuWatch
from .messages import Message, SweepFinished
from .server import reaper
from .tasks import Tasks

if TYPE_CHECKING:
    from .gpustate import KnownOurs
    from .model import Launch

PIPE_DRAIN_S = 0.2  # after an exit, how long to wait for the last output before classifying
# How long the post-exit sweep may take before it counts as overdue (it normally takes well
# under a second: pipes, a /proc walk, a GPU snapshot, the kills' own grace).
SWEEP_DEADLINE_S = 120.0


class ExitSweep:
    def __init__(
        self,
        *,
        gpus: GpuWatch,
        tasks: Tasks,
        post: Callable[[Message], None],
        deadline_s: float = SWEEP_DEADLINE_S,
    ) -> None:
        self.gpus, self.tasks, self.post = gpus, tasks, post
        self.deadline_s = deadline_s
        self.subreaper = reaper.is_subreaper()

    def sweep(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        """Right after this turn, whose records (the exit's notice) go out first. `known_ours`
        and `unresolved` say which GPU holders are ours (the machine's knowledge of them)."""
        asyncio.get_running_loop().call_soon(self._sweep, launch, known_ours, unresolved)

    def _sweep(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        # A callback's failure would reach only the loop's exception handler, while the machine
        # waits in stopping for the sweep: it hears of it as of the task's own failure.
        coro = None
        try:
            if not self._swept_at_once(launch):
                coro = self._after_exit(launch, known_ours, unresolved)
                self.tasks.task(coro, gen=launch.gen, deadline_s=self.deadline_s)
        except Exception as exc:
            if coro is not None:
                coro.close()
            self.tasks.report_failure("after_exit", launch.gen, exc)

    def _swept_at_once(self, launch: Launch) -> bool:
        """The usual end of a server, known without a wait: its output is all in and nothing of
        it is left (we are the subreaper, so every process of ours is our child). Posted at
        once, with no task's turns of the loop on the way to the relaunch; the rest is
        `_after_exit`'s.

        The GPUs: a backend that answers at once is asked whether any GPU lists a process (a
        holder of ours from an earlier life of the daemon is the task's to kill). NVML is not
        asked here: no process of ours is alive (the previous life's were swept at boot), and
        the GPU wait that comes before any launch samples NVML anyway, killing holders of ours
        on the GPUs it waits for."""
        child = launch.child
        if child is None or not self.subreaper or not child.output_closed:
            return False
        try:
            if not reaper.nothing_left(child.pgid):
                return False
            gpus = self.gpus
            if gpus.gpus_answer_at_once and any(g.processes for g in gpus.gpu.snapshot().gpus):
                return False
        except Exception:  # the task's path tries again, and reports what fails
            return False
        self.post(SweepFinished(launch.gen, []))
        return True

    async def _after_exit(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        """Let the last output in (bounded: a grandchild may hold the pipes), then sweep."""
        child = launch.child
        assert child is not None
        await child.wait_output_closed(PIPE_DRAIN_S)
        killed: list[reaper.Leftover] = []
        if not (self.subreaper and reaper.nothing_left(child.pgid)):
            leftovers = await asyncio.to_thread(reaper.find_leftovers, launch.token, child.pgid)
            killed = await reaper.kill_leftovers(leftovers)
        report: list[dict[str, Any]] = [
            {"pid": k.pid, "name": k.name, "cmdline": k.cmdline} for k in killed
        ]
        # Holders of ours the tree walk could not reach (an earlier launch's orphans).
        snap = await self.gpus.gpu_snapshot()
        report += await self.gpus.kill_gpu_orphans(list(snap.gpus), None, known_ours, unresolved)
        self.post(SweepFinished(launch.gen, report))
