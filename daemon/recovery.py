"""The machine's recovery: a helper task that raised, a message whose handling raised. Each is
recorded, then the machine goes on as if the failure had been reported, so it never waits for
a message that will not come. Decisions of the machine (`machine.py` dispatches to them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import commands, restoring
from . import messages as ms
from .policy import Classification
from .states import LIVE_STATES, ServerState

if TYPE_CHECKING:
    from .machine import Machine


def on_task_failed(m: Machine, msg: ms.TaskFailed) -> None:
    """A helper task raised (descriptors exhausted, /proc unreadable, a bug): record it,
    then recover as if it had reported failure, so the machine never waits for a message
    that will not come."""
    m.ledger.internal_errors += 1
    m.event("internal_error", task=msg.name, error=msg.error)
    launch = m.current(msg.gen)
    evidence = f"the {msg.name} task failed: {msg.error}"
    match msg.name:
        case "after_exit":  # the exit is handled unswept (the next GPU wait kills leftovers)
            if launch is not None and launch.exited:
                m.on_sweep_finished(ms.SweepFinished(msg.gen, []))
        case "spawn":  # no process came of it
            m.on_spawn_failed(ms.SpawnFailed(msg.gen, "internal_error", evidence))
        case "retry":  # its config read is lost: as a config that did not read
            m.on_backoff_elapsed(ms.BackoffElapsed(msg.gen, None, evidence))
        case "wait_for_gpus":  # retried
            if launch and m.state == ServerState.WAITING_GPU and not launch.spawning:
                m.fail(launch, Classification("internal_error", evidence))
        case "prewarm":  # the swap goes on without it
            swap = m.swaps.active()
            if swap is not None:
                commands.prewarm_ended(m, ms.PrewarmEnded(swap.id, "failed", evidence))
        case "read_startup":  # records of a launch's start (and the caches'): it serves on
            pass
        case "weight_cache" | "stop_weight_cache":  # the sidecar's watch or stop, not the server's
            pass
        case (
            "proxy"
        ):  # the front proxy's connection or start (said, sought again): not the server's
            pass
        case "stop_previous":  # as stopped: the GPU wait kills what holds GPUs
            restoring.boot_go_on(m, "")
        case "boot_start":
            if not m.booting.active:
                return  # a command asked during the boot replaced its start
            m.booting.start_failed()
            if m.state == ServerState.STOPPED:
                m.ledger.note_exit("internal_error", evidence)
                # STOPPED -> FAILED
                m.transition(ServerState.FAILED, reason="internal_error", detail=evidence)
        case _ if launch is not None and launch.running and m.state in LIVE_STATES:
            # A probe loop or timer of this launch is gone: nothing would notice a hang or
            # a timeout any more, so end it and let the restart policy start it afresh.
            m.end_for_retry(launch, "internal_error", evidence)


def recover(m: Machine, message: str, exc: Exception) -> None:
    """An internal message whose handling raised (a bug): say so, and where the launch has
    already exited, go to failed rather than wait in stopping for ever."""
    m.ledger.internal_errors += 1
    evidence = f"handling {message} failed: {type(exc).__name__}: {exc}"
    m.event("internal_error", message=message, error=evidence)
    launch = m.launch
    if m.state == ServerState.STOPPING and (launch is None or launch.exited):
        # STOPPING -> FAILED
        m.transition(ServerState.FAILED, reason="internal_error", detail=evidence)
