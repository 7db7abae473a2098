"""A part of the host: the retry after an exit. It waits out the backoff, then reads the
config the machine will start (off the loop: a large or hostile file must not stall it) and
posts `BackoffElapsed` with it, or with why it could not be read. A config whose files did
not change is known by a stat of each: with no delay, it is posted at once, with no task's
turn of the loop on the way to the relaunch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .clock import Clock
from .configs import ConfigError, ConfigStore
from .messages import BackoffElapsed, Message
from .tasks import Tasks


class Retry:
    def __init__(
        self,
        *,
        configs: ConfigStore,
        clock: Clock,
        tasks: Tasks,
        post: Callable[[Message], None],
    ) -> None:
        self.configs, self.clock, self.tasks, self.post = configs, clock, tasks, post
        self._task: asyncio.Task[Any] | None = None

    def retry_after(self, delay_s: float, gen: int, config: str | None) -> None:
        if delay_s <= 0 and config and self._unchanged(gen, config):
            self._task = None  # no delay and nothing to read: posted now
            return
        self._task = self.tasks.task(self._retry(delay_s, gen, config), gen=gen)

    def cancel_retry(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _unchanged(self, gen: int, config: str) -> bool:
        """A config whose files did not change is known by a stat of each: no thread hop on
        the restart path. Posts the retry and says True; False when it must be read."""
        resolved = self.configs.unchanged(config)
        if resolved is None:
            return False
        self.post(BackoffElapsed(gen, resolved))
        return True

    async def _retry(self, delay_s: float, gen: int, config: str | None) -> None:
        if delay_s > 0:
            await self.clock.sleep(delay_s)
        if not config:
            error = "no config given, none running and no default_config set"
            self.post(BackoffElapsed(gen, None, error))
            return
        if self._unchanged(gen, config):
            return
        # Reading one is off the loop: a large or hostile file must not stall it.
        try:
            resolved = await asyncio.to_thread(self.configs.load, config)
        except ConfigError as exc:
            self.post(BackoffElapsed(gen, None, str(exc), unreadable=True))
            return
        self.post(BackoffElapsed(gen, resolved))
