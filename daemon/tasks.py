"""Helper tasks of the owner, with lifetimes: each one of a launch lives and dies with that
launch (`end_tasks`), the way a task group scopes its children; every failure is posted back
(`TaskFailed`), never lost; one with a deadline that overruns it makes supervision count as
stuck (`overdue`). Timers are tasks too: they sleep on the injected clock, then post.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from gpuwarden.daemon import logsetup

from .clock import Clock, SystemClock
from .messages import Message, TaskFailed

if TYPE_CHECKING:
    from .model import Launch

log = logsetup.get_logger("gpuwarden.supervisor")


class Tasks:
    def __init__(self, clock: Clock, post: Callable[[Message], None]) -> None:
        self.clock, self.post = clock, post
        # The watchdog's deadlines and the GPU poll keep real time, also where the machine's
        # clock is a test's.
        self.real: Clock = SystemClock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._scoped: dict[int, set[asyncio.Task[Any]]] = {}  # a launch's gen -> its tasks
        self._deadlines: dict[asyncio.Task[Any], tuple[str, float]] = {}

    def task(
        self,
        coro: Coroutine[Any, Any, Any],
        *,
        launch: Launch | None = None,
        gen: int = 0,
        deadline_s: float | None = None,
        name: str | None = None,
    ) -> asyncio.Task[Any]:
        """A helper task (named after its coroutine, unless `name` says). Its failure is posted
        back (`TaskFailed`); one of a launch ends with it; one with a deadline that runs past
        it makes supervision count as stuck."""
        name = name or getattr(coro, "__qualname__", "task").rsplit(".", 1)[-1].lstrip("_")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        gen = launch.gen if launch is not None else gen
        task.add_done_callback(lambda t: self._task_done(t, gen))
        if deadline_s is not None:
            self._deadlines[task] = (name, self.real.monotonic() + deadline_s)
        if launch is not None:
            scope = self._scoped.setdefault(launch.gen, set())
            scope.add(task)
            task.add_done_callback(scope.discard)
        return task

    def _task_done(self, task: asyncio.Task[Any], gen: int) -> None:
        self._tasks.discard(task)
        self._deadlines.pop(task, None)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self.report_failure(task.get_name(), gen, exc)

    def report_failure(self, name: str, gen: int, exc: BaseException) -> None:
        """A helper's failure, logged and posted to the machine, which recovers from it."""
        log.error("supervisor.task_failed", task=name, exc_info=exc)
        self.post(TaskFailed(name, gen, f"{type(exc).__name__}: {exc}"))

    def end_tasks(self, launch: Launch) -> None:
        for task in self._scoped.pop(launch.gen, set()):
            task.cancel()

    def overdue(self) -> str | None:
        now = self.real.monotonic()
        for name, deadline in list(self._deadlines.values()):
            if now > deadline:
                return f"the {name} task is {now - deadline:.0f} s past its deadline"
        return None

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def timer(self, seconds: float, msg: Message, launch: Launch | None = None) -> None:
        self.task(self._fire(seconds, msg), launch=launch)

    async def _fire(self, seconds: float, msg: Message) -> None:
        await self.clock.sleep(seconds)
        self.post(msg)
