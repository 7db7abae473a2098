"""A launch's output in memory: the ring of its last lines, and how readers follow it.

The ring's entries are capped (a longer line is cut and marked; the log file keeps it whole) and
so is its total size. `/logs/stream` readers share one wake-up per chunk (`LogFeed`) and each
pulls its own lines from the ring at its own pace (`LogCursor`). The log file and what feeds
the ring: ``launchlog.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .launchlog import LaunchLog

RING_ENTRY_MAX = 8 * 1024
RING_LINES = 5000
RING_BYTES = 4 * 1024 * 1024
TRUNCATED = " …[truncated; the log file has the whole line]"


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
