"""The machine's commands: start, stop, restart and shutdown, each refused (`CommandError`, by
kind) or carried out and answered. They are the machine's decisions (`machine.py` dispatches to
them), written in a module of their own; the state changes only through the machine's one
writer, `Machine.transition`, and sites say `# FROM -> TO`.

"Stop wins": a stop refuses whatever was asked before it and is still on its way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import errors
from . import messages as ms
from .errors import CommandError
from .model import Next, PrewarmProgress
from .states import LIVE_STATES, RUNNING_STATES, ServerState

if TYPE_CHECKING:
    from .machine import Machine
    from .resolvedconfig import ResolvedConfig

LEFT_RUNNING = "live_restore: the server runs on under the shim; the daemon's next start adopts it"


def _cancelled_by_stop(m: Machine, ticket: int, what: str) -> None:
    if ticket and ticket < m.stop_ticket:
        raise CommandError(
            errors.CONFLICT, f"a stop was requested after this {what}; it was not carried out"
        )


def start(m: Machine, msg: ms.StartRequested) -> dict[str, Any]:
    if msg.boot:
        m.booting.start_arrived(msg.config)
    else:
        m.booting.refuse_while_stopping("start")
    _cancelled_by_stop(m, msg.ticket, "start")
    if not msg.boot:  # a boot resumes an interrupted swap as that swap
        m.swaps.refuse_if_under_way(m.intent.sweep)
    if m.state in (ServerState.WAITING_GPU, *RUNNING_STATES):
        raise CommandError(
            errors.CONFLICT,
            f"a server is already {m.state} (config {m.current_config()}); use restart to swap",
        )
    m.booting.replaced()  # a start carried out (or refused by its preflight, below)
    pre = msg.preflight
    if pre is not None and not pre.ok:
        detail = "; ".join(pre.problems) or "preflight failed"
        refuse(m, msg.config, detail)
        raise CommandError(
            errors.PREFLIGHT_REFUSED,
            detail,
            extra={"problems": pre.problems, "warnings": pre.warnings},
        )
    cfg = msg.resolved
    if cfg is None:  # the facade reads it first; one that did not read comes refused above
        raise CommandError(errors.INVALID_CONFIG, f"config {msg.config!r} was not read")
    rollback = msg.boot and m.swaps.resumed_read(msg.last_good, m.intent.last_good_config)
    m.host.cancel_retry()
    m.retries.reset()
    m.set_intent(cfg.name, True)
    m.begin_attempt(cfg, rollback=rollback)
    return {"accepted": True, "config": cfg.name, "state": str(m.state)}


def stop(m: Machine, msg: ms.StopRequested) -> dict[str, Any]:
    # Stop wins: whatever was asked before it and is still on its way (a preflight that
    # finishes later) is refused when it arrives.
    m.stop_ticket = max(m.stop_ticket, msg.ticket)
    m.set_intent(m.intent.config, False)
    # A boot under way starts nothing (the previous life's server still goes).
    m.booting.stop()
    if m.swaps.active() is not None:
        m.host.cancel_prewarm()
        m.swaps.settle(
            "failed", "requested_stop", "stopped on request during the swap", m.intent.config
        )
    launch = m.launch
    if m.state in (ServerState.FAILED, ServerState.BACKOFF) or (
        m.state == ServerState.WAITING_GPU and (launch is None or not launch.spawning)
    ):
        m.cancel_waits()
        # FAILED|BACKOFF|WAITING_GPU -> STOPPED
        m.transition(ServerState.STOPPED, reason="requested_stop")
        m.host.stop_weight_cache("stopped on request")
    elif m.state != ServerState.STOPPED and launch is not None:
        m.begin_stop(launch, Next.STOP)
    # The grace a waiting client bounds its wait by (SIGTERM, then SIGKILL after it).
    return {"accepted": True, "state": str(m.state), "grace_s": m.settings.stop.grace_s}


def restart(m: Machine, msg: ms.RestartRequested) -> dict[str, Any]:
    m.booting.refuse_while_stopping("restart")
    _cancelled_by_stop(m, msg.ticket, "restart")
    m.swaps.refuse_if_under_way(m.intent.sweep, msg.sweep_id)
    cfg = msg.resolved
    if cfg is None:
        raise CommandError(errors.INVALID_CONFIG, f"config {msg.config!r} was not read")
    m.booting.replaced()
    current = m.current_config()
    serving = m.serving()
    if msg.ensure and serving and m.state == ServerState.READY and current == cfg.name:
        return {"accepted": True, "config": current, "state": str(m.state), "swap_id": None}
    if serving is not None and serving.on_probation:
        # A swap away from a config on probation: its probation counts as passed, and it is
        # what this swap rolls back to (it was serving, not the older last-good).
        m.probation_passed(serving, detail="a swap began while it served")
    swap_id = f"swap-{m.launch_seq + 1}-{int(m.clock.time())}"
    last_good = (m.intent.last_good_config, msg.last_good)
    # A swap away from a ready server reads the new config's weights first, as it serves on.
    prewarm = (
        PrewarmProgress(files=len(msg.weights))
        if m.settings.prewarm.enabled
        and msg.weights
        and cfg.name != current
        and m.state == ServerState.READY
        else None
    )
    swap = m.swaps.begin(swap_id, cfg, current, serving, last_good, prewarm=prewarm)
    m.retries.reset()
    m.set_intent(cfg.name, True)
    if prewarm is not None:
        m.event("prewarm_began", swap_id=swap.id, files=len(msg.weights))
        m.host.prewarm(swap.id, msg.weights, prewarm)
    else:
        swap_on(m, cfg)
    return {"accepted": True, "config": cfg.name, "state": str(m.state), "swap_id": swap.id}


def prewarm_ended(m: Machine, msg: ms.PrewarmEnded) -> None:
    """The swap's pre-warm is over (done, or given up): the old server is stopped now."""
    cfg = m.swaps.prewarm_ended(msg.swap_id, msg.outcome, msg.detail)
    if cfg is not None:
        swap_on(m, cfg)


def swap_on(m: Machine, cfg: ResolvedConfig) -> None:
    """A restart or swap goes on to `cfg`: what runs is stopped first, else it starts now."""
    launch = m.launch
    if (
        m.state in (*RUNNING_STATES, ServerState.WAITING_GPU)
        and launch is not None
        and (m.state != ServerState.WAITING_GPU or launch.spawning)
    ):
        m.begin_stop(launch, Next.RELAUNCH, next_config=cfg)
    else:
        m.cancel_waits()
        m.begin_attempt(cfg)


def sweep_marked(m: Machine, msg: ms.SweepBegan | ms.SweepEnded) -> None:
    """A sweep began (on record: a later life ends it, `sweep_interrupted`), or ended."""
    if isinstance(msg, ms.SweepBegan):
        m.intent.sweep, m.intent.sweep_restore_to = msg.sweep_id, msg.restore_to
        m.persist()
    elif m.intent.sweep == msg.sweep_id:
        m.intent.sweep, m.intent.sweep_restore_to = None, None
        m.persist()


def shutdown(m: Machine, msg: ms.ShutdownRequested) -> None:
    if m.booting.shutdown_waits():  # the daemon ends once the previous server is stopped
        return
    launch = m.launch
    child = launch.child if launch is not None and launch.running else None
    keep = m.settings.live_restore and m.state in LIVE_STATES
    if keep and child is not None and child.survives_daemon:
        # Live restore: it runs on under the shim, and the next life adopts it.
        m.event("server_left_running", pid=child.pid, detail=LEFT_RUNNING)
        m.finished = True
        m.persist()
        return
    if launch is not None and (m.state in RUNNING_STATES or launch.spawning):
        m.begin_stop(launch, Next.SHUTDOWN)
        return
    m.cancel_waits()
    if not keep:  # (live restore keeps it for the server the next life adopts)
        m.host.stop_weight_cache("the daemon stopped")
    m.finished = True
    m.persist()


def refuse(m: Machine, name: str | None, detail: str) -> None:
    """A start whose preflight failed (or whose config no longer reads): `failed`."""
    m.intent.config, m.intent.running = name, True
    m.ledger.note_exit("preflight_refused", detail)
    m.event("preflight_refused", config=name, detail=detail)
    if m.state != ServerState.FAILED:
        # STOPPED|BACKOFF -> FAILED
        m.transition(ServerState.FAILED, reason="preflight_refused")
    m.persist()
