"""The restart policy: what an exit means, the delay before a retry, and the counters it
decides by (`Retries`, a part of the machine's). No I/O, no clock.

Backoff (the contract's schedule)::

    delay_n = min(max_delay_s, initial_delay_s * multiplier**(n-1) * (1 ± jitter))

with the jitter from an injected `random.Random`, so tests can pin it. After many failures the
power overflows a float: the delay is then `max_delay_s` (as it long since was).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .model import Next
from .sglanglines import Finding

REASONS = (
    "requested_stop",
    "config_error",
    "cuda_oom",
    "nccl_error",
    "watchdog_timeout",
    "port_in_use",
    "startup_timeout",
    "liveness_failed",
    "rank_lost",
    "exec_failed",
    "log_unwritable",
    "gpu_busy",
    "preflight_refused",
    "signal",
    "crash",
    "internal_error",
    "ended_unobserved",
)
# Reasons that retrying the same config cannot fix: no blind restart.
NOT_RETRIED = frozenset({"config_error", "preflight_refused"})
# Evidence found in the log, most specific first.
_EVIDENCE_PRIORITY = ("cuda_oom", "nccl_error", "watchdog_timeout", "port_in_use", "config_error")

if TYPE_CHECKING:
    from .messages import BackoffElapsed
    from .model import Launch
    from .resolvedconfig import ResolvedConfig
    from .settings import RestartPolicy


def backoff_delay(policy: RestartPolicy, failures: int, rng: random.Random) -> float:
    """The delay before retry number `failures` (1-based)."""
    if failures <= 0:
        return 0.0
    try:
        base = policy.initial_delay_s * policy.multiplier ** (failures - 1)
    except OverflowError:
        base = float("inf")
    factor = 1.0 + policy.jitter * (2.0 * rng.random() - 1.0)
    return max(0.0, min(policy.max_delay_s, base * factor))


@dataclass(frozen=True)
class Classification:
    reason: str
    evidence: str


class Retries:
    """The failures in a row and what follows the next one: a retry after a delay, or none.
    The machine owns one and is its only caller."""

    def __init__(
        self, policy: RestartPolicy, rng: random.Random, event: Callable[..., None]
    ) -> None:
        self.policy, self.rng, self.event = policy, rng, event
        self.failures = 0  # in a row
        self.restarts = 0  # relaunches of the same config: retries and requested restarts
        self.crash_loop = False

    def stable(self) -> None:
        """The server stayed up `reset_after_s`: the failures before no longer count."""
        if self.failures or self.crash_loop:
            self.event("failures_reset", after_failures=self.failures)
        self.reset()

    def reset(self, failures: int = 0) -> None:
        """A start or swap asked, or a stable uptime (a boot restores its previous count)."""
        self.failures, self.crash_loop = failures, False

    def restarted(self) -> None:
        self.restarts += 1

    def retried_config(self, msg: BackoffElapsed, ran: Launch | None) -> ResolvedConfig | None:
        """What a retry starts: its config as read now (None: it does not read). One whose
        file is missing or half-written just now (an editor's save, a deploy) comes back as
        the launch before it `ran` it, if it is that config, and the file is read again at the
        next retry; a command that names the config still gets the error."""
        if msg.resolved is not None or not msg.unreadable or ran is None:
            return msg.resolved
        self.event(
            "config_unreadable",
            error=msg.error,
            detail=f"relaunched with the resolution of launch {ran.launch_id} "
            f"(hash {ran.config.config_hash}); the file is read again at the next retry",
        )
        return ran.config

    def failed(self, reason: str) -> float | str:
        """One more failure: the delay before its retry, or why there is none."""
        self.failures += 1
        if self.failures >= self.policy.crash_loop_after and not self.crash_loop:
            self.crash_loop = True
            self.event("crash_loop", failures=self.failures, reason=reason)
        if reason in NOT_RETRIED:
            return "not retried: fix the config"
        if self.policy.max_failures is not None and self.failures >= self.policy.max_failures:
            return f"{self.failures} consecutive failures (max_failures)"
        return backoff_delay(self.policy, self.failures, self.rng)


def describe_returncode(returncode: int | None) -> tuple[int | None, int | None, str]:
    """(exit code, signal number, words) from a Popen-style return code."""
    if returncode is None:
        return None, None, "no exit status"
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return None, sig, f"killed by {name}"
    return returncode, None, f"exited with code {returncode}"


def classify_end(launch: Launch) -> Classification:
    """What the end of `launch` (exited and swept) means: a reason we ended it for stands; one
    stopped on request (a stop, a swap, the daemon's shutdown) ended as asked; else its exit."""
    requested = launch.next in (Next.STOP, Next.RELAUNCH, Next.SHUTDOWN)
    return classify_exit(
        launch.returncode,
        launch.evidence(),
        requested_stop=requested and launch.imposed is None,
        imposed=launch.imposed,
    )


def classify_exit(
    returncode: int | None,
    findings: Sequence[Finding],
    requested_stop: bool = False,
    imposed: Classification | None = None,
) -> Classification:
    """What an exit means, with the line (or fact) that proves it.

    `imposed` is a reason the supervisor decided before it ended the process (startup
    timeout, liveness, lost rank); `requested_stop` covers SGLang's -9 after our SIGTERM.
    """
    _, sig, words = describe_returncode(returncode)
    if imposed is not None:
        return imposed
    if requested_stop:
        return Classification("requested_stop", f"stopped on request ({words})")
    by_kind: dict[str, Finding] = {}
    for f in findings:
        by_kind.setdefault(f.kind, f)
    if returncode == 2:
        found = by_kind.get("config_error")
        return Classification("config_error", found.line if found else f"{words} (usage error)")
    for kind in _EVIDENCE_PRIORITY:
        if kind in by_kind:
            return Classification(kind, by_kind[kind].line)
    exceptions = [f.line for f in findings if f.kind == "exception"]
    if exceptions:
        # Prefer the exception's own line over "Scheduler hit an exception: Traceback ...".
        typed = [e for e in exceptions if not e.startswith(("Scheduler hit", "Detokenizer"))]
        return Classification("crash", (typed or exceptions)[-1])
    for kind in ("scheduler_dead", "sigquit"):  # SGLang's own word that a child died
        if kind in by_kind:
            return Classification("crash", by_kind[kind].line)
    if sig is not None:
        hint = " (possible OOM kill)" if sig == signal.SIGKILL else ""
        return Classification("signal", f"{words}{hint}")
    return Classification("crash", words)
