"""What the daemon remembers across its own restarts: ``state.json`` and ``events.jsonl``.

``state.json`` is written atomically (temp file, fsync, rename). A corrupt one is moved aside
(``state.json.corrupt-<time>``) and the daemon starts as on its first start. A write that fails
(disk full) is reported, never fatal: supervision goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from gpuwarden.daemon.safefile import RefusedFile, open_regular, read_regular, read_regular_tail


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


SALT_FILE = "secret-salt"


def secret_salt(state_dir: Path) -> bytes:
    """The install's key for the digests of launches' secrets (`redact.fingerprints`):
    `state_dir/secret-salt`, 32 random bytes made once, readable by the daemon's user only.
    One that cannot be read or made gives way to a key for this life only (earlier launches'
    logs are then masked by their config's current secrets alone)."""
    path = state_dir / SALT_FILE
    try:
        data = read_regular(path, 4096)
    except FileNotFoundError:
        data = b""
    except OSError:
        return os.urandom(32)  # there but unreadable (a FIFO, a directory): left alone
    if len(data) >= 16:
        return data
    salt = os.urandom(32)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, salt)  # mkstemp makes it 0600
    except OSError:
        pass
    return salt


# A state file is a few hundred KB at most; events.jsonl's tail is read up to this.
STATE_MAX_BYTES = 16 * 1024 * 1024
EVENTS_TAIL_BYTES = 2 * 1024 * 1024


class StateStore:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "state.json"
        self.write_error: str | None = None

    def load(self) -> tuple[dict[str, Any], str | None]:
        """(state, note): the note says when a corrupt or foreign file was moved aside."""
        try:
            raw = read_regular(self.path, STATE_MAX_BYTES)
        except FileNotFoundError:
            return {}, None
        except RefusedFile as exc:  # a FIFO, a device, a huge file: never ours
            return {}, self._move_aside(exc.strerror or str(exc))
        except OSError as exc:
            return {}, f"{self.path}: unreadable ({exc.strerror}); starting as on a first start"
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data, None
        except ValueError as exc:
            return {}, self._move_aside(f"corrupt ({exc})")

    def _move_aside(self, why: str) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = self.path.with_name(f"state.json.corrupt-{stamp}")
        with contextlib.suppress(OSError):
            os.replace(self.path, aside)
        return f"{self.path} was {why}; moved to {aside.name}; starting as on a first start"

    def save(self, data: dict[str, Any]) -> str | None:
        """Write the state; the error, if the write failed (the caller reports it)."""
        try:
            atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True).encode())
            self.write_error = None
        except OSError as exc:
            self.write_error = f"{self.path}: {exc.strerror or exc}"
        return self.write_error


class EventLog:
    """Append-only JSON lines, with the most recent kept in memory for the API.

    A failed write (disk full) never stops the daemon and is never sticky: every later append
    tries again, and the first that succeeds writes an ``events_gap`` line first, saying how
    many events are missing and why. The events themselves stay in memory (and the API).

    With `retain`, the file keeps the newest `retain` lines: once it holds a tenth more,
    `needs_prune` says so and `prune` (run on a thread) rewrites it atomically. Appends go on
    meanwhile: those that land while the newest lines are copied are carried over under the
    lock before the rename, so no line is lost.
    """

    def __init__(self, path: Path, keep: int = 2000, retain: int | None = None) -> None:
        self.path = path
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self.write_error: str | None = None
        self.lost = 0  # events not written since `write_error` began
        self._mid_line = False  # a failed write left part of a line in the file
        self.seq = 0
        self.retain = retain
        self._lock = threading.Lock()  # the descriptor and the line count, against `prune`
        self._pruning = False
        self.lines = self._count_lines() if retain is not None else 0
        self._load_tail(keep)
        self._fd: int | None = None
        self._open()

    def _count_lines(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        except OSError:
            return 0

    def needs_prune(self) -> bool:
        """The file holds a tenth more than `retain` lines and no prune is under way; the
        caller runs `prune` (on a thread)."""
        if self.retain is None or self._pruning:
            return False
        if self.lines <= self.retain + max(1, self.retain // 10):
            return False
        self._pruning = True
        return True

    def prune(self) -> int:
        """Rewrite the file with its newest `retain` lines (temp file, fsync, rename); the
        number of lines removed. Blocking: run it off the event loop."""
        try:
            return self._prune()
        finally:
            self._pruning = False

    def _prune(self) -> int:
        assert self.retain is not None
        with self._lock:
            if self._fd is None:
                return 0
            size = os.fstat(self._fd).st_size  # what is copied now; later lines follow below
        with open(self.path, "rb") as f:
            kept, dropped = _newest_lines(f, size, self.retain)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.writelines(kept)
                out.flush()
                os.fsync(out.fileno())
                with self._lock:
                    if self._fd is None:
                        raise OSError("the event log was closed")
                    with open(self.path, "rb") as f:  # lines appended since `size`
                        f.seek(size)
                        late = f.read()
                    out.write(late)  # a few lines at most; appended lines get no fsync either
                    out.flush()
                    os.replace(tmp, self.path)
                    new_fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND)
                    os.close(self._fd)
                    self._fd = new_fd
                    self.lines = len(kept) + late.count(b"\n")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return dropped

    def _open(self) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            return True
        except OSError as exc:
            self.write_error = f"{self.path}: {exc.strerror or exc}"
            return False

    def _load_tail(self, keep: int) -> None:
        try:
            lines = read_regular_tail(self.path, EVENTS_TAIL_BYTES).splitlines()
        except OSError:
            return
        for raw in lines[-keep:]:
            with contextlib.suppress(ValueError):
                event = json.loads(raw)
                if isinstance(event, dict):
                    self._recent.append(event)
                    self.seq = max(self.seq, int(event.get("seq", 0) or 0))

    def append(self, event: dict[str, Any]) -> dict[str, Any]:
        """Raises (ValueError, TypeError) for an event that cannot be encoded, keeping
        nothing of it: no seq taken, nothing in memory that /events could not serve."""
        event = {"seq": self.seq + 1, **event}
        line = (json.dumps(event, default=str) + "\n").encode()
        self.seq += 1
        self._recent.append(event)
        with self._lock:
            self._write(line)
        return event

    def _replaced(self) -> bool:
        """events.jsonl is no longer the file written to (moved, deleted or replaced while the
        daemon runs): one stat and one fstat per event."""
        assert self._fd is not None
        try:
            st, ours = os.stat(self.path), os.fstat(self._fd)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # the write that follows tells what is wrong
        return (st.st_ino, st.st_dev) != (ours.st_ino, ours.st_dev)

    def _write(self, line: bytes) -> None:
        if self._fd is not None and self._replaced():
            # Moved or deleted: the events go on in a new events.jsonl, not in the old file.
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            self.lines = self._count_lines() if self.retain is not None else 0
            self._mid_line = False
        if self._fd is None and not self._open():
            self.lost += 1
            return
        assert self._fd is not None
        if self.write_error is not None:
            gap = {
                "ts": event_ts(),
                "event": "events_gap",
                "lost": self.lost,
                "detail": f"{self.lost} events not written: {self.write_error}",
            }
            line = (b"\n" if self._mid_line else b"") + (json.dumps(gap) + "\n").encode() + line
        written = 0
        try:
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                written += n
                view = view[n:]
        except OSError as exc:
            self.write_error = f"{self.path}: {exc.strerror or exc}"
            self.lost += 1
            self._mid_line = self._mid_line or written > 0
            return
        self.write_error, self.lost, self._mid_line = None, 0, False
        self.lines += line.count(b"\n")

    def recent(
        self, limit: int = 100, kind: str | None = None, after: int | None = None
    ) -> list[dict[str, Any]]:
        """The last `limit` events; with `after` (a seq), the first `limit` that follow it,
        so a follower that pages on never skips one."""
        items = [e for e in self._recent if kind is None or e.get("event") == kind]
        if after is not None:
            items = [e for e in items if int(e.get("seq", 0) or 0) > after]
            return items[:limit] if limit > 0 else []
        return items[-limit:] if limit > 0 else []

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None


def _newest_lines(f: BinaryIO, size: int, n: int) -> tuple[list[bytes], int]:
    """(the last `n` whole lines of the file's first `size` bytes, how many lines came
    before them), reading backwards in blocks: only the kept part is held in memory."""
    block = 1 << 20
    end = size
    tail = b""
    while end > 0 and tail.count(b"\n") <= n:
        start = max(0, end - block)
        f.seek(start)
        tail = f.read(end - start) + tail
        end = start
    lines = tail.splitlines(keepends=True)
    kept = lines[-n:] if n > 0 else []
    dropped = len(lines) - len(kept)
    if end > 0:  # the part not read holds lines too: count them
        f.seek(0)
        left = end
        while left > 0:
            chunk = f.read(min(block, left))
            if not chunk:
                break
            dropped += chunk.count(b"\n")
            left -= len(chunk)
    return kept, dropped


def event_ts() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
