"""Swaps, rollback and probation in the machine, without processes: recording effects take what
it asks of the world and the test plays the messages a host would post (`support/machine.py`'s
`World`). The same behaviour through the HTTP API and real stand-ins is in `test_api` and
`test_cli`; the phase table itself is in `test_machine`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuwarden.daemon.messages import ProbationOver, SweepBegan, SweepEnded
from gpuwarden.daemon.states import ServerState, SwapPhase

from .support.machine import FAST, World

PROBATION = {"restart": {"probation_s": 60}}


def _swapped_in(w: World, name: str) -> str:
    """A swap to `name` from the config serving: the old one exits on request, the new one is
    executed (not ready yet). Its launch id."""
    w.restart(name)
    w.exits(0)
    assert w.m.state == ServerState.WAITING_GPU and w.launch.config.name == name
    w.relaunch()
    assert w.m.state == ServerState.STARTING
    return w.launch.launch_id


def _settled(w: World) -> list[dict[str, Any]]:
    """Each outcome the machine handed to callers waiting on a swap, in order."""
    return [outcome for _, outcome in w.host.called("swap_settled")]


# -- rollback -------------------------------------------------------------------------------------


def test_a_swap_whose_config_crashes_on_its_first_start_rolls_back_to_the_one_that_served(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, **FAST)
    w.up("a")
    served = w.launch.launch_id
    failed = _swapped_in(w, "b")
    assert w.m.intent.config == "b"
    w.exits(1)  # b dies before it is ready: back to a at once, no backoff
    assert (
        w.m.state == ServerState.WAITING_GPU and w.launch.config.name == "a" and w.launch.rollback
    )
    assert (w.m.intent.config, w.m.intent.running) == ("a", True)
    assert not w.host.called("retry_after") and ServerState.BACKOFF not in {b for _, b in w.edges()}
    [rollback] = w.host.events("rollback")
    assert rollback["swap_id"] == w.swap.id
    assert (rollback["from_config"], rollback["to_config"]) == ("b", "a")
    assert rollback["reason"] == "crash" and rollback["evidence"]
    assert w.swap.phase == SwapPhase.ROLLING_BACK and not _settled(w)  # not settled yet
    w.relaunch()
    back = w.launch.launch_id
    w.ready()
    assert w.m.state == ServerState.READY and w.launch.config.name == "a"
    [outcome] = _settled(w)
    assert outcome == {
        "outcome": "rolled_back",
        "reason": "crash",
        "evidence": rollback["evidence"],
        "launch_ids": [failed, back],
        "swap_id": w.swap.id,
        "config": "a",
    }
    assert w.swap.phase == SwapPhase.DONE
    # The counts: one swap, one rollback; neither a restart nor a failure of the policy's.
    assert (w.m.swaps.count, w.m.swaps.rollbacks, w.m.retries.restarts, w.m.retries.failures) == (
        1,
        1,
        0,
        0,
    )
    assert w.m.swaps.rolled_back_from == "b" and w.m.intent.last_failed_launch == failed
    assert (w.m.intent.last_good_config, w.m.intent.last_good_launch) == ("a", back)
    assert served != back


def test_a_swap_with_nothing_to_roll_back_to_goes_failed(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    reply = w.restart("b")  # nothing ran before: no config served, none is last-good
    assert reply["swap_id"] == w.swap.id
    w.relaunch()
    w.exits(1)
    assert w.m.state == ServerState.FAILED
    assert not w.host.events("rollback") and not w.host.called("retry_after")
    [outcome] = _settled(w)
    assert (outcome["outcome"], outcome["reason"], outcome["config"]) == ("failed", "crash", "b")
    [failed] = [r for r in w.host.events("state") if r["to"] == "failed"]
    assert failed["detail"] == "swap to b failed and there is no last good config"
    assert (w.m.swaps.count, w.m.swaps.rollbacks) == (1, 0)


def test_a_swap_from_a_stopped_server_rolls_back_to_the_last_good_config_read_ahead(
    tmp_path: Path,
) -> None:
    """Nothing serves when the swap begins: it goes back to the last good config, read when the
    swap was asked for; one that did not read then leaves nothing to go back to."""
    w = World(tmp_path, **FAST)
    w.up("a")
    w.stop()
    w.exits(0)
    assert w.m.state == ServerState.STOPPED and w.m.intent.last_good_config == "a"
    w.restart("b", last_good=w.cfg("a"))
    w.relaunch()
    w.exits(1)
    assert (
        w.m.state == ServerState.WAITING_GPU and w.launch.config.name == "a" and w.launch.rollback
    )

    w = World(tmp_path / "unread", **FAST)
    w.up("a")
    w.stop()
    w.exits(0)
    w.restart("b")  # last-good's config was not read with it (missing, invalid)
    w.relaunch()
    w.exits(1)
    assert w.m.state == ServerState.FAILED
    assert _settled(w)[-1]["outcome"] == "failed"
    assert "its rollback config a does not load" in w.host.events("state")[-1]["detail"]


# -- probation ------------------------------------------------------------------------------------


def test_a_crash_inside_probation_rolls_back_with_a_swap_of_its_own(tmp_path: Path) -> None:
    w = World(tmp_path, **PROBATION)
    w.up("a")
    _swapped_in(w, "b")
    w.ready()
    swap = w.swap
    assert w.launch.on_probation and w.m.intent.last_good_config == "a"  # not last-good yet
    [ready] = _settled(w)
    assert (ready["outcome"], ready["swap_id"]) == ("ready", swap.id)
    w.exits(1)  # within probation_s
    own = w.swap
    assert own is not swap and own.id.startswith("rollback-")
    assert (own.from_config, own.to_config, own.phase) == ("b", "a", SwapPhase.ROLLING_BACK)
    assert swap.outcome == ready  # the swap that went ready stays so
    [rollback] = w.host.events("rollback")
    assert rollback["swap_id"] == own.id and rollback["reason"] == "crash"
    assert w.m.state == ServerState.WAITING_GPU and w.launch.config.name == "a"
    assert w.m.intent.config == "a" and not w.host.called("retry_after")
    w.relaunch()
    w.ready()
    assert not w.launch.on_probation  # going back is not a swap to try out
    assert [(o["swap_id"], o["outcome"]) for o in _settled(w)] == [
        (swap.id, "ready"),
        (own.id, "rolled_back"),
    ]
    assert (w.m.intent.last_good_config, w.m.swaps.rollbacks, w.m.swaps.count) == ("a", 1, 1)


def test_probation_passed_makes_the_swapped_in_config_last_good(tmp_path: Path) -> None:
    w = World(tmp_path, **PROBATION)
    w.up("a")
    launched = _swapped_in(w, "b")
    w.ready()
    assert w.m.intent.last_good_config == "a"
    [(seconds, _, launch)] = [t for t in w.host.called("timer") if isinstance(t[1], ProbationOver)]
    assert seconds == 60 and launch is w.launch
    w.probation_over()
    assert (w.m.intent.last_good_config, w.m.intent.last_good_launch) == ("b", launched)
    assert not w.launch.on_probation
    [passed] = w.host.events("probation_passed")
    assert passed["probation_s"] == 60 and passed["config"] == "b"
    w.exits(1)  # past its probation, a crash is the restart policy's
    assert w.m.state == ServerState.BACKOFF and not w.host.events("rollback")


def test_a_swap_begun_during_anothers_probation_passes_it_and_rolls_back_to_it(
    tmp_path: Path,
) -> None:
    """a (last-good) -> b (ready, on probation) -> c fails its first start: back to b, which
    the swap to c made last-good, not to a."""
    w = World(tmp_path, **PROBATION)
    w.up("a")
    b_launch = _swapped_in(w, "b")
    w.ready()
    assert w.launch.on_probation and w.m.intent.last_good_config == "a"
    w.restart("c")
    [passed] = w.host.events("probation_passed")
    assert passed["detail"] == "a swap began while it served"
    assert (w.m.intent.last_good_config, w.m.intent.last_good_launch) == ("b", b_launch)
    assert w.swap.rollback_name == "b"
    w.exits(0)
    w.relaunch()
    w.exits(1)  # c's first start fails
    assert w.launch.config.name == "b" and w.launch.rollback
    assert w.host.events("rollback")[-1]["to_config"] == "b"
    w.relaunch()
    w.ready()
    assert _settled(w)[-1]["outcome"] == "rolled_back"
    assert (w.m.state, w.m.intent.last_good_config) == (ServerState.READY, "b")


# -- a stop during a swap -------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["old config stopping", "new config starting"])
def test_a_stop_during_a_swap_settles_it_failed_requested_stop(tmp_path: Path, when: str) -> None:
    w = World(tmp_path, **FAST)
    w.up("a")
    if when == "old config stopping":
        w.restart("b")
        assert w.m.state == ServerState.STOPPING
    else:
        _swapped_in(w, "b")
    reply = w.stop()
    assert reply["state"] == "stopping"
    [outcome] = _settled(w)
    assert (outcome["outcome"], outcome["reason"]) == ("failed", "requested_stop")
    assert w.swap.phase == SwapPhase.DONE and w.m.intent.running is False
    w.exits(0)
    assert w.m.state == ServerState.STOPPED  # nothing follows: no relaunch, no rollback
    assert not w.host.events("rollback") and len(_settled(w)) == 1
    assert w.m.swaps.rollbacks == 0


# -- sweeps ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("probation_s", [0, 60])
def test_a_sweeps_swaps_never_make_last_good(tmp_path: Path, probation_s: float) -> None:
    """A sweep measures b and c and ends on a: neither becomes last-good, by probation, by a
    swap begun during its probation, or (without probation) by being ready; a may."""
    w = World(tmp_path, restart={"probation_s": probation_s})
    w.up("a")  # started, not swapped in: last-good at once
    first_a = w.launch.launch_id
    assert (w.m.intent.last_good_config, w.m.intent.last_good_launch) == ("a", first_a)
    w.send(SweepBegan("sweep-1", restore_to="a"))
    for name in ("b", "c"):
        w.restart(name, sweep_id="sweep-1", ensure=True)
        w.exits(0)
        w.relaunch()
        w.ready()
        assert w.m.state == ServerState.READY and w.launch.config.name == name
        assert w.launch.on_probation == bool(probation_s)
        assert (w.m.intent.last_good_config, w.m.intent.last_good_launch) == ("a", first_a)
    if probation_s:
        w.probation_over()  # c's probation passes inside the sweep
        assert (w.m.intent.last_good_config, w.m.intent.last_good_launch) == ("a", first_a)
    assert not w.host.events("probation_passed")
    w.restart("a", sweep_id="sweep-1", ensure=True)  # the sweep ends on a
    w.exits(0)
    w.relaunch()
    w.ready()
    if probation_s:
        w.probation_over()
    w.send(SweepEnded("sweep-1"))
    assert (w.m.intent.last_good_config, w.m.intent.last_good_launch) == ("a", w.launch.launch_id)
    assert w.launch.launch_id != first_a
