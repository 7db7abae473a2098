"""SGLang's log lines, read: the ready line, Decode batch figures, errors, death lines, the
lines that begin a phase of its start.

Pure functions of one line (no I/O): `parse_line` finds what a line says, `_interesting` and
`_interesting_bytes` are the cheap pre-filters the capture path runs first, `decode_metrics`
turns one Decode batch line into `/status`'s server_metrics.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

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
# Cheap pre-filter (plain substring search, far faster than a regex alternation): a chunk or
# line without any of these has nothing for the parser.
_KEYWORDS = (
    "batch",  # Decode batch / Prefill batch
    "ready to roll",  # the ready line
    "rror",  # Error/error: exceptions, argparse, NCCL errors, CUDA OOM, uvicorn's bind error
    "xception",  # "Scheduler hit an exception", "Exception: Capture cuda graph failed"
    "atchdog",  # scheduler watchdog timeouts, torch's NCCL watchdog
    "dead",  # "Rank 0 scheduler is dead"
    "crashed",  # "Subprocess scheduler_0 (pid=N) crashed with exit code"
    "IGQUIT",  # "SIGQUIT received. ... one child failed."
    "igquit",  # "Received sigquit from a child process."
)
# Looked for only while a launch starts (its phases' lines, `phase_of`), in the spellings
# SGLang's versions print: a served flood pays nothing for them.
_START_KEYWORDS = (
    *_KEYWORDS,
    "oad weight",
    "ache is allocated",
    "emory pool end",
    "raph begin",
    "raph end",
    "vicorn running",
)
_KEYWORDS_B = tuple(k.encode() for k in _KEYWORDS)
_START_KEYWORDS_B = tuple(k.encode() for k in _START_KEYWORDS)


def _interesting_bytes(data: bytes, starting: bool = False) -> bool:
    return any(k in data for k in (_START_KEYWORDS_B if starting else _KEYWORDS_B))


def _interesting(line: str, starting: bool = False) -> bool:
    return any(k in line for k in (_START_KEYWORDS if starting else _KEYWORDS))


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
    findings: list[Finding] = field(default_factory=list)
    # SGLang says the server is dead: a child crashed, SIGQUIT came from one, a manager's loop
    # hit an exception. It may still linger (crash diagnostics, a 60 s coredump wait) with its
    # port open, but it will never serve again.
    death: bool = False
    # The phase of the start this line begins (`phase_of`), if it begins one.
    phase: str | None = None


# The lines SGLang prints when a process of the server has died (0.5.x), each from its logger
# and so after its `[YYYY-MM-DD HH:MM:SS]` prefix:
#   Subprocess scheduler_0 (pid=N) crashed with exit code -9. Triggering SIGQUIT for cleanup...
#   SIGQUIT received. signum=None, frame=None. It usually means one child failed.
#   Received sigquit from a child process. It usually means the child failed.   (while loading)
#   Scheduler hit an exception: Traceback ...   (also DetokenizerManager, TokenizerManager,
#                                                DataParallelController, *Router)
#   ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', P): ...
# Only the message's start counts, after a real prefix: text a client controls (a prompt that
# `--log-requests` logs inside `Receive: obj=...`, a traceback's message lines) cannot kill
# a healthy server by mentioning these words.
_DEATH = re.compile(
    r"(?:Subprocess \S+ \(pid=\d+\) crashed with exit code -?\d+"
    r"|SIGQUIT received\. "
    r"|Received sigquit from a child proces"
    r"|[A-Z]\w* hit an exception: "
    # uvicorn could not bind: SGLang only waits for its warm-up (up to 120 tries of 5 s against
    # whatever holds the port) before it exits.
    r"|(?:ERROR:\s+)?\[Errno \d+\] error while attempting to bind on address )"
)
_HIT_AN_EXCEPTION = re.compile(r"^[A-Z]\w* hit an exception")


# The lines that begin a phase of a start (`phases.py`), matched on the message without its
# prefix, case-insensitively (older logs say `Capture cuda graph begin`, 0.5.23 `Capture target
# decode CUDA graph begin`, the draft's `Capture draft cuda graph begin`):
#   Load weight begin. avail mem=...               -> weights (the target's, then the draft's)
#   Load weight end. elapsed=...                   -> kv_cache (sized and allocated next)
#   KV Cache is allocated. ... / Memory pool end.  -> init (the engine's own work between)
#   Capture ... cuda graph begin.                  -> cuda_graphs (the CPU's `CPU graph` too)
#   Capture ... cuda graph end.                    -> init
#   INFO:     Uvicorn running on http://...         -> warmup (its HTTP server is up; ready next)
_PHASE_LINES = (
    (re.compile(r"load weight begin\b", re.I), "weights"),
    (re.compile(r"load weight end\b", re.I), "kv_cache"),
    (re.compile(r"(?:kv cache is allocated|memory pool end)\b", re.I), "init"),
    (re.compile(r"capture (?:[\w ]+ )?(?:cuda|cpu) graph begin\b", re.I), "cuda_graphs"),
    (re.compile(r"capture (?:[\w ]+ )?(?:cuda|cpu) graph end\b", re.I), "init"),
    (re.compile(r"(?:INFO:\s+)?uvicorn running on ", re.I), "warmup"),
)
_RANK = re.compile(r"[A-Z_]+(\d+)")


def phase_of(line: str) -> str | None:
    """The phase of a start that `line` (as read, with its prefix) begins, if any. Only rank 0
    speaks for the start (each tensor-parallel rank logs its own `Load weight begin`); uvicorn's
    own lines have no prefix."""
    m = _PREFIX.match(line)
    if m is not None and any(int(n) for n in _RANK.findall(m.group("ranks"))):
        return None
    msg = line[m.end() :] if m else line
    for pattern, phase in _PHASE_LINES:
        if pattern.match(msg):
            return phase
    return None


def announces_death(line: str) -> bool:
    """`line` as read (with its prefix): does SGLang say here that the server is dead?"""
    m = _PREFIX.match(line)
    return m is not None and _DEATH.match(line, m.end()) is not None


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
    if msg.startswith("server_args="):
        # SGLang's settings at start: values (paths, names, `watchdog_timeout=300`, an NCCL
        # flag) are no report of anything that happened.
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
    if msg.startswith("Prefill batch"):  # nothing in it to find
        return out
    out.phase = phase_of(line.strip())
    if out.phase is not None:
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
    if _EXCEPTION_LINE.match(msg) or _HIT_AN_EXCEPTION.match(msg):
        find(Finding("exception", msg))
    out.death = announces_death(line.strip())
    return out


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
