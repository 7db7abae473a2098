"""The machine without processes: recording effects (`support/effects.py`) take what it asks
of the world, the test plays the messages the host would post (`support/machine.py`'s
`World`), edge by edge. Every row of `TRANSITIONS` and of `PHASES` is reached from some
message, and nothing else is allowed. Swaps, rollback and probation: `test_machine_swaps.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuwarden.daemon import recovery as machine_recovery
from gpuwarden.daemon import saved
from gpuwarden.daemon.errors import CommandError
from gpuwarden.daemon.messages import (
    BackoffElapsed,
    BootBegan,
    GpuWaitEnded,
    LineParsed,
    PreviousServerStopped,
    PrewarmEnded,
    ProbeFailed,
    ShutdownRequested,
    SpawnFailed,
    StartRequested,
    TaskFailed,
)
from gpuwarden.daemon.model import PreviousServer
from gpuwarden.daemon.preflight import PreflightResult
from gpuwarden.daemon.sglanglines import ParsedLine
from gpuwarden.daemon.states import (
    PHASES,
    TRANSITIONS,
    ServerState,
    SwapPhase,
    TransitionError,
    check_phase,
    check_transition,
)

from .support.machine import FAST, World

# -- the state table ------------------------------------------------------------------------------


def _every_edge(root: Path) -> set[tuple[ServerState, ServerState]]:
    """Drive one fresh machine per scenario; return every state edge they took together."""
    seen: set[tuple[ServerState, ServerState]] = set()

    def world(name: str, **settings: Any) -> World:
        folder = root / name
        folder.mkdir()
        return World(folder, **{**FAST, **settings})

    w = world("refused")  # STOPPED -> FAILED -> WAITING_GPU -> STOPPED; FAILED -> STOPPED
    with pytest.raises(CommandError):
        w.start(ok=False)
    w.start()
    w.stop()
    with pytest.raises(CommandError):
        w.start(ok=False)
    w.stop()
    seen |= w.edges()

    w = world("crash")  # up, crash, backoff, retry; a stop in backoff
    w.up()
    w.exits(1)  # READY -> STOPPING -> BACKOFF
    w.send(BackoffElapsed(w.launch.gen, w.cfg("a")))  # BACKOFF -> WAITING_GPU
    w.gpus_free()
    w.spawned()
    w.exits(1)  # STARTING -> STOPPING -> BACKOFF
    w.stop()  # BACKOFF -> STOPPED
    seen |= w.edges()

    w = world("unloadable")  # the config no longer reads at the retry: as it ran, once more
    w.up()
    w.exits(1)
    ran = w.launch.config
    w.send(BackoffElapsed(w.launch.gen, None, "a.yaml: not valid YAML", unreadable=True))
    assert (w.m.state, w.launch.config) == (ServerState.WAITING_GPU, ran)
    w.stop()
    seen |= w.edges()

    w = world("lost_retry")  # BACKOFF -> FAILED: no config came of the retry (its task failed)
    w.up()
    w.exits(1)
    w.send(BackoffElapsed(w.launch.gen, None, "the retry task failed: RuntimeError"))
    seen |= w.edges()

    w = world("busy", restart={"max_failures": 1})  # WAITING_GPU -> FAILED; STOPPING -> FAILED
    w.start()
    w.send(GpuWaitEnded(w.launch.gen, False, "GPU 0: pid 7 holds 900 MiB"))
    w.start()
    w.gpus_free()
    w.spawned()
    w.exits(1)
    seen |= w.edges()

    w = world("retried")  # WAITING_GPU -> BACKOFF (the exec failed)
    w.start()
    w.gpus_free()
    w.send(SpawnFailed(w.launch.gen, "exec_failed", "cannot execute '/nope'"))
    seen |= w.edges()

    w = world("liveness")  # READY -> UNHEALTHY -> STOPPING
    w.up()
    for _ in range(2):
        w.send(ProbeFailed(w.launch.gen, "connection refused"))
    seen |= w.edges()

    w = world("swap")  # STOPPING -> WAITING_GPU (a restart), WAITING_GPU -> STOPPED
    w.up()
    w.restart("b")
    w.exits(0)
    w.stop()
    seen |= w.edges()

    w = world("adopted")  # STOPPED -> READY: the previous life's server, adopted as it serves
    w.adopt(ready=True)
    seen |= w.edges()

    w = world("adopted-starting")  # STOPPED -> STARTING: adopted while it still starts
    w.adopt(ready=False)
    seen |= w.edges()

    w = world("spawning")  # WAITING_GPU -> STOPPING: a stop while the server is executed
    w.start()
    w.gpus_free()
    reply = w.stop()
    assert reply["state"] == "stopping"  # answered at once: nothing awaited the exec
    w.spawned()  # it exists now: it is stopped at once
    assert w.host.called("terminate")
    w.exits(0)  # STOPPING -> STOPPED
    assert w.m.state == ServerState.STOPPED
    seen |= w.edges()
    return seen


async def test_every_listed_transition_is_reached_and_no_other_is_made(tmp_path: Path) -> None:
    seen = _every_edge(tmp_path)
    listed = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert seen - listed == set()  # the machine made no edge the table does not list
    assert listed - seen == set()  # and the table lists no edge nothing makes


def test_every_unlisted_transition_is_refused() -> None:
    for old in ServerState:
        for new in ServerState:
            if new in TRANSITIONS[old]:
                check_transition(old, new)
            else:
                with pytest.raises(TransitionError):
                    check_transition(old, new)


# -- the swap's phases ----------------------------------------------------------------------------


def _every_phase_edge(root: Path) -> set[tuple[SwapPhase, SwapPhase]]:
    seen: set[tuple[SwapPhase, SwapPhase]] = set()

    def world(name: str, **settings: Any) -> World:
        folder = root / name
        folder.mkdir()
        return World(folder, **settings)

    w = world("ready", **FAST)  # STOPPING -> WAITING_GPU -> STARTING -> DONE
    w.up()
    w.restart("b")
    w.exits(0)
    w.relaunch()
    w.ready()
    assert w.m.swaps.current is not None and w.m.swaps.current.outcome is not None
    assert w.m.swaps.current.outcome["outcome"] == "ready"
    seen |= set(w.phases)

    w = world("first-start", **FAST)  # STARTING -> ROLLING_BACK -> DONE (rolled back)
    w.up()
    w.restart("b")
    w.exits(0)
    w.relaunch()
    w.exits(1)  # b's first start fails: back to a at once
    assert w.m.state == ServerState.WAITING_GPU and w.launch.config.name == "a"
    w.relaunch()
    w.ready()
    assert w.m.swaps.current is not None and w.m.swaps.current.outcome is not None
    assert w.m.swaps.current.outcome["outcome"] == "rolled_back"
    seen |= set(w.phases)

    w = world("gpu-busy", **FAST)  # WAITING_GPU -> ROLLING_BACK
    w.up()
    w.restart("b")
    w.exits(0)
    w.send(GpuWaitEnded(w.launch.gen, False, "GPU 0 busy"))
    seen |= set(w.phases)

    w = world("stop-waiting", **FAST)  # WAITING_GPU -> DONE: stopped in the new GPU wait
    w.up()
    w.restart("b")
    w.exits(0)
    w.stop()
    seen |= set(w.phases)

    w = world("stop-stopping", **FAST)  # STOPPING -> DONE
    w.up()
    w.restart("b")
    w.stop()
    seen |= set(w.phases)

    w = world(
        "probation", restart={"probation_s": 60}
    )  # a failed probation: STOPPING -> ROLLING_BACK
    w.up()
    w.restart("b")
    w.exits(0)
    w.relaunch()
    w.ready()
    assert w.launch.on_probation
    w.exits(1)
    assert w.m.swaps.current is not None and w.m.swaps.current.phase == SwapPhase.ROLLING_BACK
    assert w.m.intent.config == "a"
    seen |= set(w.phases)

    w = world("prewarm", **FAST)  # PREWARMING -> STOPPING: the read is over, a is stopped
    w.up()
    w.restart("b", weights=(w.root / "w.safetensors",))
    w.send(PrewarmEnded(w.swap.id, "done", "read"))
    seen |= set(w.phases)

    w = world("prewarm-exit", **FAST)  # PREWARMING -> WAITING_GPU: a ended first
    w.up()
    w.restart("b", weights=(w.root / "w.safetensors",))
    w.exits(0)
    w.send(BackoffElapsed(w.launch.gen, w.cfg("b")))
    seen |= set(w.phases)

    w = world("prewarm-stop", **FAST)  # PREWARMING -> DONE: stopped while it reads
    w.up()
    w.restart("b", weights=(w.root / "w.safetensors",))
    w.stop()
    seen |= set(w.phases)
    return seen


async def test_every_listed_phase_change_is_reached_and_no_other_is_made(tmp_path: Path) -> None:
    seen = _every_phase_edge(tmp_path)
    listed = {(a, b) for a, targets in PHASES.items() for b in targets}
    assert seen - listed == set()
    assert listed - seen == set()


def test_every_unlisted_phase_change_is_refused() -> None:
    for old in SwapPhase:
        for new in SwapPhase:
            if new in PHASES[old]:
                check_phase(old, new)
            else:
                with pytest.raises(TransitionError):
                    check_phase(old, new)


# -- decisions, one by one ------------------------------------------------------------------------


async def test_a_crash_is_retried_after_the_backoff_with_the_config_read_again(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, **FAST)
    w.up()
    gen = w.launch.gen
    w.exits(1)
    assert w.m.state == ServerState.BACKOFF and w.m.retries.failures == 1
    [(delay, retry_gen, name)] = w.host.called("retry_after")
    assert retry_gen == gen and name == "a" and delay >= 0
    w.send(BackoffElapsed(gen, w.cfg("a")))
    assert w.m.state == ServerState.WAITING_GPU and w.m.retries.restarts == 1
    assert w.host.called("wait_for_gpus")[-1][0] is w.launch


async def test_a_stop_wins_over_a_start_asked_for_before_it(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    early = w.next_ticket()  # a start asked for, its preflight still running
    w.stop()
    msg = StartRequested("a", preflight=PreflightResult(ok=True), resolved=w.cfg("a"), ticket=early)
    with pytest.raises(CommandError) as refused:
        w.send(msg)
    assert refused.value.error == "conflict"
    assert w.m.state == ServerState.STOPPED


async def test_a_death_line_ends_the_launch_at_once(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.up()
    line = "[2026-01-01 00:00:00] Subprocess scheduler_0 (pid=9) crashed with exit code -9."
    w.send(LineParsed(w.launch.gen, ParsedLine(death=True), line))
    assert w.m.state == ServerState.STOPPING
    assert w.host.called("kill_group")  # no grace: it is dead already
    assert not w.host.called("terminate")


async def test_a_shutdown_while_running_finishes_after_the_sweep(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.up()
    w.send(ShutdownRequested())
    assert not w.m.finished and w.m.state == ServerState.STOPPING
    w.exits(0)
    assert w.m.finished and w.m.state == ServerState.STOPPED
    assert w.m.intent.running  # the saved intent is kept for the next life


async def test_a_sweep_step_for_the_config_already_ready_does_nothing(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.up()
    reply = w.restart("a", ensure=True)
    assert reply["swap_id"] is None and w.m.state == ServerState.READY
    assert w.m.swaps.current is None


async def test_a_lost_retry_task_fails_the_attempt_instead_of_waiting_for_ever(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, **FAST)
    w.up()
    w.exits(1)
    assert w.m.state == ServerState.BACKOFF
    w.send(TaskFailed("retry", w.launch.gen, "RuntimeError: cannot schedule new futures"))
    assert w.m.state == ServerState.FAILED
    assert (
        w.m.ledger.last_exit is not None and "retry task failed" in w.m.ledger.last_exit["evidence"]
    )


def test_the_tasks_the_machine_recovers_from_are_the_hosts_own() -> None:
    """`TaskFailed` names a task by its coroutine's name: every name the machine's recovery
    looks for must be a task the host (or the boot) really runs, or that recovery never fires."""
    import inspect  # noqa: PLC0415
    import re  # noqa: PLC0415

    from gpuwarden.daemon import host  # noqa: PLC0415

    recovery = inspect.getsource(machine_recovery.on_task_failed)
    looked_for = set(re.findall(r'case "([a-z_]+)":', recovery))
    assert looked_for, "the machine recovers from no named task"

    def task_names(module: Any) -> set[str]:
        source = inspect.getsource(module)
        return {n.lstrip("_") for n in re.findall(r"async def (\w+)\(", source)}

    # The host and what it is composed of: the modules of its parts, and boot.py's.
    composed = [inspect.getmodule(v) for v in vars(host).values() if inspect.isclass(v)]
    modules = {host, *composed, *(v for v in vars(host).values() if inspect.ismodule(v))}
    ours = [m for m in modules if m is not None and m.__name__.startswith("gpuwarden.daemon.")]
    runs = set().union(*(task_names(m) for m in ours))
    assert looked_for <= runs, f"recovered but never run: {sorted(looked_for - runs)}"


# -- the boot -------------------------------------------------------------------------------------


def _saved_record() -> dict[str, Any]:
    return {
        "intent": {"config": "a", "running": True},
        "last_good_config": "a",
        "failures": 1,
        "launch_seq": 3,
        "launches": [{"launch_id": "L3", "config": "a", "exit": None}],
    }


PREVIOUS = PreviousServer(4242, 4242, 1.5, "L3", "tok", alive=True)


def _boot_start(w: World, name: str = "a") -> Any:
    pre = PreflightResult(ok=True, problems=[])
    return w.send(StartRequested(name, boot=True, preflight=pre, resolved=w.cfg(name)))


def test_boot_stops_the_previous_server_then_starts_the_saved_intent(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.send(BootBegan(_saved_record(), None, PREVIOUS))
    assert w.m.booting.active and w.m.intent.config == "a" and w.m.retries.failures == 1
    assert w.host.called("stop_previous") == [(PREVIOUS,)]
    assert not w.host.called("boot_start")  # not while that server may hold port and GPUs
    w.send(PreviousServerStopped(PREVIOUS, []))
    assert w.host.called("boot_start") == [("a", None)]
    assert w.m.ledger.history.entries()[0]["exit"]["reason"] == "requested_stop"
    _boot_start(w)
    assert not w.m.booting.active and w.m.state == ServerState.WAITING_GPU


def test_a_stop_during_the_boot_wins_over_its_start(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.send(BootBegan(_saved_record(), None, PREVIOUS))
    w.stop()
    assert w.m.intent.running is False and w.m.booting.active  # still stopping that server
    w.send(PreviousServerStopped(PREVIOUS, []))
    assert not w.m.booting.active and not w.host.called("boot_start")
    assert w.m.state == ServerState.STOPPED


def test_a_start_asked_once_the_previous_server_is_gone_replaces_the_boots(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, **FAST)
    w.send(BootBegan(_saved_record(), None, None))  # nothing of that life runs
    assert w.host.called("boot_start") == [("a", None)]
    w.start("b")  # while the boot reads and preflights a
    with pytest.raises(CommandError, match="replaced it"):
        _boot_start(w)
    assert w.launch.config.name == "b" and w.m.intent.config == "b"


def test_a_start_while_the_previous_server_is_stopped_is_refused(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.send(BootBegan(_saved_record(), None, PREVIOUS))
    with pytest.raises(CommandError, match="pid 4242"):
        w.start("b")
    with pytest.raises(CommandError, match="pid 4242"):
        w.restart("b")


def test_a_shutdown_during_the_previous_servers_stop_ends_once_it_is_stopped(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, **FAST)
    w.send(BootBegan(_saved_record(), None, PREVIOUS))
    w.send(ShutdownRequested())
    assert not w.m.finished  # the previous server is not left half-stopped
    w.send(PreviousServerStopped(PREVIOUS, []))
    assert w.m.finished and not w.host.called("boot_start")
    assert w.m.intent.running is True  # a shutdown keeps the intent for the next life


def test_a_failed_stop_of_the_previous_server_goes_on_with_the_boot(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.send(BootBegan(_saved_record(), None, PREVIOUS))
    w.send(TaskFailed("stop_previous", 0, "OSError: /proc unreadable"))
    assert w.host.called("boot_start") == [("a", None)]  # the GPU wait sweeps what holds GPUs


def test_a_refused_start_during_the_boots_read_leaves_the_boot_going_on(tmp_path: Path) -> None:
    """A start refused (here: the previous life's swap, resumed, is under way) changes
    nothing: the boot's own start still comes and is carried out. Before, the refused start
    ended the boot first, leaving the daemon stopped with a swap that never settled."""
    w = World(tmp_path, **FAST)
    record = {
        **_saved_record(),
        "intent": {"config": "b", "running": True},
        "swap": {
            "id": "swap-4-1",
            "from": "a",
            "to": "b",
            "phase": "waiting_gpu",
            "rollback_name": "a",
        },
    }
    w.send(BootBegan(record, None, None))
    assert w.host.called("boot_start") == [("b", "a")]
    with pytest.raises(CommandError, match="is under way"):
        w.start("c")
    assert w.m.booting.active
    _boot_start(w, "b")
    assert not w.m.booting.active and w.launch.config.name == "b"
    assert w.swap is not None and w.swap.active  # the resumed swap goes on


def test_the_previous_servers_record_stays_saved_until_it_is_stopped(tmp_path: Path) -> None:
    """A daemon that dies while it stops its previous life's server must find that server
    on record at its next start."""
    w = World(tmp_path, **FAST)
    current = {"launch_id": "L3", "pid": 4242, "pgid": 4242, "token": "tok", "boot_id": "b"}
    w.send(BootBegan({**_saved_record(), "current_launch": current}, None, PREVIOUS))
    assert saved.record(w.m, "b")["current_launch"] == current
    w.send(PreviousServerStopped(PREVIOUS, []))
    assert saved.record(w.m, "b")["current_launch"] is None


def test_a_failed_boot_read_after_a_stop_during_it_leaves_it_stopped(
    tmp_path: Path,
) -> None:
    """A stop during the boot's read, then that read's task fails: the stop stands (before,
    the daemon went `failed` with `internal_error`)."""
    w = World(tmp_path, **FAST)
    w.send(BootBegan(_saved_record(), None, None))
    w.stop()
    w.send(TaskFailed("boot_start", 0, "OSError: gone"))
    assert w.m.state == ServerState.STOPPED and w.m.intent.running is False
