"""The machine's records: what happened, kept and shown, deciding nothing about the server.

Exits on record (the last one, one per launch in the history, counts by reason), times to
ready, the running launch's own figures, the last GPU sample and which holders are ours (kept
across daemon lives, to know orphans later), and the health of the files the daemon writes.
The machine (`machine.py`) owns one `Ledger` and is its only caller; each note that should
be saved says so by returning True. Events leave through the machine's `event`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, assert_never

from . import phases
from .gpustate import GpuSnapshot
from .history import LaunchHistory
from .messages import GpuSampled, LineParsed, OrphansKilled, ServerFiguresRead, WriteHealthChanged
from .model import Launch, utc_iso
from .policy import Classification, describe_returncode
from .redact import fingerprints
from .sglanglines import decode_metrics

if TYPE_CHECKING:
    from .clock import Clock
    from .messages import Noted

READY_TIMES_KEPT = 100


class Ledger:
    def __init__(self, clock: Clock, event: Callable[..., None]) -> None:
        self.clock, self.event = clock, event
        self.history = LaunchHistory()
        self.last_exit: dict[str, Any] | None = None
        self.exits_by_reason: dict[str, int] = {}
        self.ready_times: list[float] = []
        self.ready_by_config: dict[str, float] = {}  # each config's last launch-to-ready
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
        # Processes found at the boot that are not verifiably ours ({pid, name, why}): listed
        # in /status and the dump, never signalled.
        self.unmanaged: list[dict[str, Any]] = []
        # The install's key for the digests of each launch's secrets kept in its record
        # (`store.secret_salt`, set by the supervisor at start; None: none are kept).
        self.secret_salt: bytes | None = None

    def note(self, msg: Noted, launch: Launch | None) -> bool:
        """A message that is only a record (`launch`: the current one, if the message is of
        it). True when what it noted should be saved."""
        match msg:
            case LineParsed():
                if launch is not None and msg.parsed.decode is not None:
                    self.note_figures(launch, decode_metrics(msg.parsed.decode), "log")
            case ServerFiguresRead():  # the server's own /metrics; dropped once it is gone
                if launch is None or launch.gen != msg.gen or not launch.running:
                    return False
                if msg.startup is not None and launch.launch_id:
                    self.history.amend(launch.launch_id, {"server_startup": dict(msg.startup)})
                    return True  # on the launch's record in state.json
                if msg.figures:
                    self.note_figures(launch, dict(msg.figures), "sglang_metrics")
            case GpuSampled():
                return self.note_gpus(msg, launch)
            case OrphansKilled():
                self.note_killed(msg.killed, "gpu_orphans_killed")
            case WriteHealthChanged():
                self.note_write_health(msg.target, msg.error)
            case _:
                assert_never(msg)
        return False

    def restore(
        self,
        history: LaunchHistory,
        last_exit: dict[str, Any] | None,
        known_ours: dict[tuple[int, float], str],
    ) -> None:
        """The records of the daemon's previous life, read back at its boot."""
        self.history, self.last_exit, self.known_ours = history, last_exit, dict(known_ours)

    def note_unmanaged(self, found: tuple[dict[str, Any], ...]) -> None:
        self.unmanaged = [dict(item) for item in found]
        for item in found:
            self.event("unmanaged_process", **item, detail="not verifiably ours: left running")

    def launch_started(self, launch: Launch, pid: int, log_file: str) -> None:
        """Every launch is on record from its start; its exit fills in. Its secrets are kept
        by keyed digest, never in clear: its log stays masked after the config's secrets
        change (`views.redactor_for`)."""
        record: dict[str, object] = {
            "launch_id": launch.launch_id,
            "config": launch.config.name,
            "config_hash": launch.config.config_hash,
            "pid": pid,
            "started_at": utc_iso(launch.started_at),
            "ready_at": None,
            "log_file": log_file,
            "exit": None,
        }
        if self.secret_salt is not None:
            record["secrets"] = fingerprints(self.secret_salt, launch.redactor.secrets)
        self.history.started(record)

    # -- exits ------------------------------------------------------------------------------------

    def exit_record(
        self,
        reason: str,
        evidence: str | None,
        *,
        code: int | None = None,
        sig: int | None = None,
        launch_id: str | None = None,
        at: float | None = None,
    ) -> dict[str, Any]:
        """The shape of `last_exit` and of each history entry's `exit`, wherever one is made."""
        return {
            "code": code,
            "signal": sig,
            "reason": reason,
            "evidence": evidence,
            "at": utc_iso(self.clock.time() if at is None else at),
            "launch_id": launch_id,
        }

    def note_exit(self, reason: str, evidence: str | None) -> None:
        """An ending with no launch of its own (a refused start, a failed boot)."""
        self.last_exit = self.exit_record(reason, evidence)

    def record_exit(self, launch: Launch, verdict: Classification) -> None:
        code, sig, _ = describe_returncode(launch.returncode) if launch.exited else (None, None, "")
        evidence = launch.redactor.text(verdict.evidence)
        lid = launch.launch_id or None
        self.last_exit = self.exit_record(
            verdict.reason, evidence, code=code, sig=sig, launch_id=lid, at=launch.exited_at
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

    def count_exit(self, reason: str) -> None:
        self.exits_by_reason[reason] = self.exits_by_reason.get(reason, 0) + 1

    def close_unobserved(self, stopped_id: str, adopted_id: str = "") -> bool:
        """Every launch ends with an exit record. Those the previous life did not see end get
        one now: the one this boot stopped, and the others, which ended while it was away (but
        the one adopted: its end is yet to come, or known exactly)."""
        closed = False
        for entry in self.history.unfinished():
            launch_id = entry.get("launch_id")
            if launch_id and launch_id == adopted_id:
                continue
            if launch_id and launch_id == stopped_id:
                reason = "requested_stop"
                evidence = "stopped at the daemon's start: its previous life left it running"
            else:
                reason = "ended_unobserved"
                evidence = "ended while the daemon was away (exit code and signal unknown)"
            exit_ = self.exit_record(reason, evidence, launch_id=launch_id)
            self.history.ended(str(launch_id), {"exit": exit_})
            self.last_exit = exit_
            self.count_exit(reason)
            fields = {k: v for k, v in exit_.items() if k != "at"}
            self.event("exit", **{**fields, "config": entry.get("config")})
            closed = True
        return closed

    # -- a launch's figures -----------------------------------------------------------------------

    def note_ready(self, launch: Launch, took: float) -> None:
        """A launch is ready, `took` seconds after its exec: on its record with the phases its
        start went through (what the next launch's ETA is made of), but an adopted launch's,
        whose start another life of the daemon saw."""
        self.ready_times = [*self.ready_times[-(READY_TIMES_KEPT - 1) :], took]
        self.ready_by_config[launch.config.name] = took
        if not launch.launch_id:
            return
        fields: dict[str, Any] = {"ready_at": utc_iso(launch.ready_at), "ready_s": round(took, 3)}
        if launch.recorded is None and launch.started_mono is not None:
            end = launch.started_mono + took
            fields["phases"] = phases.record(launch.phases.segments(launch.started_mono, end))
        self.history.amend(launch.launch_id, fields)

    def reset_figures(self) -> None:
        self.server_metrics, self.server_metrics_mono = {}, None

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

    # -- GPUs -------------------------------------------------------------------------------------

    def note_gpus(self, msg: GpuSampled, launch: Launch | None) -> bool:
        """Keep a GPU sample: the snapshot, and which holders are `launch`'s (the running one
        the sample is of, if any). True when a holder became known as ours (to be saved)."""
        snap = msg.snapshot
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
        if launch is None or launch.exited or not msg.tree:
            return False
        holders = {p.pid for g in snap.gpus for p in g.processes}
        added = False
        for key in msg.tree:
            if key[0] in holders and key not in self.known_ours:
                self.known_ours[key] = launch.launch_id
                added = True
        return added

    def note_killed(self, killed: list[dict[str, Any]], event: str) -> None:
        """Processes of ours killed after an exit (`sweep`) or before a launch (orphans)."""
        self.last_sweep_killed = killed
        self.event(event, killed=killed)

    # -- the daemon's own files -------------------------------------------------------------------

    def note_write_health(self, target: str, error: str | None) -> None:
        """A file the daemon writes began failing or works again: an event, a log line, a
        status field and a metric, once per change (not once per failed write)."""
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
