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


# from-state -> the states it may move to. The machine changes state in one place
# (`Machine._transition`), which refuses anything not listed here. A running server never goes
# straight to backoff or failed: its exit is swept in stopping first.
TRANSITIONS: dict[ServerState, frozenset[ServerState]] = {
    # start requested; or its preflight failed; at the boot, the previous life's server adopted
    # in the state it was in (live restore)
    ServerState.STOPPED: frozenset(
        {ServerState.WAITING_GPU, ServerState.FAILED, ServerState.STARTING, ServerState.READY}
    ),
    # GPUs free and the server executed -> starting; stop -> stopped; gpu_busy or the exec
    # failed -> backoff/failed; a stop or swap while the exec is under way -> stopping (the new
    # process is stopped as soon as it exists)
    ServerState.WAITING_GPU: frozenset(
        {
            ServerState.STARTING,
            ServerState.STOPPED,
            ServerState.STOPPING,
            ServerState.BACKOFF,
            ServerState.FAILED,
        }
    ),
    # ready; a stop, a swap, a timeout or an exit (stopping, to sweep)
    ServerState.STARTING: frozenset({ServerState.READY, ServerState.STOPPING}),
    # failing probes; a stop, a swap, a lost rank or an exit
    ServerState.READY: frozenset({ServerState.UNHEALTHY, ServerState.STOPPING}),
    # entered at the failure that reaches `health.failures`, and left at once: the launch is
    # ended for the restart policy (a server is not taken back after that many failures)
    ServerState.UNHEALTHY: frozenset({ServerState.STOPPING}),
    # the stop finished: stopped, or on to the next launch (waiting_gpu), backoff or failed
    ServerState.STOPPING: frozenset(
        {ServerState.STOPPED, ServerState.WAITING_GPU, ServerState.BACKOFF, ServerState.FAILED}
    ),
    ServerState.BACKOFF: frozenset(
        {ServerState.WAITING_GPU, ServerState.STOPPED, ServerState.FAILED}
    ),
    ServerState.FAILED: frozenset({ServerState.WAITING_GPU, ServerState.STOPPED}),
}

# States in which a server process of ours may be running.
RUNNING_STATES = frozenset(
    {ServerState.STARTING, ServerState.READY, ServerState.UNHEALTHY, ServerState.STOPPING}
)

# States in which a server of ours runs and is not being stopped: its probes and timers watch it.
LIVE_STATES = RUNNING_STATES - {ServerState.STOPPING}
# States in which a server of ours serves requests (ready, or ready and failing probes).
SERVING_STATES = frozenset({ServerState.READY, ServerState.UNHEALTHY})

# Between a server's end and the next one's exec: what changes here is superseded within
# milliseconds by the exec's outcome, so saving it may wait a little (the restart path is not
# made to share the interpreter with a state file's encoding).
RELAUNCH_STATES = frozenset({ServerState.STOPPING, ServerState.BACKOFF, ServerState.WAITING_GPU})
# From the exit's sweep on: the records of these states are written right after the next exec.
# (Not stopping's: that an exit was seen is reported at once.)
HOLD_RECORDS_STATES = frozenset({ServerState.BACKOFF, ServerState.WAITING_GPU})


class TransitionError(RuntimeError):
    pass


def check_transition(old: ServerState, new: ServerState) -> None:
    if new not in TRANSITIONS[old]:
        raise TransitionError(f"no transition {old} -> {new}")


class SwapPhase(StrEnum):
    """Where a restart or swap is (status's `swap.phase`)."""

    PREWARMING = "prewarming"  # the old server serves on while the new weights are read
    STOPPING = "stopping"  # the serving launch is being stopped
    WAITING_GPU = "waiting_gpu"  # the new config's GPUs are awaited
    STARTING = "starting"  # the new config's server runs, not ready yet
    ROLLING_BACK = "rolling_back"  # it failed: the config that served before is starting
    DONE = "done"  # settled: ready, rolled back or failed


# The swap's phase changes in one place too (`Machine._set_phase`), checked against this.
PHASES: dict[SwapPhase, frozenset[SwapPhase]] = {
    # read -> the old server is stopped; it ended on its own meanwhile -> the new config's GPU
    # wait; a stop settles it
    SwapPhase.PREWARMING: frozenset({SwapPhase.STOPPING, SwapPhase.WAITING_GPU, SwapPhase.DONE}),
    # the old server is gone -> the new config's GPU wait; its first start failed (a rollback);
    # a stop settles it
    SwapPhase.STOPPING: frozenset({SwapPhase.WAITING_GPU, SwapPhase.ROLLING_BACK, SwapPhase.DONE}),
    SwapPhase.WAITING_GPU: frozenset({SwapPhase.STARTING, SwapPhase.ROLLING_BACK, SwapPhase.DONE}),
    SwapPhase.STARTING: frozenset({SwapPhase.ROLLING_BACK, SwapPhase.DONE}),
    # the rollback's launch is ready, failed, or stopped
    SwapPhase.ROLLING_BACK: frozenset({SwapPhase.DONE}),
    # settled for good (a config that fails its probation later rolls back as a swap of its own)
    SwapPhase.DONE: frozenset(),
}


def check_phase(old: SwapPhase, new: SwapPhase) -> None:
    if new not in PHASES[old]:
        raise TransitionError(f"no swap phase {old} -> {new}")
