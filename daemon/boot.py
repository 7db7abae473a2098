"""The daemon's start: its previous life's record read back, a server that life left running
stopped, and the saved intent started again (through the same preflight as a start); a sweep
that life did not finish ends on the config it was to end on.

Runs in the owner task before it handles its first message.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from . import reading, saved
from .errors import CommandError
from .messages import StartRequested
from .preflight import PreflightResult
from .server import reaper

if TYPE_CHECKING:
    from .configs import ResolvedConfig
    from .machine import Machine
    from .store import EventLog, StateStore
    from .supervisor import Supervisor

BOOT_DEADLINE_S = 300.0  # the boot's config read and preflight (two introspections at most)


async def restore(
    machine: Machine,
    store: StateStore,
    grace_s: float,
    default_config: str | None,
    events: EventLog | None = None,
) -> tuple[str | None, str | None]:
    """Read state.json into the machine and stop what the previous life left running.
    Returns the config to start (None: none) and what a resumed swap rolls back to.
    `events` continues its `seq` from the one state.json recorded when that is higher (the
    events file may be gone)."""
    data, note = await asyncio.to_thread(store.load)
    if events is not None:
        with contextlib.suppress(TypeError, ValueError):
            events.seq = max(events.seq, int(data.get("events_seq") or 0))
    if note:
        machine.event("state_file_corrupt", detail=note)
    saved.restore(machine, data, reaper.is_alive)
    swept = saved.interrupted_sweep(data)
    if swept is not None:
        # The sweep ended with that life: its config does not go on serving; the config the
        # sweep was to end on does (none: none was serving before it).
        sweep_id, back = swept
        machine.set_intent(back or machine.intent_config, back is not None)
        data = {**data, "intent": {"config": machine.intent_config, "running": back is not None}}
        machine.event(
            "sweep_interrupted",
            sweep_id=sweep_id,
            restore_to=back,
            detail=f"the daemon stopped during sweep {sweep_id}; "
            + (f"{back} serves again" if back else "nothing was serving before it"),
        )
    current = data.get("current_launch") or {}
    stopped = await stop_previous_life(machine, current or None, grace_s)
    machine.close_unobserved(str(current.get("launch_id") or "") if stopped else "")
    name = saved.boot_config(data, default_config)
    rollback = None
    if name:
        record = data.get("swap")
        swap = saved.resumed_swap(record, name)
        if swap is not None:
            machine.resume_swap(swap, record.get("phase") if isinstance(record, dict) else None)
            rollback = swap.rollback_name or machine.last_good_config
    return name, rollback


async def stop_previous_life(
    machine: Machine, record: dict[str, Any] | None, grace_s: float
) -> bool:
    """A server group from the daemon's previous life, still alive, is stopped first."""
    if not record:
        return False
    pid = int(record.get("pid") or 0)
    same_boot = record.get("boot_id") == reaper.boot_id()
    create_time = record.get("create_time")
    alive = same_boot and pid > 0 and reaper.is_alive(pid, create_time)
    launch_id = str(record.get("launch_id") or "")
    token = str(record.get("token") or "")
    leftovers = (
        reaper.find_leftovers(token, record.get("pgid") if alive else None)
        if (same_boot and (token or alive))
        else []
    )
    if not alive and not leftovers:
        return False
    machine.event(
        "previous_server_found",
        pid=pid,
        launch_id=launch_id,
        detail="a server from the daemon's previous life is still running; stopping it",
    )
    pgid = int(record.get("pgid") or pid)
    if alive:
        await reaper.stop_foreign(pid, create_time, pgid, grace_s)
    killed = await reaper.kill_leftovers(reaper.find_leftovers(token, pgid))
    machine.event(
        "previous_server_stopped", pid=pid, killed=[{"pid": k.pid, "name": k.name} for k in killed]
    )
    return alive


async def boot_start(sup: Supervisor, name: str, ticket: int, rollback: str | None) -> None:
    """The boot's start: the preflight gates it too, run off the owner; then it is posted
    like any start (a stop asked for meanwhile wins: its `ticket` is older)."""
    cfg: ResolvedConfig | None = None
    try:
        cfg, pre = await reading.for_command(sup.configs, name)
    except CommandError as exc:
        pre = PreflightResult(ok=False, problems=[exc.detail])
    if cfg is not None:
        pre = await sup.preflight.check(cfg)
    back = await reading.quietly(sup.configs, rollback, cfg)
    msg = StartRequested(
        name, boot=True, preflight=pre, resolved=cfg, ticket=ticket, last_good=back
    )
    with contextlib.suppress(CommandError):
        await sup.request(msg)
