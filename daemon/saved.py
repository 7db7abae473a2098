"""state.json's shape: what the machine saves after each message, and how a later life of the
daemon reads it back (before the owner handles its first message).

Pure: the file itself is read and written by `store.py`, on the host's writer thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .history import LaunchHistory
from .model import Intent, Swap
from .states import SwapPhase

KNOWN_KEPT = 500  # processes of ours remembered (pid, create time) across lives
# state.json's shape. 1: no `schema` key (read as it is); 2: `schema`, and the running
# launch's `argv_digest`, `shim` and `stopping` (what adoption verifies and decides by).
SCHEMA = 2


def argv_digest(argv: list[str]) -> str:
    """A launch's argv as its record keeps it for adoption: a digest (it may hold secrets)."""
    return hashlib.sha256(json.dumps(argv).encode()).hexdigest()


def record(m: Any, boot_id: str) -> dict[str, Any]:
    """What is saved of the machine `m` now."""
    launch = m.launch
    current = None
    if launch is not None and launch.running:
        cfg = launch.config
        current = {
            "launch_id": launch.launch_id,
            "token": launch.token,
            "config": cfg.name,
            "pid": launch.child.pid,
            "pgid": launch.child.pgid,
            "create_time": launch.child.create_time,
            "boot_id": boot_id,
            "started_at": launch.started_at,
            # What a later life needs to take the server over as it runs (live restore): how
            # far it got, where its log is, what it was launched from, what it holds.
            "ready_at": launch.ready_at,
            "log_file": str(launch.log.path) if launch.log is not None else None,
            "config_hash": cfg.config_hash,
            "argv": cfg.redacted_argv(),
            "argv_digest": argv_digest(cfg.argv),
            "port": cfg.port,
            "health_url": cfg.shown_health_url,
            "rank_gpus": (
                {str(i): pids for i, pids in launch.rank_gpus.items()}
                if launch.rank_gpus is not None
                else None
            ),
            "on_probation": launch.on_probation,
            "shim": launch.child.survives_daemon,
            # Being stopped (a stop, a restart, a retry): a later life does not adopt it.
            "stopping": launch.next is not None,
        }
        if launch.recorded is not None:  # adopted: what it was launched with, as recorded then
            for key in ("log_file", "config_hash", "argv", "argv_digest", "port", "health_url"):
                if key in launch.recorded and (key != "log_file" or launch.log is None):
                    current[key] = launch.recorded[key]
    if current is None and m.booting.stopping_record is not None:
        current = m.booting.stopping_record  # the previous life's, until it is stopped
    return {
        "schema": SCHEMA,
        "intent": {"config": m.intent.config, "running": m.intent.running},
        "last_good_config": m.intent.last_good_config,
        "last_good_launch": m.intent.last_good_launch,
        "last_failed_launch": m.intent.last_failed_launch,
        "failures": m.retries.failures,
        "launch_seq": m.launch_seq,
        "current_launch": current,
        "last_exit": m.ledger.last_exit,
        "launches": list(m.ledger.history.entries()),
        "swap": _swap_record(m),
        # A sweep under way, and the config it ends on: a later life ends it on that config.
        "sweep": (
            {"id": m.intent.sweep, "restore_to": m.intent.sweep_restore_to}
            if m.intent.sweep is not None
            else None
        ),
        "known_processes": [
            [pid, ct, lid] for (pid, ct), lid in list(m.ledger.known_ours.items())[-KNOWN_KEPT:]
        ],
    }


def _swap_record(m: Any) -> dict[str, Any] | None:
    swap = m.swaps.current
    if swap is None:
        return None
    launch = m.launch
    on_probation = launch is not None and launch.on_probation and launch.swap is swap
    if not swap.active and not on_probation:
        return None
    return {
        "id": swap.id,
        "from": swap.from_config,
        "to": swap.to_config,
        "is_swap": swap.is_swap,
        "phase": str(swap.phase) if swap.active else "probation",
        "rollback_name": swap.rollback_name
        or (swap.rollback_to.name if swap.rollback_to else None),
    }


@dataclass(frozen=True)
class Restored:
    """A previous life's record, read back: what the machine takes into its own fields."""

    intent: Intent = field(default_factory=Intent)  # its sweep, if any, ended with that life
    launch_seq: int = 0
    failures: int = 0  # shown while booting; a start resets it
    history: LaunchHistory = field(default_factory=LaunchHistory)
    last_exit: dict[str, Any] | None = None
    known_ours: dict[tuple[int, float], str] = field(default_factory=dict)


def read(data: dict[str, Any], alive: Callable[[int, float], bool]) -> Restored:
    """A previous life's record (the dead of its known processes are forgotten:
    `alive(pid, create_time)` says which live). Raises TypeError or ValueError for a record of
    another shape."""
    intent = data.get("intent") or {}
    known: dict[tuple[int, float], str] = {}
    for item in data.get("known_processes") or []:
        with contextlib.suppress(TypeError, ValueError, IndexError):
            pid, ct, lid = int(item[0]), float(item[1]), str(item[2])
            if alive(pid, ct):
                known[(pid, ct)] = lid
    last_exit = data.get("last_exit")
    if last_exit is not None and not isinstance(last_exit, dict):
        raise TypeError(f"last_exit is {type(last_exit).__name__}, not a record")
    return Restored(
        intent=Intent(
            config=_name(intent.get("config"), "intent.config"),
            running=bool(intent.get("running")),
            last_good_config=_name(data.get("last_good_config"), "last_good_config"),
            last_good_launch=_name(data.get("last_good_launch"), "last_good_launch"),
            last_failed_launch=_name(data.get("last_failed_launch"), "last_failed_launch"),
        ),
        launch_seq=int(data.get("launch_seq", 0) or 0),
        failures=int(data.get("failures", 0) or 0),
        history=LaunchHistory(data.get("launches") or []),
        last_exit=last_exit,
        known_ours=known,
    )


def _name(value: Any, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{field} is {type(value).__name__}, not a name")
    return value


def interrupted_sweep(data: dict[str, Any]) -> tuple[str, str | None] | None:
    """(id, the config it ends on) of a sweep the previous life did not finish, if any."""
    record = data.get("sweep")
    if not isinstance(record, dict) or not record.get("id"):
        return None
    back = record.get("restore_to")
    return str(record["id"]), (str(back) if back else None)


def boot_config(data: dict[str, Any], default_config: str | None) -> str | None:
    """The config the boot starts: the saved intent's if it was running; with no intent on
    record (a first boot), `default_config`."""
    intent = data.get("intent") or {}
    if intent:
        return intent.get("config") if intent.get("running") else None
    return default_config


def resumed_swap(record: Any, name: str) -> Swap | None:
    """A swap the previous life did not finish (or whose probation it did not see out) goes on
    as that swap, rollback and probation included, if the intent is still its config."""
    if not isinstance(record, dict) or not record.get("id") or not record.get("to"):
        return None
    rolling_back = record.get("phase") == "rolling_back"
    if name != (record.get("rollback_name") if rolling_back else record.get("to")):
        return None  # the intent moved on since: nothing to resume
    return Swap(
        id=str(record["id"]),
        from_config=record.get("from"),
        to_config=str(record["to"]),
        is_swap=bool(record.get("is_swap", True)),
        phase=SwapPhase.ROLLING_BACK if rolling_back else SwapPhase.WAITING_GPU,
        rollback_name=record.get("rollback_name"),
    )


@dataclass(frozen=True)
class BootPlan:
    """What a boot does with the previous life's record: the fields it restores, the config
    it starts (None: nothing), a swap it resumes (and the phase that life saved), and the
    events to record (kind, fields)."""

    restored: Restored
    config: str | None
    swap: Swap | None = None
    swap_phase: str | None = None
    notes: tuple[tuple[str, dict[str, Any]], ...] = ()


def plan_boot(
    data: dict[str, Any], alive: Callable[[int, float], bool], default_config: str | None
) -> BootPlan:
    """The boot's plan from `data` (state.json as read; a record of another shape is read as
    none, as on a first start)."""
    notes: list[tuple[str, dict[str, Any]]] = []
    try:
        restored = read(data, alive)
    except (TypeError, ValueError, AttributeError) as exc:  # a JSON object of other shape
        detail = (
            f"state.json does not read as a record ({type(exc).__name__}: {exc}); "
            "starting as on a first start"
        )
        notes.append(("state_file_corrupt", {"detail": detail}))
        data, restored = {}, Restored()
    swept = interrupted_sweep(data)
    if swept is not None:
        # The sweep ended with that life: its config does not go on serving; the config the
        # sweep was to end on does (none: none was serving before it).
        sweep_id, back = swept
        intent = replace(restored.intent, config=back or restored.intent.config, running=bool(back))
        restored = replace(restored, intent=intent)
        data = {**data, "intent": {"config": intent.config, "running": intent.running}}
        notes.append(
            (
                "sweep_interrupted",
                {
                    "sweep_id": sweep_id,
                    "restore_to": back,
                    "detail": f"the daemon stopped during sweep {sweep_id}; "
                    + (f"{back} serves again" if back else "nothing was serving before it"),
                },
            )
        )
    name = boot_config(data, default_config)
    record = data.get("swap")
    swap = resumed_swap(record, name) if name else None
    phase = record.get("phase") if swap is not None and isinstance(record, dict) else None
    return BootPlan(restored, name, swap, phase, tuple(notes))
