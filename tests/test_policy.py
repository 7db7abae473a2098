"""Backoff schedule and exit classification (pure functions)."""

from __future__ import annotations

import random

from gpuwarden.daemon.policy import Classification, backoff_delay, classify_exit
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
