"""The restart policy (backoff schedule, exit classification, `Retries`) and the boot's plan
read from state.json: the machine's pure parts, without processes."""

from __future__ import annotations

import random

from gpuwarden.daemon import saved
from gpuwarden.daemon.model import Intent
from gpuwarden.daemon.policy import Classification, Retries, backoff_delay, classify_exit
from gpuwarden.daemon.settings import RestartPolicy
from gpuwarden.daemon.sglanglines import Finding


def test_backoff_follows_the_contract_formula() -> None:
    p = RestartPolicy(initial_delay_s=10, max_delay_s=300, multiplier=2, jitter=0.2)
    rng = random.Random(3)
    check = random.Random(3)
    for n in range(1, 10):
        delay = backoff_delay(p, n, rng)
        expected = min(300, 10 * 2 ** (n - 1) * (1 + 0.2 * (2 * check.random() - 1)))
        assert abs(delay - expected) < 1e-9
    assert backoff_delay(p, 30, rng) == 300  # capped; retried forever at max_delay_s
    assert backoff_delay(RestartPolicy(initial_delay_s=0, jitter=0.2), 5, rng) == 0


def test_zero_jitter_is_exact() -> None:
    p = RestartPolicy(initial_delay_s=1, multiplier=3, jitter=0, max_delay_s=100)
    assert [backoff_delay(p, n, random.Random()) for n in (1, 2, 3, 4, 5)] == [1, 3, 9, 27, 81]


def test_classification_priorities() -> None:
    oom = Finding("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory.")
    exc = Finding("exception", "RuntimeError: boom")
    assert classify_exit(-9, [exc, oom]).reason == "cuda_oom"
    assert classify_exit(-9, [exc]).evidence == "RuntimeError: boom"
    assert classify_exit(2, []).reason == "config_error"
    assert classify_exit(-9, [], requested_stop=True).reason == "requested_stop"
    assert classify_exit(-11, []).evidence == "killed by SIGSEGV"
    assert classify_exit(0, []).evidence == "exited with code 0"


def test_sglangs_word_that_a_child_died_is_the_evidence_of_a_kill_that_followed() -> None:
    """The daemon SIGKILLs the group on SGLang's line: -9 is ours, the line is the reason."""
    quit_line = "SIGQUIT received. signum=None, frame=None. It usually means one child failed."
    dead = "Subprocess detokenizer (pid=7) crashed with exit code -9. Triggering SIGQUIT..."
    assert classify_exit(-9, [Finding("sigquit", quit_line)]) == Classification("crash", quit_line)
    both = [Finding("scheduler_dead", dead), Finding("sigquit", quit_line)]
    assert classify_exit(-9, both) == Classification("crash", dead)


# -- Retries: the failures in a row and what follows the next one --------------------------------


def _retries(**policy: object) -> tuple[Retries, list[tuple[str, dict[str, object]]]]:
    events: list[tuple[str, dict[str, object]]] = []
    pol = RestartPolicy(initial_delay_s=1, multiplier=2, jitter=0, **policy)  # type: ignore[arg-type]
    return Retries(pol, random.Random(0), lambda kind, **f: events.append((kind, f))), events


def test_retries_back_off_and_say_crash_loop_once() -> None:
    retries, events = _retries(crash_loop_after=3, max_delay_s=100)
    assert [retries.failed("crash") for _ in range(4)] == [1, 2, 4, 8]
    assert retries.crash_loop and [k for k, _ in events] == ["crash_loop"]  # at the third, once
    retries.stable()  # it stayed up: the count starts again, and that is said
    assert (retries.failures, retries.crash_loop) == (0, False)
    assert [k for k, _ in events] == ["crash_loop", "failures_reset"]
    retries.stable()  # nothing to reset: nothing said
    assert len(events) == 2


def test_retries_give_up_where_retrying_cannot_help_or_the_limit_is_reached() -> None:
    retries, _ = _retries(max_failures=2)
    assert retries.failed("config_error") == "not retried: fix the config"
    assert retries.failed("crash") == "2 consecutive failures (max_failures)"
    retries.reset(failures=5)  # as a boot restores it
    assert retries.failures == 5 and not retries.crash_loop


# -- the boot's plan (saved.plan_boot) ------------------------------------------------------------


def test_the_boot_plan_ends_an_interrupted_sweep_on_the_config_it_was_to_end_on() -> None:
    record = {
        "intent": {"config": "step-3", "running": True},
        "sweep": {"id": "s1", "restore_to": "base"},
    }
    plan = saved.plan_boot(record, lambda pid, ct: False, default_config=None)
    assert (plan.config, plan.restored.intent.config, plan.restored.intent.running) == (
        "base",
        "base",
        True,
    )
    assert [kind for kind, _ in plan.notes] == ["sweep_interrupted"]
    # Nothing served before the sweep: nothing starts, and the intent is not to run.
    record["sweep"] = {"id": "s2", "restore_to": None}
    plan = saved.plan_boot(record, lambda pid, ct: False, default_config="x")
    assert plan.config is None and plan.restored.intent.running is False


def test_the_boot_plan_reads_a_record_of_another_shape_as_a_first_start() -> None:
    plan = saved.plan_boot({"intent": {"config": 7}}, lambda pid, ct: False, default_config="d")
    assert plan.config == "d" and plan.restored.intent == Intent()
    assert plan.restored.launch_seq == 0 and not list(plan.restored.history.entries())
    assert [kind for kind, _ in plan.notes] == ["state_file_corrupt"]


def test_the_boot_plan_resumes_a_swap_only_while_the_intent_is_its_config() -> None:
    swap = {"id": "swap-3-1", "from": "a", "to": "b", "phase": "starting", "rollback_name": "a"}
    record = {"intent": {"config": "b", "running": True}, "swap": swap}
    plan = saved.plan_boot(record, lambda pid, ct: False, default_config=None)
    assert plan.swap is not None and (plan.swap.id, plan.swap_phase) == ("swap-3-1", "starting")
    record["intent"] = {"config": "c", "running": True}  # moved on since
    assert saved.plan_boot(record, lambda pid, ct: False, default_config=None).swap is None
