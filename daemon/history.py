"""Launches on record: each from its start, its exit filled in when it ends; looked up here once
(the logs route, the crash dump and sweeps ask the same question).

Entries are never changed in place: an exit replaces its entry with a new dict, so a snapshot
that holds a tuple of them never sees one change under it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

LAUNCH_HISTORY = 50


class LaunchHistory:
    def __init__(self, entries: Iterable[Any] = ()) -> None:
        self._entries: list[dict[str, Any]] = [e for e in entries if _valid(e)][-LAUNCH_HISTORY:]

    def started(self, entry: dict[str, Any]) -> None:
        self._entries.append(entry)
        del self._entries[:-LAUNCH_HISTORY]

    def ended(self, launch_id: str, fields: dict[str, Any]) -> None:
        """Fill in a launch's end (its exit, and what is known of it by then)."""
        for i in range(len(self._entries) - 1, -1, -1):
            if self._entries[i]["launch_id"] == launch_id:
                self._entries[i] = {**self._entries[i], **fields}
                return
        self.started({"launch_id": launch_id, **fields})

    def amend(self, launch_id: str, fields: dict[str, Any]) -> None:
        """Add what became known of a launch still running (its time to ready, its phases)."""
        for i in range(len(self._entries) - 1, -1, -1):
            if self._entries[i]["launch_id"] == launch_id:
                self._entries[i] = {**self._entries[i], **fields}
                return

    def unfinished(self) -> list[dict[str, Any]]:
        """Launches with no exit on record (a previous life of the daemon did not see it)."""
        return [e for e in self._entries if e.get("exit") is None]

    def entries(self) -> tuple[dict[str, Any], ...]:
        return tuple(self._entries)


def find(entries: Iterable[Mapping[str, Any]], launch_id: str | None) -> Mapping[str, Any] | None:
    """The history entry of a launch id (the newest, should an id repeat)."""
    if not launch_id:
        return None
    matches: list[Mapping[str, Any]] = [e for e in entries if e.get("launch_id") == launch_id]
    return matches[-1] if matches else None


def previous(entries: Iterable[Mapping[str, Any]], current: str | None) -> Mapping[str, Any] | None:
    """The newest launch that is not the current one."""
    earlier = [e for e in entries if e.get("launch_id") != current]
    return earlier[-1] if earlier else None


def log_of(entries: Iterable[Mapping[str, Any]], launch_ids: list[str], config: str) -> str | None:
    """The log file of the newest of `launch_ids` that ran `config` (a swap's own launch, not
    the rollback that followed it)."""
    for launch_id in reversed(launch_ids):
        entry = find(entries, launch_id)
        if entry is not None and entry.get("config") == config:
            return str(entry.get("log_file"))
    return None


def _valid(entry: Any) -> bool:
    return isinstance(entry, dict) and bool(entry.get("launch_id"))
