"""A launch's output: the per-launch log file, the in-memory ring, readers' feeds, retention.

Output arrives in chunks. Each chunk's whole lines go to the file at once (one unbuffered
write) and are split into lines in memory for the ring and the parser. Arbitrary bytes
never raise: lines are decoded with replacement characters. Ring entries are capped (a longer
line is cut and marked; the file keeps it whole) and so is the ring's total size. The file is
kept within `log_retention.max_bytes` while it is written: its head and its latest output stay,
the middle goes, marked by one line (`LaunchLog._bound`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from .sglanglines import ParsedLine, _interesting, _interesting_bytes, parse_line

RING_ENTRY_MAX = 8 * 1024
RING_LINES = 5000
RING_BYTES = 4 * 1024 * 1024
RUNAWAY_LINE = 1024 * 1024 + 4096  # an unfinished line longer than this is passed on as is
TRUNCATED = " …[truncated; the log file has the whole line]"

# -- the ring -------------------------------------------------------------------------------------


class RingLine(NamedTuple):
    seq: int
    at: float  # wall time the line was read
    text: str


class Ring:
    """The last lines of output, capped in count and in bytes (the newest line always stays).

    Lines are kept in blocks, one per chunk of output, so a flood costs a few operations per
    chunk rather than per line.
    """

    def __init__(self, max_lines: int = RING_LINES, max_bytes: int = RING_BYTES) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        # (seq of the first line, wall time, lines, bytes)
        self._blocks: deque[tuple[int, float, list[str], int]] = deque()
        self._count = 0
        self._bytes = 0
        self.seq = 0  # lines ever added

    def add(self, text: str, at: float) -> None:
        self.extend([text], at)

    def extend(self, texts: list[str], at: float) -> None:
        if not texts:
            return
        skipped = 0
        if len(texts) > self.max_lines:
            skipped = len(texts) - self.max_lines
            texts = texts[skipped:]
        if max(map(len, texts)) > RING_ENTRY_MAX:
            texts = [
                t if len(t) <= RING_ENTRY_MAX else t[:RING_ENTRY_MAX] + TRUNCATED for t in texts
            ]
        nbytes = sum(map(len, texts))
        self._blocks.append((self.seq + skipped + 1, at, texts, nbytes))
        self.seq += skipped + len(texts)
        self._count += len(texts)
        self._bytes += nbytes
        self._trim()

    def _trim(self) -> None:
        blocks = self._blocks
        while self._count > 1 and (self._count > self.max_lines or self._bytes > self.max_bytes):
            first, at, lines, nbytes = blocks[0]
            excess = self._count - self.max_lines
            if len(blocks) > 1 and (excess >= len(lines) or self._bytes - nbytes >= self.max_bytes):
                blocks.popleft()
                self._count -= len(lines)
                self._bytes -= nbytes
                continue
            drop = max(1, min(excess, len(lines) - 1)) if excess > 0 else 1
            if drop >= len(lines):
                break  # the newest line stays
            gone = sum(map(len, lines[:drop]))
            blocks[0] = (first + drop, at, lines[drop:], nbytes - gone)
            self._count -= drop
            self._bytes -= gone

    def tail(self, n: int) -> list[RingLine]:
        out: list[RingLine] = []
        for first, at, lines, _ in reversed(self._blocks):
            if len(out) >= n:
                break
            take = lines[-(n - len(out)) :] if n - len(out) < len(lines) else lines
            start = first + len(lines) - len(take)
            out.extend(reversed([RingLine(start + i, at, t) for i, t in enumerate(take)]))
        out.reverse()
        return out if n > 0 else []

    def since(self, seq: int) -> list[RingLine]:
        """Lines after `seq` still in the ring."""
        return self.tail(max(0, self.seq - seq))

    @property
    def first_seq(self) -> int:
        """The sequence number of the oldest line held (`seq + 1` when empty)."""
        return self._blocks[0][0] if self._blocks else self.seq + 1

    def after(self, seq: int, limit: int) -> tuple[int, list[str]]:
        """Up to `limit` consecutive lines after `seq`, oldest first, and how many lines
        between `seq` and the first of them the ring no longer holds.

        A reader keeps its own `seq` and calls this at its own pace; it costs the reader
        O(its lines + the blocks it is behind), and nothing for the writer."""
        if seq >= self.seq or limit <= 0 or not self._blocks:
            return 0, []
        blocks = self._blocks
        want = seq + 1
        # Readers are mostly at the head: find the block holding `want` from the newest side.
        i = len(blocks) - 1
        while i > 0 and blocks[i][0] > want:
            i -= 1
        first = blocks[i][0]
        gap = max(0, first - want)
        want = max(want, first)
        out: list[str] = []
        while i < len(blocks) and len(out) < limit:
            start, _, lines, _ = blocks[i]
            if start > want:
                break  # a gap inside the ring: the next call reports it
            out.extend(lines[want - start : want - start + limit - len(out)])
            want = start + len(lines)
            i += 1
        return gap, out

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return self._count


class LogFeed:
    """What the capture path tells `/logs/stream` readers: that some ring has grown.

    One wake-up shared by every reader, set once per chunk, whatever the number of readers:
    each reader then pulls the lines it wants from the ring at its own pace and redacts only
    what it sends, so a slow or vanished reader costs the capture path nothing. The event is
    swapped for a fresh one on each set, so a reader that finds nothing new waits for the next
    chunk, not for one it has already read.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._waiting = 0
        self.readers = 0  # streams open now (for /status and /metrics)

    def notify(self, lines: list[str] | None = None) -> None:
        """Called on the capture path (a `line_listeners` entry): O(1) per chunk."""
        if self._waiting:
            self._event.set()
            self._event = asyncio.Event()

    async def wait(self) -> None:
        event = self._event
        self._waiting += 1
        try:
            await event.wait()
        finally:
            self._waiting -= 1

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        self.readers += 1
        try:
            yield
        finally:
            self.readers -= 1


class LogCursor:
    """One reader's place in the current launch's log: the launch log and a sequence number.

    `current` names the launch log being written now. The cursor finishes the log it is on
    before it moves to a newer one, and reports lines the ring let go before it read them.
    """

    def __init__(self, current: Callable[[], LaunchLog | None], history: int = 0) -> None:
        self.current = current
        self.log = current()
        self.seq = 0
        if self.log is not None:
            ring = self.log.ring
            self.seq = max(ring.seq - history, ring.first_seq - 1)

    def read(self, limit: int) -> tuple[int, list[str]]:
        """(lines dropped since the last read, up to `limit` lines redacted for sending)."""
        log = self.log
        now = self.current()
        if now is not None and now is not log and (log is None or self.seq >= log.ring.seq):
            log = self.log = now  # the previous launch is read to its end: follow the next one
            self.seq = 0
        if log is None:
            return 0, []
        gap, lines = log.ring.after(self.seq, limit)
        self.seq += gap + len(lines)
        return gap, [log.redact(line) for line in lines]


def collapse_cr(line: str) -> str:
    """A `\\r` progress bar shows as its last state."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p.strip()]
    return parts[-1] if parts else ""


# -- the per-launch log ---------------------------------------------------------------------------


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
