"""The commands' decisions: start, stop, restart or swap, shutdown, and a sweep's bracket.

Each takes the machine and the request, refuses it (`CommandError`, by kind) or changes the
machine through its own steps (`begin_attempt`, `begin_stop`, `swaps`), and answers.
"Stop wins": a stop refuses whatever was asked before it and is still on its way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import errors
from .errors import CommandError
from .messages import (
    RestartRequested,
    ShutdownRequested,
    StartRequested,
    StopRequested,
    SweepBegan,
    SweepEnded,
)
from .model import Next
from .states import RUNNING_STATES, ServerState, SwapPhase

if TYPE_CHECKING:
    from .configs import ResolvedConfig
    from .machine import Machine


def cancelled_by_stop(m: Machine, ticket: int, what: str) -> None:
    if ticket and ticket < m.stop_ticket:
        raise CommandError(
            errors.CONFLICT, f"a stop was requested after this {what}; it was not carried out"
        )


def start(m: Machine, msg: StartRequested) -> dict[str, Any]:
    if msg.boot:
        m.booting.start_arrived(msg.config)
    else:
        m.booting.command("start")
    cancelled_by_stop(m, msg.ticket, "start")
    if not msg.boot:  # a boot resumes an interrupted swap as that swap
        m.swaps.refuse_if_under_way(m.active_sweep)
    if m.state in (ServerState.WAITING_GPU, *RUNNING_STATES):
        raise CommandError(
            errors.CONFLICT,
            f"a server is already {m.state} (config {m.current_config()}); use restart to swap",
        )
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
    swap = m.swaps.current
    if msg.boot and swap is not None and swap.rollback_to is None:
        # A resumed swap: what it rolls back to was read with the config it starts.
        rollback: ResolvedConfig | None = msg.last_good
        if rollback is not None and rollback.name == (swap.rollback_name or m.last_good_config):
            swap.rollback_to = rollback
    m.host.cancel_retry()
    m.failures, m.crash_loop = 0, False
    m.set_intent(cfg.name, True)
    m.begin_attempt(cfg, rollback=swap is not None and swap.phase == SwapPhase.ROLLING_BACK)
    return {"accepted": True, "config": cfg.name, "state": str(m.state)}


def stop(m: Machine, msg: StopRequested) -> dict[str, Any]:
    # Stop wins: whatever was asked before it and is still on its way (a preflight that
    # finishes later) is refused when it arrives.
    m.stop_ticket = max(m.stop_ticket, msg.ticket)
    m.set_intent(m.intent_config, False)
    m.booting.stop()  # a boot under way starts nothing (the previous life's server still goes)
    if m.swaps.active() is not None:
        m.swaps.settle(
            "failed", "requested_stop", "stopped on request during the swap", m.intent_config
        )
    launch = m.launch
    if m.state in (ServerState.FAILED, ServerState.BACKOFF) or (
        m.state == ServerState.WAITING_GPU and (launch is None or not launch.spawning)
    ):
        m.host.cancel_retry()
        m.host.cancel_gpu_wait()
        # FAILED|BACKOFF|WAITING_GPU -> STOPPED
        m.transition(ServerState.STOPPED, reason="requested_stop")
    elif m.state != ServerState.STOPPED and launch is not None:
        m.begin_stop(launch, Next.STOP)
    # The grace a waiting client bounds its wait by (SIGTERM, then SIGKILL after it).
    return {"accepted": True, "state": str(m.state), "grace_s": m.settings.stop.grace_s}


def restart(m: Machine, msg: RestartRequested) -> dict[str, Any]:
    m.booting.command("restart")
    cancelled_by_stop(m, msg.ticket, "restart")
    m.swaps.refuse_if_under_way(m.active_sweep, msg.sweep_id)
    cfg = msg.resolved
    if cfg is None:
        raise CommandError(errors.INVALID_CONFIG, f"config {msg.config!r} was not read")
    current = m.current_config()
    serving = m.serving()
    if msg.ensure and serving is not None and m.state == ServerState.READY and current == cfg.name:
        return {"accepted": True, "config": cfg.name, "state": str(m.state), "swap_id": None}
    if serving is not None and serving.on_probation:
        # A swap away from a config on probation: its probation counts as passed, and it is
        # what this swap rolls back to (it was serving, not the older last-good); a config a
        # sweep measures never becomes last-good.
        serving.on_probation = False
        if m.may_be_last_good(serving):
            m.last_good_config, m.last_good_launch = serving.config.name, serving.launch_id
            m.event("probation_passed", detail="a swap began while it served")
    swap = m.swaps.begin(
        cfg,
        current=current,
        serving=serving,
        last_good_config=m.last_good_config,
        last_good=msg.last_good,
        seq=m.launch_seq,
        now=m.clock.time(),
    )
    m.failures, m.crash_loop = 0, False
    m.set_intent(cfg.name, True)
    launch = m.launch
    if (
        m.state in (*RUNNING_STATES, ServerState.WAITING_GPU)
        and launch is not None
        and (m.state != ServerState.WAITING_GPU or launch.spawning)
    ):
        m.begin_stop(launch, Next.RELAUNCH, next_config=cfg)
    else:
        m.host.cancel_retry()
        m.host.cancel_gpu_wait()
        m.begin_attempt(cfg)
    return {"accepted": True, "config": cfg.name, "state": str(m.state), "swap_id": swap.id}


def shutdown(m: Machine, msg: ShutdownRequested) -> None:
    if m.booting.shutdown_waits():  # the daemon ends once the previous server is stopped
        return
    launch = m.launch
    if launch is not None and (m.state in RUNNING_STATES or launch.spawning):
        m.begin_stop(launch, Next.SHUTDOWN)
        return
    m.host.cancel_retry()
    m.host.cancel_gpu_wait()
    m.finished = True
    m.persist()


def sweep_began(m: Machine, msg: SweepBegan) -> None:
    m.active_sweep, m.sweep_restore_to = msg.sweep_id, msg.restore_to
    m.persist()  # on record: a later life ends it (sweep_interrupted)


def sweep_ended(m: Machine, msg: SweepEnded) -> None:
    if m.active_sweep == msg.sweep_id:
        m.active_sweep, m.sweep_restore_to = None, None
        m.persist()


def refuse(m: Machine, name: str | None, detail: str) -> None:
    """A start whose preflight failed (or whose config no longer reads): `failed`."""
    m.intent_config, m.intent_running = name, True
    m.ledger.note_exit("preflight_refused", detail)
    m.event("preflight_refused", config=name, detail=detail)
    if m.state != ServerState.FAILED:
        m.transition(ServerState.FAILED, reason="preflight_refused")  # STOPPED|BACKOFF -> FAILED
    m.persist()
