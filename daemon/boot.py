"""The daemon's start, on the world's side: what its previous life left (state.json, a server
still running) read off the owner and handed to the machine as one message (`BootBegan`);
the machine decides (`machine.py`, `on_boot_began`) and asks for the rest: that server
stopped (`stop_previous`), then the saved intent read and preflighted like any start
(`boot_start`). Commands that arrive meanwhile are handled in order with these.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from . import reading
from .errors import CommandError
from .messages import BootBegan, StartRequested
from .model import PreviousServer
from .preflight import Preflight, PreflightResult
from .server import reaper
from .store import secret_salt

if TYPE_CHECKING:
    from pathlib import Path

    from .configs import ConfigStore
    from .resolvedconfig import ResolvedConfig
    from .store import StateStore

BOOT_DEADLINE_S = 300.0  # the boot's config read and preflight (two introspections at most)


async def survey(store: StateStore, boot_id: str, state_dir: Path) -> BootBegan:
    """state.json as the previous life left it, which of its processes still live, and the
    install's key for the digests of secrets kept in launch records."""
    salt = await asyncio.to_thread(secret_salt, state_dir)
    data, note = await asyncio.to_thread(store.load)
    previous, alive_known = await asyncio.to_thread(_survey, data, boot_id)
    return BootBegan(data, note, previous, alive_known, salt)


def _survey(
    data: dict[str, Any], boot_id: str
) -> tuple[PreviousServer | None, frozenset[tuple[int, float]]]:
    alive_known: set[tuple[int, float]] = set()
    items = data.get("known_processes")
    for item in items if isinstance(items, list) else []:
        with contextlib.suppress(TypeError, ValueError, IndexError):
            pid, ct = int(item[0]), float(item[1])
            if reaper.is_alive(pid, ct):
                alive_known.add((pid, ct))
    return _previous(data.get("current_launch") or None, boot_id), frozenset(alive_known)


def _previous(record: Any, boot_id: str) -> PreviousServer | None:
    """The server the record names, if it still runs on this boot (by pid and create time), or
    processes of its launch left behind (by the launch's token in their environment)."""
    if not isinstance(record, dict) or record.get("boot_id") != boot_id:
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
