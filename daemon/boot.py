"""The daemon's start, on the world's side: what its previous life left (state.json, a server
still running) read off the owner and handed to the machine as one message (`BootBegan`);
the machine decides (`restoring.py`, `on_boot_began`) and asks for the rest: that server
stopped (`stop_previous`), then the saved intent read and preflighted like any start
(`boot_start`). Commands that arrive meanwhile are handled in order with these.

The shim is asked what it runs: the server state.json names, found there and verified as
that very server (boot, launch token, pid, argv, create time), is attached to (`Adoptee`) for
the machine to take over as it is, with live_restore; without it, one still running is
stopped as any previous server, and one that ended is attached to for its recorded exit.
What runs and cannot be verified is listed as unmanaged, never signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import reading, saved
from .configs import ConfigError
from .errors import CommandError
from .messages import BootBegan, StartRequested
from .model import Adoptee, PreviousServer
from .preflight import Preflight, PreflightResult
from .server import reaper
from .server.shimclient import ShimClient, ShimError
from .store import secret_salt

if TYPE_CHECKING:
    from .configs import ConfigStore
    from .resolvedconfig import ResolvedConfig
    from .store import StateStore

BOOT_DEADLINE_S = 300.0  # the boot's config read and preflight (two introspections at most)


STOPPED_AT_BOOT = "stopped at the daemon's start: its previous life left it running"
RELEASED = "released at the daemon's start: state.json does not name this launch"


async def survey(
    store: StateStore,
    boot_id: str,
    state_dir: Path,
    shim: ShimClient | None = None,
    configs: ConfigStore | None = None,
    *,
    live_restore: bool = True,
) -> BootBegan:
    """state.json as the previous life left it, which of its processes still live, and the
    install's key for the digests of secrets kept in launch records; with a shim, the server
    to adopt (a running one only with `live_restore`) and what it runs that is not ours to
    manage."""
    salt = await asyncio.to_thread(secret_salt, state_dir)
    data, note = await asyncio.to_thread(store.load)
    listed: list[dict[str, Any]] = []
    if shim is not None:
        with contextlib.suppress(ConnectionError, ShimError, TypeError):
            listed = [s for s in (await shim.request("list"))["servers"] if isinstance(s, dict)]
    found = await asyncio.to_thread(_survey, data, boot_id, listed, live_restore)
    adoptee = None
    if found.adopt is not None and shim is not None and configs is not None:
        adoptee, why = await _attach(shim, configs, *found.adopt, rollback=_rollback_name(data))
        if why is not None:
            found.unmanaged.append(why)
    for launch_id in found.release:
        assert shim is not None
        shim.tell("release", launch_id=launch_id, trailer=RELEASED)
    return BootBegan(
        data,
        note,
        found.previous,
        found.alive_known,
        salt,
        adoptee=adoptee,
        unmanaged=tuple(found.unmanaged),
    )


@dataclass
class _Found:
    previous: PreviousServer | None = None
    alive_known: frozenset[tuple[int, float]] = frozenset()
    adopt: tuple[dict[str, Any], dict[str, Any]] | None = None  # (its record, the shim's view)
    unmanaged: list[dict[str, Any]] = field(default_factory=list)
    release: list[str] = field(default_factory=list)  # the shim's records of no launch of ours


def _survey(
    data: dict[str, Any], boot_id: str, listed: list[dict[str, Any]], live_restore: bool
) -> _Found:
    alive_known: set[tuple[int, float]] = set()
    items = data.get("known_processes")
    for item in items if isinstance(items, list) else []:
        with contextlib.suppress(TypeError, ValueError, IndexError):
            pid, ct = int(item[0]), float(item[1])
            if reaper.is_alive(pid, ct):
                alive_known.add((pid, ct))
    found = _Found(alive_known=frozenset(alive_known))
    record = data.get("current_launch") or None
    record = record if isinstance(record, dict) else None
    named = str(record.get("launch_id") or "") if record is not None else ""
    view = None
    for item in listed:
        launch_id = str(item.get("launch_id"))
        if launch_id == named:
            view = item
        elif item.get("running"):
            alien = f"the shim runs launch {launch_id}, which state.json does not name"
            found.unmanaged.append(_unmanaged(item.get("pid"), alien))
        else:
            found.release.append(launch_id)
    if record is not None and view is not None:
        unverified = _unverified(record, view, boot_id)
        if unverified is None and not live_restore and view.get("running"):
            found.previous = _previous(record, boot_id)  # stopped, then released in the shim
        elif unverified is None:
            found.adopt = (record, view)
        elif view.get("running"):
            found.unmanaged.append(_unmanaged(view.get("pid"), f"launch {named}: {unverified}"))
        else:
            found.release.append(named)
        return found
    found.previous = _previous(record, boot_id)
    if found.previous is None and record is not None and record.get("boot_id") == boot_id:
        with contextlib.suppress(TypeError, ValueError):
            pid = int(record.get("pid") or 0)
            if pid > 0 and reaper.is_alive(pid):  # alive, but not the process recorded
                why = f"pid {pid} is alive but is not launch {named}'s server (pid reused)"
                found.unmanaged.append(_unmanaged(pid, why))
    return found


def _unverified(record: dict[str, Any], view: dict[str, Any], boot_id: str) -> str | None:
    """Why the shim's server is not the one state.json recorded (None: it is)."""
    if record.get("boot_id") != boot_id:
        return "state.json recorded it on another boot"
    if not record.get("token") or view.get("token") != record.get("token"):
        return "its launch token is not the one recorded"
    if view.get("pid") != record.get("pid"):
        return f"its pid {view.get('pid')} is not the one recorded ({record.get('pid')})"
    digest = record.get("argv_digest")
    argv = view.get("argv")
    if digest is not None and (not isinstance(argv, list) or saved.argv_digest(argv) != digest):
        return "its command line is not the one recorded"
    if view.get("running"):
        try:
            recorded = float(record["create_time"])
        except (KeyError, TypeError, ValueError):
            return "state.json holds no create time for it"
        now = reaper.create_time_of(int(view["pid"]))
        if now is not None and abs(now - recorded) > 0.05:
            return "its create time is not the one recorded (pid reused)"
    return None


def _unmanaged(pid: Any, why: str) -> dict[str, Any]:
    pid = int(pid) if isinstance(pid, int) else 0
    return {"pid": pid, "name": reaper.name_of(pid) if pid else None, "why": why}


def _rollback_name(data: dict[str, Any]) -> str | None:
    swap = data.get("swap")
    name = swap.get("rollback_name") if isinstance(swap, dict) else None
    name = name or data.get("last_good_config")
    return name if isinstance(name, str) else None


async def _attach(
    shim: ShimClient,
    configs: ConfigStore,
    record: dict[str, Any],
    view: dict[str, Any],
    rollback: str | None,
) -> tuple[Adoptee | None, dict[str, Any] | None]:
    """The verified server taken over: its handle from the shim, its config read now. One
    whose config no longer reads cannot be supervised: unmanaged (it is not signalled)."""
    name, pid = str(record.get("config")), view.get("pid")
    try:
        config = await asyncio.to_thread(configs.load, name)
    except ConfigError as exc:
        why = f"its config {name!r} no longer reads ({exc}); it is left running, unmanaged"
        return None, _unmanaged(pid, why)
    try:
        log = view.get("log") or record.get("log_file")  # the shim's word first
        server = await shim.attach(str(record["launch_id"]), Path(str(log)))
    except (ConnectionError, ShimError) as exc:
        return None, _unmanaged(pid, f"the shim did not hand it over: {exc}")
    server.create_time = _float(record.get("create_time")) or 0.0
    # Its exit while the daemon was away, if so: the time here, the code through the handle.
    exited_at = None if view.get("running") else _float(view.get("exited_at"))
    back = await reading.quietly(configs, rollback, config)
    return Adoptee(record, server, config, exited_at, back), None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _previous(record: dict[str, Any] | None, boot_id: str) -> PreviousServer | None:
    """The server the record names, if it still runs on this boot (by pid and create time), or
    processes of its launch left behind (by the launch's token in their environment)."""
    if record is None or record.get("boot_id") != boot_id:
        return None
    try:
        pid = int(record.get("pid") or 0)
        pgid = int(record.get("pgid") or pid)
        create_time = float(record["create_time"]) if record.get("create_time") else None
    except (TypeError, ValueError):
        return None
    token = str(record.get("token") or "")
    alive = pid > 0 and reaper.is_alive(pid, create_time)
    if not alive and not (token and reaper.find_leftovers(token)):
        return None
    launch_id = str(record.get("launch_id") or "")
    return PreviousServer(pid, pgid, create_time, launch_id, token, alive)


async def stop_previous(prev: PreviousServer, grace_s: float) -> list[dict[str, Any]]:
    """SIGTERM to that server's group, SIGKILL after `grace_s`; then whatever of its launch is
    left. Returns the processes killed, as the event records them."""
    if prev.alive:
        await reaper.stop_foreign(prev.pid, prev.create_time, prev.pgid, grace_s)
    found = await asyncio.to_thread(reaper.find_leftovers, prev.token, prev.pgid)
    killed = await reaper.kill_leftovers(found)
    return [{"pid": k.pid, "name": k.name} for k in killed]


async def boot_start(
    configs: ConfigStore, preflight: Preflight, name: str, rollback: str | None
) -> StartRequested:
    """The boot's start: read and preflighted like any start, off the owner."""
    cfg: ResolvedConfig | None = None
    try:
        cfg, pre = await reading.for_command(configs, name)
    except CommandError as exc:
        pre = PreflightResult(ok=False, problems=[exc.detail])
    if cfg is not None:
        pre = await preflight.check(cfg)
    back = await reading.quietly(configs, rollback, cfg)
    return StartRequested(name, boot=True, preflight=pre, resolved=cfg, last_good=back)
