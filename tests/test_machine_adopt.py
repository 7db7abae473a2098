"""Live restore, the machine's side: the previous life's server, verified under the shim by the
boot (`boot.py`), is taken over in the state it was in, with no signal sent to it."""

from __future__ import annotations

from pathlib import Path

from gpuwarden.daemon import saved
from gpuwarden.daemon.messages import BootBegan, ServerExited, StartupTimedOut, SweepFinished
from gpuwarden.daemon.model import utc_iso
from gpuwarden.daemon.states import ServerState, SwapPhase

from .support.machine import FAST, World


def test_a_ready_server_is_adopted_ready_and_watched_as_ready(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    adoptee = w.adopt(ready=True)
    assert w.m.state == ServerState.READY and not w.m.booting.active
    launch = w.launch
    assert launch.child is adoptee.server and launch.launch_id == "L3" and launch.token == "tok"
    assert w.host.called("adopt") == [(launch,)]
    # Nothing signals it, nothing starts anew, and no GPU wait or boot start is asked for.
    for step in (
        "terminate",
        "kill_group",
        "spawn",
        "wait_for_gpus",
        "boot_start",
        "stop_previous",
    ):
        assert not w.host.called(step), step
    assert [c[1] for c in w.host.called("probe")] == [False]  # liveness
    assert w.host.events("adopted")[0]["pid"] == adoptee.server.pid
    # Its record stays unfinished (it runs) and the next save names it as running.
    assert w.m.ledger.history.entries()[0]["exit"] is None
    assert saved.record(w.m, "b")["current_launch"]["launch_id"] == "L3"


def test_a_starting_server_goes_on_starting_with_what_is_left_of_its_timeout(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, **FAST)
    w.adopt(ready=False)  # started 100 s ago; startup_timeout_s is 30 s
    assert w.m.state == ServerState.STARTING
    timers = [(s, m) for s, m, _ in w.host.called("timer") if isinstance(m, StartupTimedOut)]
    assert timers and timers[0][0] == 1.0  # overdue already: it gets a last second
    assert [c[1] for c in w.host.called("probe")] == [True]  # readiness
    w.ready()
    assert w.m.state == ServerState.READY


def test_a_server_that_exited_while_the_daemon_was_away_gets_its_exact_code(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, **FAST)
    adoptee = w.adopt(ready=True, exited=3)
    gen = w.launch.gen
    w.send(ServerExited(gen, 3))  # the handle reports the shim's record at once
    w.send(SweepFinished(gen, []))
    last = w.m.ledger.last_exit
    assert last is not None and last["code"] == 3 and last["reason"] != "ended_unobserved"
    assert adoptee.exited_at is not None
    assert last["at"] == utc_iso(adoptee.exited_at)  # when it ended, not when it was seen
    assert w.m.ledger.history.entries()[0]["exit"]["code"] == 3
    assert w.m.state == ServerState.BACKOFF  # classified and retried as any crash


def test_a_server_not_of_the_intended_config_is_stopped_as_before(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    intent = {"intent": {"config": "b", "running": True}}
    adoptee = w.adopt("a", record=intent)
    assert w.m.launch is None and w.m.booting.active
    (prev,) = w.host.called("stop_previous")[0]
    assert prev.pid == adoptee.server.pid and prev.launch_id == "L3"


def test_a_swap_on_probation_goes_on_with_its_probation(tmp_path: Path) -> None:
    w = World(tmp_path, restart={"probation_s": 60})
    swap = {"id": "swap-3-1", "from": "a", "to": "b", "phase": "probation", "rollback_name": "a"}
    record = {"swap": swap, "last_good_config": "a"}
    w.adopt("b", ready=True, record=record)
    launch = w.launch
    assert w.m.state == ServerState.READY and launch.on_probation
    assert launch.swap is not None and launch.swap.phase == SwapPhase.DONE
    w.probation_over()
    assert w.m.intent.last_good_config == "b" and not launch.on_probation


def test_unmanaged_processes_are_listed_and_never_signalled(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    found = ({"pid": 777, "name": "sleep", "why": "pid reused"},)
    w.send(BootBegan({}, None, None, unmanaged=found))
    assert w.m.ledger.unmanaged == [dict(found[0])]
    assert w.host.events("unmanaged_process")[0]["pid"] == 777
    assert not w.host.called("stop_previous") and not w.host.called("kill_group")


def test_a_server_that_was_being_stopped_is_not_adopted_but_stopped(tmp_path: Path) -> None:
    """The previous life died while it stopped its server for a restart: that server is not
    taken for the one asked to run (it is on its way out); it is stopped, then the boot starts."""
    w = World(tmp_path, **FAST)
    adoptee = w.adopt("a", stopping=True)
    assert w.m.launch is None and w.m.booting.active
    (prev,) = w.host.called("stop_previous")[0]
    assert prev.pid == adoptee.server.pid


def test_an_adopted_launch_is_saved_as_it_was_launched_not_as_its_config_reads_now(
    tmp_path: Path,
) -> None:
    """Its config edited since it was launched: a later life verifies it by what it runs."""
    w = World(tmp_path, **FAST)
    adoptee = w.adopt("a", recorded={"argv_digest": "d-launched", "config_hash": "h-launched"})
    current = saved.record(w.m, "b")["current_launch"]
    assert (current["argv_digest"], current["config_hash"]) == ("d-launched", "h-launched")
    assert adoptee.config_changed and w.host.events("adopted")[0]["config_changed"] is True


def test_an_adoptee_that_ended_away_is_not_watched_as_ready(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.adopt(ready=True, exited=3)
    assert not w.host.called("probe") and not w.host.called("refresh_gpus")
