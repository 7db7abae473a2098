"""The server's states and the one table of transitions between them. Stdlib only."""

from __future__ import annotations

from enum import StrEnum


class ServerState(StrEnum):
    STOPPED = "stopped"
    WAITING_GPU = "waiting_gpu"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"


S = ServerState

# from-state -> the states it may move to. The machine changes state in one place
# (`Machine._transition`), which refuses anything not listed here. A running server never goes
# straight to backoff or failed: its exit is swept in stopping first.
TRANSITIONS: dict[ServerState, frozenset[ServerState]] = {
    # start requested; or its preflight failed
    S.STOPPED: frozenset({S.WAITING_GPU, S.FAILED}),
    # GPUs free and the server executed -> starting; stop -> stopped; gpu_busy or the exec
    # failed -> backoff/failed; a stop or swap while the exec is under way -> stopping (the new
    # process is stopped as soon as it exists)
    S.WAITING_GPU: frozenset({S.STARTING, S.STOPPED, S.STOPPING, S.BACKOFF, S.FAILED}),
    # ready; a stop, a swap, a timeout or an exit (stopping, to sweep)
    S.STARTING: frozenset({S.READY, S.STOPPING}),
    # failing probes; a stop, a swap, a lost rank or an exit
    S.READY: frozenset({S.UNHEALTHY, S.STOPPING}),
    # entered at the failure that reaches `health.failures`, and left at once: the launch is
    # ended for the restart policy (a server is not taken back after that many failures)
    S.UNHEALTHY: frozenset({S.STOPPING}),
    # the stop finished: stopped, or on to the next launch (waiting_gpu), backoff or failed
    S.STOPPING: frozenset({S.STOPPED, S.WAITING_GPU, S.BACKOFF, S.FAILED}),
    S.BACKOFF: frozenset({S.WAITING_GPU, S.STOPPED, S.FAILED}),
    S.FAILED: frozenset({S.WAITING_GPU, S.STOPPED}),
}

# States in which a server process of ours may be running.
RUNNING_STATES = frozenset({S.STARTING, S.READY, S.UNHEALTHY, S.STOPPING})

# Between a server's end and the next one's exec: what changes here is superseded within
# milliseconds by the exec's outcome, so saving it may wait a little (the restart path is not
# made to share the interpreter with a state file's encoding).
RELAUNCH_STATES = frozenset({S.STOPPING, S.BACKOFF, S.WAITING_GPU})
# From the exit's sweep on: the records of these states are written right after the next exec.
# (Not stopping's: that an exit was seen is reported at once.)
HOLD_RECORDS_STATES = frozenset({S.BACKOFF, S.WAITING_GPU})


class TransitionError(RuntimeError):
    pass


def check_transition(old: ServerState, new: ServerState) -> None:
    if new not in TRANSITIONS[old]:
        raise TransitionError(f"no transition {old} -> {new}")


class SwapPhase(StrEnum):
    """Where a restart or swap is (status's `swap.phase`)."""

    STOPPING = "stopping"  # the serving launch is being stopped
    WAITING_GPU = "waiting_gpu"  # the new config's GPUs are awaited
    STARTING = "starting"  # the new config's server runs, not ready yet
    ROLLING_BACK = "rolling_back"  # it failed: the config that served before is starting
    DONE = "done"  # settled: ready, rolled back or failed


P = SwapPhase

# The swap's phase changes in one place too (`Machine._set_phase`), checked against this.
PHASES: dict[SwapPhase, frozenset[SwapPhase]] = {
    # the old server is gone -> the new config's GPU wait; its first start failed (a rollback);
    # a stop settles it
    P.STOPPING: frozenset({P.WAITING_GPU, P.ROLLING_BACK, P.DONE}),
    P.WAITING_GPU: frozenset({P.STARTING, P.ROLLING_BACK, P.DONE}),
    P.STARTING: frozenset({P.ROLLING_BACK, P.DONE}),
    # the rollback's launch is ready, failed, or stopped
    P.ROLLING_BACK: frozenset({P.DONE}),
    # settled for good (a config that fails its probation later rolls back as a swap of its own)
    P.DONE: frozenset(),
}


def check_phase(old: SwapPhase, new: SwapPhase) -> None:
    if new not in PHASES[old]:
        raise TransitionError(f"no swap phase {old} -> {new}")
