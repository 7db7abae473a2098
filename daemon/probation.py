"""What a `restart --wait` caller is answered once the launch it brought up is ready and its
probation is waited for: it stayed up `probation_s` (`ready`), it crashed in it (the rollback's
outcome for a swap, `failed` with the exit's reason for a restart of the current config), or a
stop, a shutdown or another restart ended the wait.

Readers of the machine only, re-checked after every handled message (`until`), so no ending
is missed; the machine itself decides what a crash in probation means.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .clock import Clock
    from .machine import Machine

Until = Callable[[Callable[[], bool]], Awaitable[None]]


def already_ready(config: str) -> dict[str, Any]:
    """The outcome of a restart with `ensure` whose config was ready already."""
    return {
        "outcome": "ready",
        "reason": None,
        "evidence": f"{config} is ready",
        "launch_ids": [],
        "config": config,
    }


async def swap_outcome(
    m: Machine,
    until: Until,
    settled: Callable[[str], Awaitable[dict[str, Any]]],
    swap_id: str,
    ready: dict[str, Any],
) -> dict[str, Any]:
    """How the probation of the launch a swap brought up ended: it passed (the launch became
    last-good, also when a later swap began while it served), it crashed (the machine began a
    rollback swap of its own: its outcome), or a stop or the daemon's shutdown ended it."""
    launch_id = ready["launch_ids"][-1]

    def another_swap() -> bool:
        return m.swaps.current is not None and m.swaps.current.id != swap_id

    await until(
        lambda: (
            m.intent.last_good_launch == launch_id
            or another_swap()
            or not m.intent.running
            or m.finished
        )
    )
    if m.intent.last_good_launch == launch_id:
        probation_s = m.settings.restart.probation_s
        evidence = f"{ready['config']} is ready and survived its probation ({probation_s:g} s)"
        return {**ready, "evidence": evidence}
    if another_swap() and m.intent.running and not m.finished:
        assert m.swaps.current is not None
        rollback = await settled(m.swaps.current.id)
        launch_ids = [*ready["launch_ids"], *rollback["launch_ids"]]
        return {**rollback, "swap_id": swap_id, "launch_ids": list(dict.fromkeys(launch_ids))}
    if m.finished:
        why = "the daemon shut down during its probation (it resumes at the next start)"
    else:
        why = "stopped on request during its probation"
    return {**ready, "outcome": "failed", "reason": "requested_stop", "evidence": why}


async def restart_outcome(
    m: Machine, until: Until, clock: Clock, swap_id: str, ready: dict[str, Any]
) -> dict[str, Any]:
    """A restart of the current config is no swap (nothing rolls back: a crash follows the
    restart policy), but waited for with probation its answer means the same: the launch
    stayed up `probation_s` after ready. Answered `failed`, with the exit's reason, when it
    ended before that; as `swap_outcome` when a stop, a shutdown or another restart ended
    the wait."""
    launch_id = ready["launch_ids"][-1]
    probation_s = m.settings.restart.probation_s

    def ended() -> bool:
        exited = (m.ledger.last_exit or {}).get("launch_id") == launch_id
        other = m.swaps.current is not None and m.swaps.current.id != swap_id
        return exited or other or not m.intent.running or m.finished

    watcher = asyncio.ensure_future(until(ended))
    timer = asyncio.ensure_future(clock.sleep(probation_s))
    try:
        await asyncio.wait((watcher, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        timer.cancel()
    name = ready["config"]
    if not ended():
        evidence = f"{name} is ready and survived its probation ({probation_s:g} s)"
        return {**ready, "evidence": evidence}
    last = m.ledger.last_exit or {}
    if last.get("launch_id") == launch_id:
        why = f"{name} crashed during its probation ({probation_s:g} s after ready)"
        if last.get("evidence"):
            why += f": {last['evidence']}"
        return {**ready, "outcome": "failed", "reason": last.get("reason"), "evidence": why}
    if m.finished:
        why = "the daemon shut down during its probation"
    elif not m.intent.running:
        why = "stopped on request during its probation"
    else:
        why = "another restart or swap began during its probation"
    return {**ready, "outcome": "failed", "reason": "requested_stop", "evidence": why}
