"""The host's retry after an exit: the backoff waited out on the injected clock, then the
config read (or known unchanged by a stat) and posted as `BackoffElapsed`, or why it could not
be; with no delay and nothing changed, posted at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.messages import BackoffElapsed, Message
from gpuwarden.daemon.retrying import Retry
from gpuwarden.daemon.tasks import Tasks

from .support.configs import standin_config, write_configs
from .support.host import posted
from .support.supervisor import FakeClock


def retry(root: Path, messages: list[Message], clock: FakeClock) -> Retry:
    write_configs(root, {"c": standin_config()})
    return Retry(
        configs=ConfigStore(root / "configs"),
        clock=clock,
        tasks=Tasks(clock, messages.append),
        post=messages.append,
    )


async def settle(turns: int = 50) -> None:
    """The loop's turns, in which a task the clock did not wake would have posted."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_no_delay_and_an_unchanged_config_is_posted_at_once(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = retry(tmp_path, messages, FakeClock())
    cfg = part.configs.load("c")
    part.retry_after(0, 3, "c")
    # In this very call: no task's turn of the loop on the way to the relaunch.
    assert messages == [BackoffElapsed(3, cfg)]


async def test_the_delay_is_waited_out_then_a_changed_config_is_read(tmp_path: Path) -> None:
    messages: list[Message] = []
    clock = FakeClock()
    part = retry(tmp_path, messages, clock)
    part.configs.load("c")
    write_configs(tmp_path, {"c": standin_config("--standin-crash-after=5")})
    part.retry_after(2.0, 3, "c")
    await settle()
    clock.advance(1.9)
    await settle()
    assert messages == []
    clock.advance(0.2)
    elapsed = await posted(messages, BackoffElapsed, gen=3)
    assert elapsed.resolved is not None and "--standin-crash-after" in elapsed.resolved.argv


async def test_a_config_that_cannot_be_read_is_posted_as_unreadable(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = retry(tmp_path, messages, FakeClock())
    (tmp_path / "configs" / "c.yaml").write_text("command: [unclosed\n")
    part.retry_after(0, 3, "c")
    elapsed = await posted(messages, BackoffElapsed, gen=3)
    assert elapsed.resolved is None and elapsed.unreadable and elapsed.error


async def test_no_config_to_retry_says_so(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = retry(tmp_path, messages, FakeClock())
    part.retry_after(0, 3, None)
    elapsed = await posted(messages, BackoffElapsed, gen=3)
    assert elapsed.resolved is None and not elapsed.unreadable
    assert elapsed.error == "no config given, none running and no default_config set"


async def test_a_cancelled_retry_posts_nothing(tmp_path: Path) -> None:
    messages: list[Message] = []
    clock = FakeClock()
    part = retry(tmp_path, messages, clock)
    part.retry_after(1.0, 3, "c")
    await settle()
    part.cancel_retry()
    clock.advance(5)
    await settle()
    assert messages == []
