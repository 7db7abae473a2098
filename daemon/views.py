"""What readers see: a frozen snapshot of the machine, taken after a message is handled, and
the read models built from it (`/status`, the metrics, the dump, sweeps).

Readers never hold the machine's live fields: a snapshot's containers are copies (the history
tuple holds entries that are replaced, never changed, when a launch ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from . import history
from .configs import ConfigError, ConfigStore
from .gpustate import GpuProcess, GpuSnapshot, owner_of
from .launchlog import LaunchLog
from .model import utc_iso
from .phases import PhaseClock, expected, now, seconds, totals
from .redact import Fingerprints, Redactor
from .states import ServerState

if TYPE_CHECKING:
    from .machine import Machine


@dataclass(frozen=True)
class Snapshot:
    state: ServerState
    booting: bool  # the previous life's server is being stopped, or the boot's start read
    state_since: float
    gen: int
    config: str | None  # the launch's config, else the intent's
    current_config: str | None  # what serves or is on its way to (else the intent's)
    intent_config: str | None
    intent_running: bool
    launch_id: str | None
    launch_config: str | None
    launch_argv: tuple[str, ...] | None  # the launch's own argv (its secrets in it: never shown)
    pid: int | None  # the running server's main process
    replacing_port: int | None  # its port (a swap's preflight lets the new config reuse it)
    upstream: tuple[str, int] | None  # the launch's address (the front proxy's upstream)
    model: str | None  # the model it loads (a cut stream goes on only on the same one)
    started_at: float | None
    ready_at: float | None
    ready_mono: float | None
    log: LaunchLog | None  # the current launch's log (its ring serves /logs and streams)
    redactor: Redactor  # the current launch's secrets
    last_good_config: str | None
    last_good_launch: str | None
    last_failed_launch: str | None
    rolled_back_from: str | None
    swap: Mapping[str, Any] | None
    restarts: int
    swaps: int
    rollbacks: int
    failures: int
    crash_loop: bool
    next_retry_at: float | None
    last_exit: Mapping[str, Any] | None
    last_sweep_killed: tuple[Mapping[str, Any], ...]
    exits_by_reason: Mapping[str, int]
    ready_times: tuple[float, ...]
    ready_by_config: Mapping[str, float]
    history: tuple[Mapping[str, Any], ...]
    active_sweep: str | None
    gpu_snapshot: GpuSnapshot
    gpu_tree_pids: frozenset[int]  # the running launch's tree as of the GPU sample
    gpu_pids_unresolved: bool
    known_ours: Mapping[tuple[int, float], str]
    watching_ranks: bool
    server_metrics: Mapping[str, Any]  # the running launch's own figures, else empty
    server_metrics_mono: float | None
    metrics_url: str | None  # the running launch's own /metrics (with --enable-metrics)
    probe_failures: int  # consecutive failed liveness probes of the serving launch
    startup_timeout_s: float | None  # the launch's, while it starts
    write_errors: Mapping[str, str]
    write_failures: Mapping[str, int]
    internal_errors: int
    unmanaged: tuple[Mapping[str, Any], ...] = ()  # found at the boot, not ours: never signalled
    # The starting launch's phases (the live clock the log pipeline marks, as `log` is live),
    # from its exec (`started_mono`); its config's hash picks the earlier launches of an ETA.
    phases: PhaseClock | None = None
    started_mono: float | None = None
    launch_hash: str | None = None


def take(m: Machine) -> Snapshot:
    launch = m.launch
    swap = m.swaps.current
    running = launch is not None and launch.running
    return Snapshot(
        state=m.state,
        booting=m.booting.active,
        state_since=m.state_since,
        gen=m.gen,
        config=launch.config.name if launch else m.intent.config,
        current_config=m.current_config(),
        intent_config=m.intent.config,
        intent_running=m.intent.running,
        launch_id=(launch.launch_id or None) if launch else None,
        launch_config=launch.config.name if launch else None,
        launch_argv=tuple(launch.config.argv) if launch else None,
        pid=launch.child.pid if launch and launch.child and launch.running else None,
        replacing_port=launch.config.port if launch and launch.running else None,
        upstream=(launch.config.host, launch.config.port) if launch else None,
        model=launch.config.model_path if launch else None,
        started_at=launch.started_at if launch else None,
        ready_at=launch.ready_at if launch else None,
        ready_mono=launch.ready_mono if launch else None,
        log=launch.log if launch and isinstance(launch.log, LaunchLog) else None,
        redactor=launch.redactor if launch else Redactor(),
        last_good_config=m.intent.last_good_config,
        last_good_launch=m.intent.last_good_launch,
        last_failed_launch=m.intent.last_failed_launch,
        rolled_back_from=m.swaps.rolled_back_from,
        swap=MappingProxyType(swap.view()) if swap is not None and swap.active else None,
        restarts=m.retries.restarts,
        swaps=m.swaps.count,
        rollbacks=m.swaps.rollbacks,
        failures=m.retries.failures,
        crash_loop=m.retries.crash_loop,
        next_retry_at=m.next_retry_at,
        last_exit=m.ledger.last_exit,
        last_sweep_killed=tuple(m.ledger.last_sweep_killed),
        exits_by_reason=MappingProxyType(dict(m.ledger.exits_by_reason)),
        ready_times=tuple(m.ledger.ready_times),
        ready_by_config=MappingProxyType(dict(m.ledger.ready_by_config)),
        history=m.ledger.history.entries(),
        active_sweep=m.intent.sweep,
        gpu_snapshot=m.ledger.gpu_snapshot,
        gpu_tree_pids=m.ledger.gpu_tree_pids,
        gpu_pids_unresolved=m.ledger.gpu_pids_unresolved,
        known_ours=MappingProxyType(dict(m.ledger.known_ours)),
        watching_ranks=bool(launch is not None and launch.rank_gpus),
        server_metrics=MappingProxyType(dict(m.ledger.server_metrics) if running else {}),
        server_metrics_mono=m.ledger.server_metrics_mono if running else None,
        metrics_url=launch.config.metrics_url if launch is not None and running else None,
        probe_failures=launch.probe_failures if launch is not None and running else 0,
        startup_timeout_s=launch.config.config.health.startup_timeout_s if launch else None,
        write_errors=MappingProxyType(dict(m.ledger.write_errors)),
        write_failures=MappingProxyType(dict(m.ledger.write_failures)),
        internal_errors=m.ledger.internal_errors,
        unmanaged=tuple(MappingProxyType(dict(u)) for u in m.ledger.unmanaged),
        # (an adopted start's earlier phases were another life's: no phase, no ETA)
        phases=launch.phases
        if launch is not None and launch.recorded is None and m.state == ServerState.STARTING
        else None,
        started_mono=launch.started_mono if launch else None,
        launch_hash=launch.config.config_hash if launch else None,
    )


def status_fixed(snap: Snapshot, *, gpu_backend: str) -> dict[str, Any]:
    """The body of `GET /status` as far as the snapshot alone decides it: built once per
    snapshot. The fields that move with time are None here, in their places (`status_now`)."""
    gpus = [
        {
            "index": g.index,
            "uuid": g.uuid,
            "used_mib": g.used_mib,
            "total_mib": g.total_mib,
            "utilization_pct": g.utilization_pct,
            "processes": [
                {
                    "pid": p.pid,
                    "name": p.name,
                    "used_mib": p.used_mib,
                    "ours": p.pid in snap.gpu_tree_pids,
                    "holder": holder(p, snap),
                }
                for p in g.processes
            ],
        }
        for g in snap.gpu_snapshot.gpus
    ]
    return {
        "state": str(snap.state),
        "booting": None,
        "config": snap.config,
        "intent": {"config": snap.intent_config, "running": snap.intent_running},
        "pid": snap.pid,
        "launch_id": snap.launch_id,
        "started_at": utc_iso(snap.started_at),
        "ready_at": utc_iso(snap.ready_at),
        "uptime_s": None,
        "restarts": snap.restarts,
        "swaps": snap.swaps,
        "rollbacks": snap.rollbacks,
        "failures": snap.failures,
        "crash_loop": snap.crash_loop,
        "next_retry_at": utc_iso(snap.next_retry_at),
        "last_exit": dict(snap.last_exit) if snap.last_exit is not None else None,
        "log_file": str(snap.log.path) if snap.log else None,
        "last_good_config": snap.last_good_config,
        "rolled_back_from": snap.rolled_back_from,
        "swap": dict(snap.swap) if snap.swap is not None else None,
        "sweep": None,
        "last_sweep_killed": [dict(k) for k in snap.last_sweep_killed],
        "gpus": gpus,
        "gpu_backend": gpu_backend,
        "gpu_error": snap.gpu_snapshot.error,
        "gpu_snapshot_age_s": None,
        "gpu_pids_unresolved": snap.gpu_pids_unresolved,
        "server_metrics": None,
        "write_errors": dict(snap.write_errors),
        "internal_errors": snap.internal_errors,
        "unmanaged": [dict(u) for u in snap.unmanaged],
        "supervising": None,
        "phase": None,
        "startup": startup(snap),
    }


def startup(snap: Snapshot) -> dict[str, Any] | None:
    """How the current launch's start went, once it is ready."""
    return startup_of(snap.history, snap.launch_id) if snap.ready_at is not None else None


def startup_of(
    entries: Iterable[Mapping[str, Any]], launch_id: str | None
) -> dict[str, Any] | None:
    """How a launch's start went: the seconds from its exec to ready, each phase's total, and
    SGLang's own account where it gave one (`server`). None before it was ready."""
    entry = history.find(entries, launch_id)
    ready_s = seconds(entry.get("ready_s")) if entry is not None else None
    if entry is None or ready_s is None:
        return None  # (not ready, or a hand-edited record that says no number)
    server = entry.get("server_startup")
    return {
        "ready_s": ready_s,
        "phases": totals(entry.get("phases")),
        "server": server if isinstance(server, dict) else None,
    }


def status_now(
    fixed: dict[str, Any],
    snap: Snapshot,
    *,
    now_mono: float,
    real_mono: float,
    sweep: dict[str, Any] | None,
    supervising: bool,
    booting: bool,
    proxy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`status_fixed`'s body (of the same snapshot, shared: not changed here) with the fields
    that move with time filled in, read at this moment."""
    uptime = None
    if snap.pid is not None and snap.ready_mono is not None:
        uptime = round(now_mono - snap.ready_mono, 3)
    return {
        **fixed,
        "uptime_s": uptime,
        "sweep": {k: sweep[k] for k in ("id", "done", "total", "current")} if sweep else None,
        "gpu_snapshot_age_s": round(max(0.0, real_mono - snap.gpu_snapshot.taken_at), 3),
        "server_metrics": server_metrics(snap, now_mono),
        "supervising": supervising,
        "booting": booting,
        "phase": phase(snap, now_mono),
        "proxy": proxy,  # the front proxy's figures (`proxy:` set), as it last said them
    }


def phase(snap: Snapshot, now_mono: float) -> dict[str, Any] | None:
    """While a launch starts: its phase, the seconds in it, and the seconds until ready."""
    if snap.phases is None or snap.started_mono is None:
        return None
    segments = snap.phases.segments(snap.started_mono, max(snap.started_mono, now_mono))
    return now(segments, expected(snap.history, snap.launch_config, snap.launch_hash))


def server_metrics(snap: Snapshot, now_mono: float) -> dict[str, Any] | None:
    """The running launch's figures with their age (`age_s`), or None before it reported any."""
    if not snap.server_metrics or snap.server_metrics_mono is None:
        return None
    return {**snap.server_metrics, "age_s": round(max(0.0, now_mono - snap.server_metrics_mono), 3)}


def holder(proc: GpuProcess, snap: Snapshot) -> str:
    """Who holds GPU memory: `ours` (the running server's tree, or a process of its launch by
    pid and create time), `orphan` (a process of an earlier launch: killed before the next
    launch) or `foreign` (never ours, never killed). `/status` and `/metrics` both say this."""
    if proc.pid in snap.gpu_tree_pids:
        return "ours"
    launch = owner_of(proc, snap.known_ours, snap.gpu_pids_unresolved)
    if launch is None:
        return "foreign"
    return "ours" if launch == snap.launch_id else "orphan"


def ring_lines(snap: Snapshot, n: int) -> list[str]:
    """The current launch's last `n` lines, redacted."""
    if snap.log is None:
        return []
    return [snap.redactor.text(e.text) for e in snap.log.ring.tail(n)]


def redactor_for(
    snap: Snapshot, configs: ConfigStore, record: Mapping[str, Any] | None, salt: bytes | None
) -> Redactor:
    """A redactor for an earlier launch's log (`record`: its history entry): the secrets it ran
    with, known by the digests its record keeps (however its config changed since), its
    config's current secrets (if it still resolves), the current launch's, and the generic
    rules. Masking by digest costs a keyed hash per word-bounded window: call it off the loop
    for many lines."""
    record = record or {}
    found = Fingerprints.of(salt, record.get("secrets")) if salt is not None else None
    redactor = Redactor(fingerprints=found)
    config = record.get("config")
    if isinstance(config, str) and config:
        with contextlib.suppress(ConfigError):
            redactor.add(configs.load(config).secret_values())
    redactor.add(snap.redactor.secrets)
    return redactor
