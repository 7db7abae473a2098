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
import time
from collections import deque
from pathlib import Path
from typing import Any


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


class StateStore:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "state.json"
        self.write_error: str | None = None

    def load(self) -> tuple[dict[str, Any], str | None]:
        """(state, note): the note says when a corrupt file was moved aside."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, None
        except OSError as exc:
            return {}, f"{self.path}: unreadable ({exc.strerror}); starting as on a first start"
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data, None
        except ValueError as exc:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            aside = self.path.with_name(f"state.json.corrupt-{stamp}")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            return {}, f"{self.path} was corrupt ({exc}); moved to {aside.name}"

    def save(self, data: dict[str, Any]) -> bool:
        try:
            atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True).encode())
            self.write_error = None
            return True
        except OSError as exc:
            self.write_error = f"{self.path}: {exc.strerror or exc}"
            return False


class EventLog:
    """Append-only JSON lines, with the most recent kept in memory for the API."""

    def __init__(self, path: Path, keep: int = 2000) -> None:
        self.path = path
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self.write_error: str | None = None
        self.seq = 0
        self._load_tail(keep)
        self._file = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)
        except OSError as exc:
            self.write_error = f"{path}: {exc.strerror or exc}"

    def _load_tail(self, keep: int) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 2 * 1024 * 1024))
                lines = f.read().splitlines()
        except OSError:
            return
        for raw in lines[-keep:]:
            with contextlib.suppress(ValueError):
                event = json.loads(raw)
                if isinstance(event, dict):
                    self._recent.append(event)
                    self.seq = max(self.seq, int(event.get("seq", 0) or 0))

    def append(self, event: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        event = {"seq": self.seq, **event}
        self._recent.append(event)
        if self._file is not None:
            try:
                self._file.write(json.dumps(event, default=str) + "\n")
                self.write_error = None
            except OSError as exc:
                self.write_error = f"{self.path}: {exc.strerror or exc}"
        return event

    def recent(self, limit: int = 100, kind: str | None = None) -> list[dict[str, Any]]:
        items = [e for e in self._recent if kind is None or e.get("event") == kind]
        return items[-limit:] if limit > 0 else []

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
