"""A launch's log file, written from the server's output as it comes, within its cap.

Standard library only and no package imports: the daemon writes launch logs with it
(`launchlog.LaunchLog`), and so can a writer outside the daemon that loads this file by its
path, so a log has the same shape whoever writes it:

* Only whole lines go to the file, so the two streams interleave at line boundaries; a stream's
  unfinished line waits for its next chunk (or for `close`). A runaway line with no newline is
  passed on once it is longer than `RUNAWAY_LINE`.
* One unbuffered write per chunk: the file is current at every moment.
* A failed write (disk full, file too large) never stops anything and is never sticky: the first
  later write that works is preceded by a line saying what is missing.
* The file is kept within `max_bytes` while it is written: its head (the header, the startup)
  and its latest output stay, the middle goes, marked by one line (`_bound`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

RUNAWAY_LINE = 1024 * 1024 + 4096  # an unfinished line longer than this is passed on as is


class LogFile:
    """One launch's log file. Created with its `head` (bytes, whole lines) or `OSError`."""

    def __init__(
        self,
        path: str,
        head: bytes,
        *,
        max_bytes: int | None = None,
        on_write: Callable[[str | None], None] | None = None,
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
        self.write_error: str | None = None
        self.lost_bytes = 0  # output not written since `write_error` began
        self.lost_lines = 0
        self._mid_line = False  # a failed write left part of a line in the file
        self._partials: dict[int, bytes] = {}
        self.closed = False
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o640
        )
        try:
            os.write(self._fd, head)
        except OSError:
            os.close(self._fd)
            raise
        self._size = self._head_end = len(head)

    @property
    def size(self) -> int:
        return self._size

    def feed(self, chunk: bytes, stream: int = 2) -> bytes:
        """Take a chunk of output from one stream (1 stdout, 2 stderr); write its whole lines.
        Returns them (ending with a newline), or b"" while the stream's line is unfinished."""
        data = self._partials.pop(stream, b"") + chunk if stream in self._partials else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            if len(data) <= RUNAWAY_LINE:
                self._partials[stream] = data
                return b""
            data += b"\n"  # a runaway line without a newline: pass it on, keep reading
            cut = len(data) - 1
        elif cut + 1 < len(data):
            self._partials[stream] = data[cut + 1 :]
            data = data[: cut + 1]
        self.write(data)
        return data

    def end_stream(self, stream: int) -> bytes:
        """The stream's output is over: its unfinished line, ended and written (b"": none)."""
        return self.feed(b"\n", stream) if stream in self._partials else b""

    def flush_partials(self) -> list[tuple[int, bytes]]:
        """The streams' unfinished lines, ended and written (their output is over)."""
        ended = [(stream, self.feed(b"\n", stream)) for stream in list(self._partials)]
        return [(stream, data) for stream, data in ended if data]

    def write(self, data: bytes) -> None:
        """Write whole lines (see the module's rules on failures and the cap)."""
        failing = self.write_error is not None
        prefix = b""
        if failing:
            prefix = (
                f"{chr(10) if self._mid_line else ''}# gpuwarden: {self.lost_bytes} bytes "
                f"({self.lost_lines} lines) of output not written here: {self.write_error}\n"
            ).encode()
        written = 0
        try:
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

    def close(self, trailer: bytes = b"") -> None:
        if self.closed:
            return
        self.flush_partials()
        if trailer:
            self.write(trailer)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self.closed = True
