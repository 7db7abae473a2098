"""A launch's log file: written from the child's output as it comes, within its cap.

Output arrives in chunks. Each chunk's whole lines go to the file at once (one unbuffered
write) and are split into lines in memory for the ring (``logring.py``) and the parser.
Arbitrary bytes never raise: lines are decoded with replacement characters. The file is
kept within `log_retention.max_bytes` while it is written: its head and its latest output stay,
the middle goes, marked by one line (`LaunchLog._bound`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .logring import Ring
from .sglanglines import ParsedLine, _interesting, _interesting_bytes, parse_line

RUNAWAY_LINE = 1024 * 1024 + 4096  # an unfinished line longer than this is passed on as is


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


class LaunchLog:
    """One launch's log file plus its ring, fed with raw chunks from the child's pipes.

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
    ) -> None:
        self.path = path
        # The file's cap (`log_retention.max_bytes`): past it, the middle goes (see `_bound`).
        self.max_bytes = max_bytes
        self.dropped_bytes = 0  # output dropped from the middle to keep within `max_bytes`
        self._size = 0  # the file's size, as written here
        self._head_end = 0  # the end of the head that always stays (header, the startup)
        self._marker_len = 0  # the gap line right after the head, once there is one
        self._head_open = True  # the head still grows with each write
        # Called when writing starts failing (the error) and when it works again (None).
        self.on_write = on_write
        self.lost_bytes = 0  # output not written since `write_error` began
        self.lost_lines = 0
        self._mid_line = False  # a failed write left part of a line in the file
        self.ring = ring or Ring()
        self.on_lines = on_lines
        self.redact = redact or (lambda s: s)
        self._partials: dict[int, bytes] = {}
        self.lines = 0
        self.closed = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o640
            )
            head = "".join(f"# {escape_controls(self.redact(h))}\n" for h in header).encode()
            os.write(self._fd, head)
            self._size = self._head_end = len(head)
        except OSError as exc:
            raise LogUnwritable(f"{path}: {exc.strerror or exc}") from exc
        self.write_error: str | None = None

    def feed(self, chunk: bytes, stream: int = 2) -> None:
        """Take a chunk of output from one stream (1 stdout, 2 stderr).

        Only whole lines go to the file, so chunks of the two streams interleave at line
        boundaries; a stream's unfinished line waits for its next chunk (or for `close`).
        """
        data = self._partials.pop(stream, b"") + chunk if stream in self._partials else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            if len(data) <= RUNAWAY_LINE:
                self._partials[stream] = data
                return
            data += b"\n"  # a runaway line without a newline: pass it on, keep reading
            cut = len(data) - 1
        elif cut + 1 < len(data):
            self._partials[stream] = data[cut + 1 :]
            data = data[: cut + 1]
        self._write(data)
        self._lines(data[:-1], interesting=_interesting_bytes(data))

    def _write(self, data: bytes) -> None:
        """Write a chunk of whole lines. A failure (disk full, file too large) never stops
        supervision and is never sticky: each later chunk tries again, and the first that is
        written is preceded by a line saying what is missing."""
        failing = self.write_error is not None
        prefix = b""
        if failing:
            prefix = (
                f"{chr(10) if self._mid_line else ''}# gpuwarden: {self.lost_bytes} bytes "
                f"({self.lost_lines} lines) of output not written here: {self.write_error}\n"
            ).encode()
        written = 0
        try:
            # One unbuffered write per chunk: the file is current at every moment, with no
            # flush timer, and big chunks keep the syscall count low.
            view = memoryview(prefix + data if prefix else data)
            while view:
                n = os.write(self._fd, view)
                written += n
                view = view[n:]
        except OSError as exc:
            self._size += written
            if written > len(prefix) or (written and not prefix):
                self._mid_line = True  # the file now ends inside a line
            done = max(0, written - len(prefix))
            self.lost_bytes += len(data) - done
            self.lost_lines += data.count(b"\n", done)
            self.write_error = f"{self.path}: {exc.strerror or exc}"
            if not failing and self.on_write is not None:
                self.on_write(self.write_error)
            return
        self._size += written
        if self.max_bytes is not None:  # a comparison or two per chunk
            if self._head_open:
                self._grow_head(data, self.max_bytes // 4)
            if self._size > self.max_bytes:
                self._bound(self.max_bytes)
        if failing:
            self.write_error, self.lost_bytes, self.lost_lines = None, 0, 0
            self._mid_line = False
            if self.on_write is not None:
                self.on_write(None)

    def _grow_head(self, data: bytes, limit: int) -> None:
        """The head is the file's first `limit` bytes, to the end of their last whole line."""
        if self._size <= limit:
            self._head_end = self._size  # a write ends with a whole line
            return
        start = self._size - len(data)
        cut = data.rfind(b"\n", 0, max(0, limit - start))
        if cut >= 0:
            self._head_end = start + cut + 1
        self._head_open = False

    def _bound(self, cap: int) -> None:
        """Bring the file back under `cap`: the head (the header and the first quarter: the
        startup's evidence) and the last quarter (the latest output: a crash's evidence) stay;
        what lies between goes, replaced by one line saying how much is missing. Every later
        crossing replaces that line and what follows it again, so a flood costs one copy of a
        quarter of the cap per half of the cap written."""
        keep = cap // 4
        start = max(self._head_end, self._size - keep)
        try:
            tail = os.pread(self._fd, self._size - start, start)
            nl = tail.find(b"\n")
            if 0 <= nl < len(tail) - 1 and start > self._head_end:
                tail = tail[nl + 1 :]  # from a line's start
            self.dropped_bytes += self._size - self._head_end - len(tail) - self._marker_len
            marker = (
                f"# gpuwarden: {self.dropped_bytes} bytes of output dropped here: the running "
                f"log is kept within log_retention.max_bytes ({cap}); its head and its latest "
                "output stay\n"
            ).encode()
            os.ftruncate(self._fd, self._head_end)
            self._size = self._head_end
            view = memoryview(marker + tail)
            while view:  # O_APPEND: at the new end
                n = os.write(self._fd, view)
                self._size += n
                view = view[n:]
            self._marker_len = len(marker)
        except OSError:
            with contextlib.suppress(OSError):
                self._size = os.fstat(self._fd).st_size

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
            for line in lines:
                if _interesting(line):
                    result = parse_line(line)
                    if result.ready or result.decode is not None or result.findings:
                        parsed.append((line, result))
        if self.on_lines is not None:
            self.on_lines(lines, parsed)

    def close(self, trailer: str | None = None) -> None:
        if self.closed:
            return
        for stream in list(self._partials):
            self.feed(b"\n", stream)
        if trailer:
            self._write(f"# {escape_controls(trailer)}\n".encode())
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self.closed = True


class LogUnwritable(Exception):
    pass
