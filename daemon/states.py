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

# from-state -> the states it may move to. The supervisor changes state in one place
# (`Supervisor._transition`), which refuses anything not listed here.
TRANSITIONS: dict[ServerState, frozenset[ServerState]] = {
    # start requested; or its preflight failed
    S.STOPPED: frozenset({S.WAITING_GPU, S.FAILED}),
    # GPUs free -> starting; stop -> stopped; gpu_busy -> backoff/failed
    S.WAITING_GPU: frozenset({S.STARTING, S.STOPPED, S.BACKOFF, S.FAILED}),
    # ready; a stop or swap (stopping); exit/timeout (stopping to sweep, then backoff/failed)
    S.STARTING: frozenset({S.READY, S.STOPPING, S.BACKOFF, S.FAILED}),
    S.READY: frozenset({S.UNHEALTHY, S.STOPPING, S.BACKOFF, S.FAILED}),
    S.UNHEALTHY: frozenset({S.READY, S.STOPPING, S.BACKOFF, S.FAILED}),
    # the stop finished: stopped, or on to the next launch (waiting_gpu), backoff or failed
    S.STOPPING: frozenset({S.STOPPED, S.WAITING_GPU, S.BACKOFF, S.FAILED}),
    S.BACKOFF: frozenset({S.WAITING_GPU, S.STOPPED, S.FAILED}),
    S.FAILED: frozenset({S.WAITING_GPU, S.STOPPED}),
}

# States in which a server process of ours may be running.
RUNNING_STATES = frozenset({S.STARTING, S.READY, S.UNHEALTHY, S.STOPPING})
# States that end a restart or swap one way or another (waiters wake on them).
SETTLED_STATES = frozenset({S.READY, S.STOPPED, S.FAILED, S.BACKOFF})


class TransitionError(RuntimeError):
    pass


def check_transition(old: ServerState, new: ServerState) -> None:
    if new not in TRANSITIONS[old]:
        raise TransitionError(f"no transition {old} -> {new}")
