"""The machine's books: its state and the one writer of it, and the records it keeps.

`Books` holds every field of the lifecycle (the state, the current launch and swap, the intent,
the failure counters, the history) and writes the state and a swap's phase only through
`transition` and `set_phase`, checked against the tables in `states.py`. It also keeps the
records that decide nothing about the server: exits on record, events, write health, GPU
attribution. The decisions are in `machine.py` (the lifecycle) and `commands.py` (requests).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from .effects import Effects
from .gpustate import GpuSnapshot
from .history import LaunchHistory
from .messages import (
    EventNoted,
    GpuSampled,
    OrphansKilled,
    SaveDelayElapsed,
    ServerFiguresRead,
    StateSaved,
    WriteHealthChanged,
)
from .model import Boot, Launch, Swap, utc_iso
from .policy import Classification, describe_returncode
from .states import RUNNING_STATES, ServerState, SwapPhase, check_phase, check_transition

if TYPE_CHECKING:
    from .clock import Clock
    from .settings import Settings


class Books:
    def __init__(self, settings: Settings, host: Effects, clock: Clock, rng: random.Random) -> None:
        self.settings, self.host, self.clock, self.rng = settings, host, clock, rng
        self.state = ServerState.STOPPED
        self.state_since = clock.time()
        self.finished = False  # the daemon's shutdown is complete: the owner ends
        self.dirty = False  # the saved state is stale: saved once after this message
        self.gen = 0
        self.launch: Launch | None = None
        self.boot: Boot | None = None  # the daemon's start, under way (`on_boot_began`)
        self.swap: Swap | None = None
        self.intent_config: str | None = None
        self.intent_running = False
        self.last_good_config: str | None = None
        self.last_good_launch: str | None = None
        self.last_failed_launch: str | None = None
        self.rolled_back_from: str | None = None
        self.failures = 0
        self.restarts = 0  # relaunches of the same config: retries and requested restarts
        self.swaps = 0  # swaps to another config, counted apart
        self.rollbacks = 0
        self.crash_loop = False
        self.next_retry_at: float | None = None
        self.last_exit: dict[str, Any] | None = None
        self.exits_by_reason: dict[str, int] = {}
        self.ready_times: list[float] = []
        self.ready_by_config: dict[str, float] = {}  # each config's last launch-to-ready
        self.history = LaunchHistory()
        # The install's key for the digests of each launch's secrets kept in its record
        # (`store.secret_salt`, set by the supervisor at start; None: none are kept).
        self.secret_salt: bytes | None = None
        self.launch_seq = 0
        self.stop_ticket = 0
        self.active_sweep: str | None = None
        # What the active sweep ends on: no other config it starts becomes last-good, and a
        # daemon that dies mid-sweep starts this one at its next boot.
        self.sweep_restore_to: str | None = None
        # The current launch's own figures (Decode batch lines, SGLang's /metrics), reset at
        # every launch and stamped with when they were read: no launch shows another's.
        self.server_metrics: dict[str, Any] = {}
        self.server_metrics_mono: float | None = None
        self.gpu_snapshot = GpuSnapshot()
        self.gpu_tree_pids: frozenset[int] = frozenset()  # the sampled launch tree (`ours`)
        self.gpu_pids_unresolved = False
        self.last_sweep_killed: list[dict[str, Any]] = []
        # Processes known to be ours, of this and earlier launches: (pid, create_time) ->
        # launch id. Saved, so a later daemon life recognises orphans holding GPU memory.
        self.known_ours: dict[tuple[int, float], str] = {}
        self.write_errors: dict[str, str] = {}
        self.write_failures: dict[str, int] = {}
        self.internal_errors = 0
        self.listener_warned: set[str] = set()
        self.saving_again = False

    def transition(self, new: ServerState, **fields: Any) -> None:
        old = self.state
        check_transition(old, new)
        self.state, self.state_since = new, self.clock.time()
        if new != ServerState.BACKOFF:
            self.next_retry_at = None
        self.event("state", **{"from": str(old), "to": str(new)}, **fields)

    def set_phase(self, swap: Swap, new: SwapPhase) -> None:
        if swap.phase != new:
            check_phase(swap.phase, new)
            swap.phase = new

    def event(self, kind: str, **fields: Any) -> None:
        """Record an event (events.jsonl, the API's listeners, the daemon's log)."""
        record: dict[str, Any] = {"ts": utc_iso(self.clock.time()), "event": kind}
        if self.launch is not None:
            record.setdefault("config", self.launch.config.name)
            if self.launch.launch_id:
                record["launch_id"] = self.launch.launch_id
        record.update({k: v for k, v in fields.items() if v is not None})
        self.host.record(record)

    def persist(self) -> None:
        self.dirty = True

    def current(self, gen: int) -> Launch | None:
        launch = self.launch
        return launch if launch is not None and launch.gen == gen else None

    def may_be_last_good(self, launch: Launch) -> bool:
        """A launch a sweep measures is not last-good (the sweep ends on another config); the
        config the sweep ends on may be."""
        return self.active_sweep is None or launch.config.name == self.sweep_restore_to

    def set_intent(self, config: str | None, running: bool) -> None:
        self.intent_config, self.intent_running = config, running
        self.persist()

    def current_config(self) -> str | None:
        launch = self.launch
        if launch is not None and self.state in (ServerState.WAITING_GPU, *RUNNING_STATES):
            return launch.config.name
        return self.intent_config

    def serving(self) -> Launch | None:
        """The launch serving requests now (ready, or ready and failing probes)."""
        launch = self.launch
        if launch is None or launch.exited or launch.ready_at is None:
            return None
        return launch if self.state in (ServerState.READY, ServerState.UNHEALTHY) else None

    def settle_swap(self, outcome: str, reason: str | None, evidence: str | None) -> None:
        swap = self.swap
        if swap is None:
            return
        swap.outcome = {
            "outcome": outcome,
            "reason": reason,
            "evidence": evidence,
            "launch_ids": list(swap.launch_ids),
            "swap_id": swap.id,
            "config": self.intent_config,
        }
        self.set_phase(swap, SwapPhase.DONE)  # STOPPING|WAITING_GPU|STARTING|ROLLING_BACK -> DONE
        self.host.swap_settled(swap.id, swap.outcome)
        self.event("swap_settled", swap_id=swap.id, outcome=outcome, reason=reason)

    def exit_record(
        self,
        reason: str,
        evidence: str | None,
        *,
        code: int | None = None,
        sig: int | None = None,
        launch_id: str | None = None,
    ) -> dict[str, Any]:
        """The shape of `last_exit` and of each history entry's `exit`, wherever one is made."""
        at = utc_iso(self.clock.time())
        return {
            "code": code,
            "signal": sig,
            "reason": reason,
            "evidence": evidence,
            "at": at,
            "launch_id": launch_id,
        }

    def record_exit(self, launch: Launch, verdict: Classification) -> None:
        code, sig, _ = describe_returncode(launch.returncode) if launch.exited else (None, None, "")
        evidence = launch.redactor.text(verdict.evidence)
        lid = launch.launch_id or None
        self.last_exit = self.exit_record(
            verdict.reason, evidence, code=code, sig=sig, launch_id=lid
        )
        self.event("exit", **{k: v for k, v in self.last_exit.items() if k != "at"})
        if launch.launch_id:
            self.history.ended(
                launch.launch_id,
                {
                    "config": launch.config.name,
                    "pid": launch.child.pid if launch.child else None,
                    "started_at": utc_iso(launch.started_at),
                    "ready_at": utc_iso(launch.ready_at),
                    "log_file": str(launch.log.path) if launch.log else None,
                    "exit": self.last_exit,
                },
            )

    def count_relaunch(self) -> None:
        """A relaunch of the same config is a restart; a swap was counted when it was asked."""
        if self.swap is None or not self.swap.is_swap:
            self.restarts += 1

    def note_ready(self, config: str, took: float) -> None:
        self.ready_times = [*self.ready_times[-99:], took]
        self.ready_by_config[config] = took

    def note_figures(self, launch: Launch, figures: dict[str, Any], source: str) -> None:
        """The server's figures, of this launch only: merged over what it reported before."""
        self.server_metrics = {
            **self.server_metrics,
            **figures,
            "source": source,
            "config": launch.config.name,
            "launch_id": launch.launch_id or None,
            "at": utc_iso(self.clock.time()),
        }
        self.server_metrics_mono = self.clock.monotonic()

    def on_server_figures_read(self, msg: ServerFiguresRead) -> bool:
        """Figures read from the server's own /metrics; dropped when their launch is gone."""
        launch = self.current(msg.gen)
        if launch is None or not launch.running:
            return False
        self.note_figures(launch, dict(msg.figures), "sglang_metrics")
        return True

    def protected_logs(self) -> set[str]:
        current = self.launch.launch_id if self.launch else None
        return {x for x in (current, self.last_good_launch, self.last_failed_launch) if x}

    def on_orphans_killed(self, msg: OrphansKilled) -> None:
        self.last_sweep_killed = msg.killed
        self.event("gpu_orphans_killed", killed=msg.killed)

    def on_event_noted(self, msg: EventNoted) -> None:
        self.event(msg.kind, **msg.fields)

    def on_state_saved(self, msg: StateSaved) -> None:
        self.on_write_health_changed(WriteHealthChanged("state", msg.error))
        if msg.error is not None and not self.saving_again:
            self.saving_again = True  # keep trying: the state on disk is stale until it works
            self.host.save_again()

    def on_save_delay_elapsed(self, msg: SaveDelayElapsed) -> None:
        self.saving_again = False
        self.persist()

    def on_write_health_changed(self, msg: WriteHealthChanged) -> None:
        """A file the daemon writes began failing or works again: an event, a log line, a
        status field and a metric, once per change (not once per failed write)."""
        target, error = msg.target, msg.error
        before = self.write_errors.get(target)
        if error == before:
            return
        if error is None:
            del self.write_errors[target]
            self.event("write_resumed", target=target, detail=f"{target} is written again")
            return
        self.write_errors[target] = error
        if before is None:
            self.write_failures[target] = self.write_failures.get(target, 0) + 1
            self.event("write_failed", target=target, error=error)

    def note_gpus(self, msg: GpuSampled) -> Launch | None:
        """Keep a GPU sample: the snapshot, and which holders are the running launch's (kept
        across daemon lives, to know orphans later). Returns that launch, if the sample is of it."""
        snap: GpuSnapshot = msg.snapshot
        self.gpu_snapshot = snap
        self.gpu_tree_pids = frozenset(pid for pid, _ in msg.tree)
        if msg.unresolved and not self.gpu_pids_unresolved:
            # NVML in a container may report pids of another namespace: say so once, and never
            # call such a holder ours (decisions fall back to memory alone).
            self.gpu_pids_unresolved = True
            self.event(
                "gpu_pids_unresolved",
                pids=list(msg.unresolved[:8]),
                detail="NVML reports pids this daemon cannot see (another pid namespace?); "
                "GPU holders are judged by memory only and none is treated as ours",
            )
        launch = self.current(msg.gen)
        if launch is None or launch.exited or not msg.tree:
            return None
        holders = {p.pid for g in snap.gpus for p in g.processes}
        for key in msg.tree:
            if key[0] in holders and key not in self.known_ours:
                self.known_ours[key] = launch.launch_id
                self.persist()
        return launch

    def close_unobserved(self, stopped_id: str) -> None:
        """Every launch ends with an exit record. Those the previous life did not see end get
        one now: the one this boot stopped, and the others, which ended while it was away."""
        for entry in self.history.unfinished():
            launch_id = entry.get("launch_id")
            if launch_id and launch_id == stopped_id:
                reason = "requested_stop"
                evidence = "stopped at the daemon's start: its previous life left it running"
            else:
                reason = "ended_unobserved"
                evidence = "ended while the daemon was away (exit code and signal unknown)"
            exit_ = self.exit_record(reason, evidence, launch_id=launch_id)
            self.history.ended(str(launch_id), {"exit": exit_})
            self.last_exit = exit_
            self.exits_by_reason[reason] = self.exits_by_reason.get(reason, 0) + 1
            fields = {k: v for k, v in exit_.items() if k != "at"}
            self.event("exit", **{**fields, "config": entry.get("config")})
            self.persist()

    def resume_swap(self, swap: Swap, phase: str | None) -> None:
        self.swap = swap
        self.event(
            "swap_resumed",
            swap_id=swap.id,
            from_config=swap.from_config,
            to_config=swap.to_config,
            phase=phase,
            detail="the daemon stopped during this swap; it goes on as the same swap",
        )
