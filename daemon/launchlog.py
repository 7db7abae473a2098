"""A launch's log as the daemon keeps it: the file (`logfile.py`: whole lines, one
unbuffered write a chunk, within its cap) and, from the same chunks, the lines in memory for
the ring (``logring.py``) and the parser. Arbitrary bytes never raise: lines are decoded with
replacement characters.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from .logfile import LogFile
from .logring import Ring
from .sglanglines import ParsedLine, _interesting, _interesting_bytes, parse_line


def collapse_cr(line: str) -> str:
    """A `\\r` progress bar shows as its last state."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p.strip()]
    return parts[-1] if parts else ""


# Control characters and Unicode line breaks (what str.splitlines splits on, besides \n).
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    r"""`text` on one line, control characters escaped (``\n``, ``\x1b``, ``\u2028``): an
    argv element or env value with a newline must not add lines to a header."""
    return _CONTROLS.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


def header_bytes(header: Iterable[str], redact: Callable[[str], str]) -> bytes:
    """A launch log's first lines: its header, redacted, one line each."""
    return "".join(f"# {escape_controls(redact(h))}\n" for h in header).encode()


class FileWriter(Protocol):
    """What writes a launch's file: `LogFile` here, or the shim's side of it."""

    @property
    def closed(self) -> bool: ...

    def feed(self, chunk: bytes, stream: int = 2) -> bytes: ...
    def flush_partials(self) -> list[tuple[int, bytes]]: ...
    def close(self, trailer: bytes = b"") -> None: ...


class LaunchLog:
    """One launch's log file (`logfile.py`, its rules) plus its ring, fed with raw
    chunks from the child's pipes.

    The file is created (with its header) right after the child's exec, before any of its
    output is read; `LogUnwritable` then ends the child and fails the launch.
    """

    def __init__(
        self,
        path: Path,
        header: Iterable[str],
        on_lines: Callable[[list[str], list[tuple[str, ParsedLine]]], None] | None = None,
        ring: Ring | None = None,
        redact: Callable[[str], str] | None = None,
        *,
        on_write: Callable[[str | None], None] | None = None,
        max_bytes: int | None = None,
        file: FileWriter | None = None,
        starting: Callable[[], bool] = lambda: False,
    ) -> None:
        self.path = path
        self.ring = ring or Ring()
        self.on_lines = on_lines
        self.starting = starting  # its launch starts: the lines of its phases are looked for
        self.redact = redact or (lambda s: s)
        self.lines = 0
        if file is not None:  # written by another (the shim): it hands on whole lines
            self.file = file
            return
        try:
            head = header_bytes(header, self.redact)
            self.file = LogFile(str(path), head, max_bytes=max_bytes, on_write=on_write)
        except OSError as exc:
            raise LogUnwritable(f"{path}: {exc.strerror or exc}") from exc

    @property
    def closed(self) -> bool:
        return self.file.closed

    def feed(self, chunk: bytes, stream: int = 2) -> None:
        """Take a chunk of output from one stream (1 stdout, 2 stderr): its whole lines go to
        the file, then to the ring and the parser."""
        data = self.file.feed(chunk, stream)
        if data:
            self._lines(data[:-1], interesting=_interesting_bytes(data, self.starting()))

    def _lines(self, data: bytes, interesting: bool) -> None:
        """`data` holds whole lines without the final newline. One decode and one split per
        chunk; the parser sees only lines that may matter. The ring keeps the raw text:
        whatever serves it redacts it."""
        text = data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        if "\r" in text:
            lines = [collapse_cr(line) for line in lines]
        self.lines += len(lines)
        self.ring.extend(lines, time.time())
        parsed: list[tuple[str, ParsedLine]] = []
        if interesting:
            starting = self.starting()
            for line in lines:
                if _interesting(line, starting):
                    result = parse_line(line)
                    if result.ready or result.decode is not None or result.findings or result.phase:
                        parsed.append((line, result))
        if self.on_lines is not None:
            self.on_lines(lines, parsed)

    def close(self, trailer: str | None = None) -> None:
        if self.file.closed:
            return
        for _, data in self.file.flush_partials():
            self._lines(data[:-1], interesting=_interesting_bytes(data, self.starting()))
        self.file.close(f"# {escape_controls(trailer)}\n".encode() if trailer else b"")


class LogUnwritable(Exception):
    pass
