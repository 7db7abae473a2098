"""The supervisor in-process: `running` is the one way tests start one (its configs and
settings written, its loop a task, shut down after), and a fake clock for tests where time
itself is the subject."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from gpuwarden.daemon.gpu import FakeGpuBackend, GpuBackend
from gpuwarden.daemon.supervisor import Supervisor

from .configs import make_settings, write_configs


class FakeClock:
    """Monotonic and wall time that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._n = 0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_800_000_000.0 + self.now

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._n += 1
        heapq.heappush(self._sleepers, (self.now + max(0.0, seconds), self._n, fut))
        await fut

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self._sleepers and self._sleepers[0][0] <= self.now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)


@asynccontextmanager
async def running(
    root: Path, gpu: Path | GpuBackend, configs: dict[str, dict[str, Any]], **kw: Any
) -> AsyncIterator[Supervisor]:
    """A supervisor of `configs` under `root`, running: `gpu` is the fake GPUs' folder or a
    backend; `settings=` goes to `make_settings`, the rest of `kw` to `Supervisor`. Until its
    first await, the body runs before the supervisor's first step (it may still adjust it)."""
    write_configs(root, configs)
    settings = make_settings(root, **kw.pop("settings", {}))
    backend = FakeGpuBackend(gpu) if isinstance(gpu, Path) else gpu
    sup = Supervisor(settings, backend, **kw)
    task = asyncio.create_task(sup.run())
    try:
        yield sup
    finally:
        await asyncio.wait_for(sup.shutdown(), 30)
        await asyncio.wait_for(task, 10)
