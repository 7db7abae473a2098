"""The machine at the daemon's start: what the previous life left. Its record is restored at
once; its server, verified under the shim and serving what is asked, is adopted as it runs;
otherwise a server it left running is stopped and the saved intent starts, each step decided by
the boot's own sub-machine (`booting.py`). Decisions of the machine (`machine.py` dispatches to
them), writing the state only through `Machine.transition`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import messages as ms
from . import saved
from .model import Adoptee, Launch
from .states import ServerState

if TYPE_CHECKING:
    from .machine import Machine


def on_boot_began(m: Machine, msg: ms.BootBegan) -> None:
    """The previous life's record is restored at once (`/status` shows it, `booting`). Its
    server, verified under the shim and serving what is asked, is adopted (`_adopt`);
    otherwise a server that life left running is stopped (the host's `stop_previous`),
    then the saved intent starts, read and preflighted like any start (the host's
    `boot_start`), each step decided by the boot's own sub-machine (`booting.py`)."""
    m.ledger.secret_salt = msg.secret_salt
    if msg.note:
        m.event("state_file_corrupt", detail=msg.note)
    known = msg.alive_known
    plan = saved.plan_boot(
        msg.record, lambda pid, ct: (pid, ct) in known, m.settings.default_config
    )
    for kind, fields in plan.notes:
        m.event(kind, **fields)
    r = plan.restored
    m.intent, m.launch_seq = r.intent, r.launch_seq
    m.retries.reset(r.failures)
    m.ledger.restore(r.history, r.last_exit, r.known_ours)
    rollback = None
    if plan.swap is not None:
        m.swaps.resume(plan.swap, plan.swap_phase)
        rollback = plan.swap.rollback_name or m.intent.last_good_config
    m.persist()  # the previous life's record, brought up to date, is saved now
    m.ledger.note_unmanaged(msg.unmanaged)
    adoptee, prev = msg.adoptee, msg.previous
    stopping = adoptee is not None and bool(adoptee.record.get("stopping"))
    if adoptee is not None and adoptee.config.name == plan.config and not stopping:
        adopted = _adopt(m, adoptee)  # it serves what is asked: supervised as it runs
        m.booting.begin(None, None, None)
        boot_go_on(m, "", adopted)
        return
    if adoptee is not None:  # not what is asked to run, or being stopped: stopped, as ever
        prev = adoptee.previous()
    # The previous server's record, kept in state.json until it is stopped.
    previous = msg.record.get("current_launch") if prev is not None else None
    if m.booting.begin(plan.config, rollback, prev, previous):
        boot_go_on(m, "")  # nothing of that life runs


def _adopt(m: Machine, adoptee: Adoptee) -> str:
    """The previous life's server, verified under the shim, taken over in the state it was
    in (no signal sent to it): ready stays ready, starting goes on starting. A swap under
    way for it goes on. Its log, probes and timers follow with `Adopted`."""
    m.gen += 1
    swap = m.swaps.active()
    rollback = swap is not None and m.swaps.resumed_read(
        adoptee.rollback, m.intent.last_good_config
    )
    m.launch = launch = Launch(m.gen, adoptee.config, swap=swap, rollback=rollback)
    m.attempts.adopt(launch, adoptee)
    if swap is not None:
        m.swaps.spawned(swap, launch.launch_id)
    state = ServerState.STARTING if launch.ready_at is None else ServerState.READY
    # STOPPED -> STARTING|READY
    m.transition(state, reason="adopted", pid=adoptee.server.pid)
    m.host.adopt(launch)
    return launch.launch_id


def on_adopted(m: Machine, msg: ms.Adopted) -> None:
    launch = m.current(msg.gen)
    if launch is None:
        return
    m.attempts.adopted(launch, msg.log)
    if launch.exited_at is not None:
        return  # it ended while the daemon was away: its exit comes next
    if m.state == ServerState.READY:
        m.ready_settles(launch)
    elif m.state == ServerState.STARTING:
        m.attempts.watch_adopted(launch)


def boot_go_on(m: Machine, stopped_id: str, adopted_id: str = "") -> None:
    """Nothing of the previous life runs any more: its launches get their exit records,
    and the boot goes on to its start (or the daemon ends: a shutdown asked meanwhile)."""
    if not m.booting.active:
        return
    m.ledger.close_unobserved(stopped_id, adopted_id)
    if m.booting.go_on():
        m.finished = True
    m.persist()
