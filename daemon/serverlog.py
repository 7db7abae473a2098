"""A launch's output: the per-launch log file, the in-memory ring, SGLang line parsing, retention.

Output arrives in chunks. Each chunk goes to the file whole (buffered; flushed on a short timer
and at exit) and is split into lines in memory for the ring and the parser. Arbitrary bytes
never raise: lines are decoded with replacement characters. Ring entries are capped (a longer
line is cut and marked; the file keeps it whole) and so is the ring's total size.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RING_ENTRY_MAX = 8 * 1024
RING_LINES = 5000
RING_BYTES = 4 * 1024 * 1024
RUNAWAY_LINE = 1024 * 1024 + 4096  # an unfinished line longer than this is passed on as is
TRUNCATED = " …[truncated; the log file has the whole line]"

# -- the parser -----------------------------------------------------------------------------------

# [2025-03-09 00:57:15 TP4] or [2025-06-26 07:25:31.123 DP4 TP4] or [2025-11-30 11:18:01]
_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?(?P<ranks>(?: [A-Z_]+\d+)*)\] ")
_FIELDS = {
    "running_req": re.compile(r"#running-req: (\d+)"),
    "queue_req": re.compile(r"#queue-req: (\d+)"),
    "token_usage": re.compile(r"(?:^|, )(?:full )?token usage: ([\d.]+)"),
    "accept_len": re.compile(r"accept len: ([\d.]+)"),
    "accept_rate": re.compile(r"accept rate: ([\d.]+)"),
    "gen_throughput_tok_s": re.compile(r"gen throughput \(token/s\): ([\d.]+)"),
}
# Cheap pre-filter: a chunk without any of these bytes has nothing for the parser.
_INTERESTING = re.compile(
    rb"batch|ready to roll|rror|xception|Traceback|memory|NCCL|nccl|atchdog|sigquit|SIGQUIT|"
    rb"already in use|usage:|Killed|dead|died|crashed|Health check failed|Unknown"
)
_ARGPARSE_ERROR = re.compile(
    r"^(?:usage: )?.*?: error: (?:unrecognized arguments|ambiguous option|argument |"
    r"the following arguments are required|invalid choice|expected )"
)
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Exit)\b")

READY_LINE = "The server is fired up and ready to roll!"


@dataclass(frozen=True)
class Finding:
    """A line that explains something: its kind and the line itself."""

    kind: str  # cuda_oom | nccl_error | watchdog_timeout | port_in_use | config_error |
    # exception | sigquit | scheduler_dead | health_failed
    line: str


@dataclass
class ParsedLine:
    ready: bool = False
    decode: dict[str, float] | None = None
    prefill: bool = False
    findings: list[Finding] = field(default_factory=list)


def strip_prefix(line: str) -> str:
    m = _PREFIX.match(line)
    return line[m.end() :] if m else line


def parse_line(line: str) -> ParsedLine:
    """Classify one line of SGLang output. Never raises."""
    out = ParsedLine()
    msg = strip_prefix(line).strip()
    if not msg:
        return out
    if READY_LINE in msg:
        out.ready = True
        return out
    if msg.startswith("Decode batch"):
        values: dict[str, float] = {}
        for key, rx in _FIELDS.items():
            m = rx.search(msg)
            if m:
                with contextlib.suppress(ValueError):
                    values[key] = float(m.group(1))
        out.decode = values
        return out
    if msg.startswith("Prefill batch"):
        out.prefill = True
        return out
    find = out.findings.append
    if (
        "CUDA out of memory" in msg
        or "OutOfMemoryError" in msg
        or "Not enough memory. Please try to increase --mem-fraction-static" in msg
        or "Capture cuda graph failed: CUDA error: out of memory" in msg
    ):
        find(Finding("cuda_oom", msg))
    elif ("NCCL" in msg and ("error" in msg.lower() or "Watchdog caught" in msg)) or msg.startswith(
        ("ncclSystemError", "ncclInternalError", "ncclUnhandledCudaError", "ncclRemoteError")
    ):
        find(Finding("nccl_error", msg))
    elif "Watchdog timeout (self.watchdog_timeout" in msg or msg.startswith(
        "Scheduler watchdog timeout ("
    ):
        find(Finding("watchdog_timeout", msg))
    elif "address already in use" in msg:
        find(Finding("port_in_use", msg))
    elif _ARGPARSE_ERROR.match(msg):
        find(Finding("config_error", msg))
    elif msg.startswith(("Received sigquit from a child proces", "SIGQUIT received.")):
        find(Finding("sigquit", msg))
    elif (
        "scheduler is dead" in msg
        or "scheduler died during initialization" in msg
        or (msg.startswith("Subprocess ") and "crashed with exit code" in msg)
    ):
        find(Finding("scheduler_dead", msg))
    elif msg.startswith("Health check failed."):
        find(Finding("health_failed", msg))
    if _EXCEPTION_LINE.match(msg) or msg.startswith(
        ("Scheduler hit an exception", "DetokenizerManager hit an exception")
    ):
        find(Finding("exception", msg))
    return out


# -- the ring -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingLine:
    seq: int
    at: float  # wall time the line was read
    text: str


class Ring:
    """The last lines of output, capped in count and in bytes."""

    def __init__(self, max_lines: int = RING_LINES, max_bytes: int = RING_BYTES) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._lines: deque[RingLine] = deque()
        self._bytes = 0
        self.seq = 0  # lines ever added
        self.truncated = 0

    def add(self, text: str, at: float) -> RingLine:
        if len(text) > RING_ENTRY_MAX:
            text = text[:RING_ENTRY_MAX] + TRUNCATED
            self.truncated += 1
        self.seq += 1
        entry = RingLine(self.seq, at, text)
        self._lines.append(entry)
        self._bytes += len(text)
        while len(self._lines) > 1 and (
            len(self._lines) > self.max_lines or self._bytes > self.max_bytes
        ):
            self._bytes -= len(self._lines.popleft().text)
        return entry

    def tail(self, n: int) -> list[RingLine]:
        if n <= 0:
            return []
        return list(self._lines)[-n:]

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._lines)


def collapse_cr(line: str) -> str:
    """A `\\r` progress bar shows as its last state."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p.strip()]
    return parts[-1] if parts else ""


# -- the per-launch log ---------------------------------------------------------------------------


class LaunchLog:
    """One launch's log file plus its ring, fed with raw chunks from the child's pipes.

    The file is created (with its header) before the child is started; `LogUnwritable` then
    fails the launch.
    """

    def __init__(
        self,
        path: Path,
        header: Iterable[str],
        on_line: Callable[[str, ParsedLine | None], None] | None = None,
        ring: Ring | None = None,
        redact: Callable[[str], str] | None = None,
    ) -> None:
        self.path = path
        self.ring = ring or Ring()
        self.on_line = on_line
        self.redact = redact or (lambda s: s)
        self._partials: dict[int, bytes] = {}
        self.bytes_written = 0
        self.lines = 0
        self.closed = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
            self._file = os.fdopen(fd, "wb", buffering=1 << 20)
            head = "".join(f"# {self.redact(h)}\n" for h in header).encode()
            self._file.write(head)
            self._file.flush()
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
        self._lines(data[:-1].split(b"\n"), interesting=_INTERESTING.search(data) is not None)

    def _write(self, data: bytes) -> None:
        if self.write_error is not None:
            return
        try:
            self._file.write(data)
            self.bytes_written += len(data)
        except OSError as exc:  # disk full, file too large: keep supervising
            self.write_error = f"{self.path}: {exc.strerror or exc}"

    def _lines(self, complete: list[bytes], interesting: bool) -> None:
        now = time.time()
        self.lines += len(complete)
        for raw in complete:
            text = collapse_cr(raw.decode("utf-8", errors="replace"))
            parsed = parse_line(text) if interesting else None
            self.ring.add(self.redact(text), now)
            if self.on_line is not None:
                self.on_line(text, parsed)

    def flush(self) -> None:
        if self.closed or self.write_error is not None:
            return
        try:
            self._file.flush()
        except OSError as exc:
            self.write_error = f"{self.path}: {exc.strerror or exc}"

    def close(self, trailer: str | None = None) -> None:
        if self.closed:
            return
        for stream in list(self._partials):
            self.feed(b"\n", stream)
        with contextlib.suppress(OSError):
            if trailer:
                self._file.write(f"# {trailer}\n".encode())
            self._file.flush()
        with contextlib.suppress(OSError):
            self._file.close()
        self.closed = True


class LogUnwritable(Exception):
    pass


def read_tail(path: Path, lines: int, max_bytes: int = 4 * 1024 * 1024) -> list[str]:
    """The last `lines` lines of a log file (for launches whose ring is gone)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace").splitlines()
    return [collapse_cr(t) for t in text[-lines:]] if lines > 0 else []


# -- retention ------------------------------------------------------------------------------------


def prune_logs(log_dir: Path, keep_launches: int, max_bytes: int, protect: set[str]) -> list[Path]:
    """Delete the oldest launch logs beyond the limits; never those named in `protect`."""
    files: list[tuple[str, Path, int]] = []
    for path in log_dir.glob("*/*.log"):
        with contextlib.suppress(OSError):
            files.append((path.stem, path, path.stat().st_size))
    files.sort()  # launch ids sort by time
    total = sum(size for _, _, size in files)
    count = len(files)
    removed: list[Path] = []
    for launch_id, path, size in files:
        if count <= keep_launches and total <= max_bytes:
            break
        if launch_id in protect:
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
            count -= 1
            total -= size
    return removed


def decode_metrics(values: dict[str, Any]) -> dict[str, Any]:
    """The server_metrics fields of /status from one Decode batch line."""
    out: dict[str, Any] = {}
    for key in ("gen_throughput_tok_s", "accept_len", "accept_rate", "token_usage"):
        if key in values:
            out[key] = values[key]
    for key in ("running_req", "queue_req"):
        if key in values:
            out[key] = int(values[key])
    return out
