"""Swaps and restarts under way, as a sub-machine of the machine's: a swap's phase (checked
against `states.PHASES`), its outcome, and what a failed one rolls back to.

The machine owns one `Swaps` and tells it what happens to the launches a swap brings up (an
attempt began, it was executed, it became ready, it failed); `Swaps` answers what follows (a
probation, a rollback and to which config) and settles the swap, telling the host so waiting
callers get the outcome. It writes only its own fields and the swaps' own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import CommandError
from .model import Launch, PrewarmProgress, Swap
from .states import SwapPhase, check_phase

if TYPE_CHECKING:
    from .policy import Classification
    from .resolvedconfig import ResolvedConfig


class Swaps:
    def __init__(
        self, event: Callable[..., None], settled: Callable[[str, dict[str, Any]], None]
    ) -> None:
        self.event, self.settled = event, settled
        self.current: Swap | None = None  # the last swap or restart begun (settled or not)
        self.rolled_back_from: str | None = None  # the config the last rollback left
        self.count = 0  # swaps to another config, counted apart from restarts
        self.rollbacks = 0

    def active(self) -> Swap | None:
        swap = self.current
        return swap if swap is not None and swap.active else None

    def set_phase(self, swap: Swap, new: SwapPhase) -> None:
        """The one writer of a swap's phase, checked against its table."""
        if swap.phase != new:
            check_phase(swap.phase, new)
            swap.phase = new

    # -- asked for ----------------------------------------------------------------------------

    def refuse_if_under_way(self, active_sweep: str | None, sweep_id: str | None = None) -> None:
        """One swap at a time, and none beside a sweep but the sweep's own."""
        if active_sweep is not None and sweep_id != active_sweep:
            raise CommandError(
                errors.CONFLICT, f"sweep {active_sweep} is under way; cancel it, or stop"
            )
        swap = self.active()
        if swap is not None:
            raise CommandError(
                errors.CONFLICT,
                f"swap {swap.id} ({swap.from_config} → {swap.to_config}) is under way "
                f"({swap.phase}); wait for it, or stop",
            )

    def begin(
        self,
        swap_id: str,
        cfg: ResolvedConfig,
        current: str | None,
        serving: Launch | None,
        last_good: tuple[str | None, ResolvedConfig | None],
        *,
        prewarm: PrewarmProgress | None = None,
    ) -> Swap:
        """A restart (`cfg` is the current config) or a swap: it rolls back to what serves, or
        else to the last good config (its name, and its config read ahead: kept if it still is
        that one). With `prewarm` it begins `prewarming`: `cfg` waits for its read."""
        last_good_config, last_good_read = last_good
        if last_good_read is not None and last_good_read.name != last_good_config:
            last_good_read = None
        swap = Swap(
            id=swap_id,
            from_config=current,
            to_config=cfg.name,
            is_swap=cfg.name != current,
            rollback_name=serving.config.name if serving else last_good_config,
            rollback_to=serving.config if serving else last_good_read,
        )
        if prewarm is not None:
            swap.phase, swap.pending, swap.prewarm = SwapPhase.PREWARMING, cfg, prewarm
        self.current, self.rolled_back_from = swap, None
        if swap.is_swap:
            self.count += 1
        kind = "swap" if swap.is_swap else "restart"
        self.event(kind, swap_id=swap.id, from_config=current, to_config=cfg.name)
        return swap

    def resume(self, swap: Swap, phase: str | None) -> None:
        """A swap the daemon's previous life did not finish goes on as the same swap."""
        self.current = swap
        self.event(
            "swap_resumed",
            swap_id=swap.id,
            from_config=swap.from_config,
            to_config=swap.to_config,
            phase=phase,
            detail="the daemon stopped during this swap; it goes on as the same swap",
        )

    def resumed_read(self, last_good: ResolvedConfig | None, last_good_config: str | None) -> bool:
        """The start of a swap resumed at the boot was read, with its rollback config
        (`last_good`, kept if it still is the one). True when it starts as the rollback."""
        swap = self.current
        if swap is None:
            return False
        named = swap.rollback_name or last_good_config
        if swap.rollback_to is None and last_good is not None and last_good.name == named:
            swap.rollback_to = last_good
        return swap.phase == SwapPhase.ROLLING_BACK

    # -- what happens to its launches ---------------------------------------------------------

    def prewarm_ended(self, swap_id: str, outcome: str, detail: str) -> ResolvedConfig | None:
        """The pre-warm of the swap under way is over: the config it brings up now (None: that
        swap has gone on without it, or is over)."""
        swap = self.active()
        if swap is None or swap.id != swap_id or swap.phase != SwapPhase.PREWARMING:
            return None
        self.set_phase(swap, SwapPhase.STOPPING)  # PREWARMING -> STOPPING
        self._prewarm_event(swap, outcome, detail)
        cfg, swap.pending = swap.pending, None
        return cfg

    def _prewarm_event(self, swap: Swap, outcome: str, detail: str) -> None:
        fields = swap.prewarm.view() if swap.prewarm is not None else {}
        fields.update(state=None, outcome=outcome, detail=detail)
        self.event("prewarm_ended", swap_id=swap.id, **fields)

    def attempt_began(self, swap: Swap) -> bool:
        """True when it cuts the swap's pre-warm short (the old server ended meanwhile, and
        its relaunch is the new config's): the reader is to stop."""
        cut = swap.phase == SwapPhase.PREWARMING
        if cut:
            swap.pending = None
            self._prewarm_event(swap, "cancelled", "the serving server ended first")
        if swap.phase != SwapPhase.ROLLING_BACK:
            self.set_phase(swap, SwapPhase.WAITING_GPU)  # PREWARMING|STOPPING -> WAITING_GPU
        return cut

    def spawned(self, swap: Swap, launch_id: str) -> None:
        swap.launch_ids.append(launch_id)
        if swap.phase == SwapPhase.WAITING_GPU:
            self.set_phase(swap, SwapPhase.STARTING)  # WAITING_GPU -> STARTING

    def ready(self, launch: Launch, config: str | None, probation_s: float) -> bool:
        """`launch` is ready: its swap settles. True when it goes on probation first (a
        swapped-in config becomes last-good only once it has stayed up)."""
        swap = launch.swap
        if swap is not None and swap.active and launch.rollback:
            self.settle("rolled_back", swap.outcome_reason, swap.outcome_evidence, config)
        elif swap is not None and swap.active:
            self.settle("ready", None, f"{launch.config.name} is ready", config)
        return swap is not None and swap.is_swap and not launch.rollback and probation_s > 0

    @staticmethod
    def rolls_back(launch: Launch) -> bool:
        """A failure of `launch` rolls back: the first start of a swapped-in config, or a
        crash in its probation."""
        swap = launch.swap
        first_start = swap is not None and swap.is_swap and swap.active and not launch.rollback
        return first_start or (launch.on_probation and launch.ready_mono is not None)

    def failed(self, launch: Launch, verdict: Classification, config: str | None) -> None:
        """A plain restart, or the rollback itself, failed: the restart policy takes it from
        here, and the swap settles failed."""
        if launch.swap is not None and launch.swap.active:
            self.settle("failed", verdict.reason, verdict.evidence, config)

    def roll_back(
        self, launch: Launch, verdict: Classification, last_good_config: str | None, seq: int
    ) -> ResolvedConfig | str:
        """Back at once, no backoff, to the config that served when the swap began (else the
        last good one): that config, or why there is none to go back to (the swap then
        settles failed, by the machine, once it has gone `failed`)."""
        failed = launch.config.name
        began = launch.swap
        target_cfg = began.rollback_to if began is not None else None
        target = (began.rollback_name if began is not None else None) or last_good_config
        swap = began
        if swap is None or not swap.active:  # settled, and its probation failed: a swap of its own
            swap = Swap(
                id=f"rollback-{seq}", from_config=failed, to_config=target or failed, is_swap=True
            )
            self.current = swap
        swap.outcome_reason, swap.outcome_evidence = verdict.reason, verdict.evidence
        if not target or target == failed:
            return f"swap to {failed} failed and there is no last good config"
        if target_cfg is None or target_cfg.name != target:
            return f"swap to {failed} failed and its rollback config {target} does not load"
        # STOPPING|WAITING_GPU|STARTING -> ROLLING_BACK
        self.set_phase(swap, SwapPhase.ROLLING_BACK)
        self.rolled_back_from, self.rollbacks = failed, self.rollbacks + 1
        self.event(
            "rollback",
            swap_id=swap.id,
            from_config=failed,
            to_config=target,
            reason=verdict.reason,
            evidence=verdict.evidence,
        )
        return target_cfg

    def settle(
        self, outcome: str, reason: str | None, evidence: str | None, config: str | None
    ) -> None:
        """The swap under way ends `outcome` (`ready`, `rolled_back`, `failed`), with the
        config intended now; callers waiting on it are answered."""
        swap = self.current
        if swap is None:
            return
        swap.outcome = {
            "outcome": outcome,
            "reason": reason,
            "evidence": evidence,
            "launch_ids": list(swap.launch_ids),
            "swap_id": swap.id,
            "config": config,
        }
        # PREWARMING|STOPPING|WAITING_GPU|STARTING|ROLLING_BACK -> DONE
        self.set_phase(swap, SwapPhase.DONE)
        self.settled(swap.id, swap.outcome)
        self.event("swap_settled", swap_id=swap.id, outcome=outcome, reason=reason)
