"""A part of the host: what the daemon keeps on disk of its own. The machine's records are
kept in order and written (events.jsonl, the listeners, the daemon's log) when the owner's
turn ends, or, between a server's end and the next exec, right after that exec; state.json is
written on a thread of its own (`StateSaved`), one write at a time, the newest record behind
it; events.jsonl and the launch logs are kept to their retention.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpuwarden.daemon import logsetup

from .logfiles import prune_logs
from .messages import EventNoted, Message, SaveDelayElapsed, StateSaved, WriteHealthChanged
from .settings import Retention
from .store import EventLog, StateStore
from .tasks import Tasks

log = logsetup.get_logger("gpuwarden.supervisor")

SAVE_RETRY_S = 2.0
# Between a server's end and the next exec, records wait for the exec (they are written right
# after it), but never longer than this.
HOLD_RECORDS_S = 0.25


class Records:
    def __init__(
        self,
        *,
        events: EventLog,
        store: StateStore,
        log_dir: Path,
        log_retention: Retention,
        tasks: Tasks,
        post: Callable[[Message], None],
    ) -> None:
        self.events, self.store, self.tasks, self.post = events, store, tasks, post
        self.log_dir, self.log_retention = log_dir, log_retention
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._records: list[dict[str, Any]] = []  # the owner's turn's records, not yet written
        self._flush_timer: asyncio.TimerHandle | None = None
        self._events_error: str | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self._saving = False  # a state.json write is under way on the writer thread
        self._save_next: dict[str, Any] | None = None  # the newest record, behind it
        self._closing = False

    # -- events ----------------------------------------------------------------------------------

    def record(self, record: dict[str, Any]) -> None:
        """A record of the machine's: kept in order and written when the owner's turn ends
        (`flush`), or, between a server's end and the next exec, right after that exec
        (`hold`)."""
        self._records.append(record)

    def hold(self) -> None:
        """A relaunch is under way: its records wait for the exec, at most `HOLD_RECORDS_S`."""
        if self._records and self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(HOLD_RECORDS_S, self.flush)

    def flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        records, self._records = self._records, []
        for record in records:
            try:
                self._write(record)
            except Exception:  # a record that cannot be written must not cost the others
                log.exception("daemon.record_failed", record_event=str(record.get("event")))

    def _write(self, record: dict[str, Any]) -> None:
        self.events.append(record)
        if self.events.needs_prune():
            self.tasks.task(self._prune_events())
        if self.events.write_error != self._events_error:
            self._events_error = self.events.write_error
            self.post(WriteHealthChanged("events", self._events_error))
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("supervisor.event_listener_failed")
        fields = {k: v for k, v in record.items() if k not in ("event", "ts")}
        log.log(logsetup.record_level(record), f"server.{record['event']}", **fields)

    async def _prune_events(self) -> None:
        """events.jsonl back to its newest `retention.events` lines, on a thread."""
        try:
            dropped = await asyncio.to_thread(self.events.prune)
        except OSError as exc:
            self.post(EventNoted("events_prune_failed", {"error": f"{exc.strerror or exc}"}))
            return
        self.post(EventNoted("events_pruned", {"lines": dropped, "kept": self.events.lines}))

    # -- state.json ------------------------------------------------------------------------------

    def save(self, record: dict[str, Any]) -> None:
        """Write state.json (fsync and all) on the writer thread, so a relaunch never waits
        for the disk. One write at a time: a record that comes while one is being written waits
        for it, and a newer one replaces it there (the file only ever needs the newest)."""
        if self._saving:
            self._save_next = record
            return
        self._saving = True
        done = self._writer.submit(self.store.save, record)
        loop = asyncio.get_running_loop()

        def report(fut: Any) -> None:
            error = fut.result() if fut.exception() is None else repr(fut.exception())
            with contextlib.suppress(RuntimeError):  # the loop is gone: the daemon is exiting
                loop.call_soon_threadsafe(self._saved, error)

        done.add_done_callback(report)

    def _saved(self, error: str | None) -> None:
        self._saving = False
        self.post(StateSaved(error))
        if self._closing:
            return  # `close` writes the newest, once the writer has stopped
        record, self._save_next = self._save_next, None
        if record is not None:
            self.save(record)

    def save_again(self) -> None:
        self.tasks.timer(SAVE_RETRY_S, SaveDelayElapsed())

    async def close(self) -> None:
        """Write what is kept, let the write under way end, then write the newest record."""
        self.flush()
        self._closing = True
        await asyncio.to_thread(self._writer.shutdown, wait=True)
        if self._save_next is not None:  # the last change, behind the write then under way
            await asyncio.to_thread(self.store.save, self._save_next)
            self._save_next = None

    # -- launch logs -----------------------------------------------------------------------------

    def prune_logs(self, protect: set[str], order: list[str]) -> None:
        self.tasks.task(self._prune_logs(protect, order))

    async def _prune_logs(self, protect: set[str], order: list[str]) -> None:
        keep = self.log_retention
        removed = await asyncio.to_thread(
            prune_logs, self.log_dir, keep.launches, keep.max_bytes, protect, order
        )
        if removed:
            self.post(EventNoted("logs_pruned", {"files": len(removed)}))
