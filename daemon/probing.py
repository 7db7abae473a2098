"""A part of the host: what asks the server whether it serves. The probe loop of a launch
(readiness: until the first success; liveness: for as long as it runs) posts `ProbeSucceeded`
and `ProbeFailed`; the listener check asks who holds the health URL's listening socket, and
whether that is the launch's own tree (`ListenerChecked`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import ownership, startup
from .clock import Clock
from .health import Prober
from .listener import check_listener
from .messages import ListenerChecked, Message, ProbeFailed, ProbeSucceeded, ServerFiguresRead
from .tasks import Tasks

if TYPE_CHECKING:
    from .model import Launch

READINESS_INTERVAL_S = 1.0  # the longest wait between readiness probes


class Probes:
    def __init__(
        self, *, prober: Prober, clock: Clock, tasks: Tasks, post: Callable[[Message], None]
    ) -> None:
        self.prober, self.clock, self.tasks, self.post = prober, clock, tasks, post

    def probe(self, launch: Launch, readiness: bool) -> None:
        """Probe the launch's health URL, in a task of the launch. Readiness: until it answers
        (`ProbeSucceeded`). Liveness: each failure (`ProbeFailed`), and the first success after
        failures, until the launch ends."""
        self.tasks.task(self._probe_loop(launch, readiness), launch=launch)

    async def read_startup(self, launch: Launch) -> None:
        """SGLang's own account of its start, once it serves: kept on the launch's record
        beside the phases its log showed. Another server (or an older SGLang): nothing."""
        times = await startup.read(launch.config)
        if times is not None:
            self.post(ServerFiguresRead(launch.gen, {}, startup=times))

    async def _probe_loop(self, launch: Launch, readiness: bool) -> None:
        health = launch.config.config.health
        url = launch.config.health_url
        interval_s = (
            min(health.interval_s, READINESS_INTERVAL_S) if readiness else health.interval_s
        )
        while True:
            await self.clock.sleep(interval_s)
            result = await self.prober.probe(url, health.timeout_s)
            if result.ok:
                if readiness or launch.probe_failures:
                    self.post(ProbeSucceeded(launch.gen, result.detail))
                if readiness:
                    return
            elif not readiness:
                self.post(ProbeFailed(launch.gen, result.detail))

    def check_listener(self, launch: Launch, how: str) -> None:
        self.tasks.task(self._check_listener(launch, how), launch=launch)

    async def _check_listener(self, launch: Launch, how: str) -> None:
        assert launch.child is not None
        main = launch.child.pid

        def tree() -> list[int]:
            return [pid for pid, _ in ownership.launch_tree(main)]

        check = await asyncio.to_thread(check_listener, launch.config.health_url, tree)
        self.post(ListenerChecked(launch.gen, how, check))

    async def close(self) -> None:
        await self.prober.close()
