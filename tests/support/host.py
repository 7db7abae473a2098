"""A part of the host on its own: a launch of a config written for the test, its tasks, and
the messages the part posted (a plain list's `append` is its `post`), awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gpuwarden.daemon.clock import SystemClock
from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.messages import Message
from gpuwarden.daemon.model import Launch
from gpuwarden.daemon.tasks import Tasks

from .configs import write_configs

M = TypeVar("M", bound=Message)


def launch_of(root: Path, command: list[str], gen: int = 1, **fields: Any) -> Launch:
    """A launch of `command` (no args), its config written under `root` and read back as the
    daemon reads it; `fields` are more of the config's keys (`health`, `env`)."""
    name = f"c{gen}"
    write_configs(root, {name: {"command": command, **fields}})
    cfg = ConfigStore(root / "configs").load(name)
    return Launch(gen, cfg, launch_id=f"{name}-launch")


def tasks_posting(messages: list[Message]) -> Tasks:
    """The tasks a part runs in, their failures posted to `messages` too."""
    return Tasks(SystemClock(), messages.append)


async def posted(messages: list[Message], kind: type[M], /, timeout: float = 20, **match: Any) -> M:
    """The first message of `kind` (with `match`'s fields) posted to `messages`, once it is.
    The list is looked at each few milliseconds: it announces nothing."""
    async with asyncio.timeout(timeout):
        while True:
            for msg in messages:
                if isinstance(msg, kind) and all(getattr(msg, k) == v for k, v in match.items()):
                    return msg
            await asyncio.sleep(0.005)


async def until(predicate: Callable[[], bool], timeout: float = 20) -> None:
    """Once `predicate` holds: for what a part changes without posting (a listener's list)."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - nothing announces it
            await asyncio.sleep(0.005)
