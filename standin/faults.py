"""Fault injection for the stand-in: which failure to produce, and when.

Each fault is its own ``--standin-*`` flag (see `add_fault_args`); the README lists them with the
SGLang output each one reproduces. This module is data only: the scheduler ranks (rankload.py,
scheduler.py) and the main process act on it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

LOAD_CRASHES = ("cuda_oom", "nccl_init", "not_enough_memory", "capture")


@dataclass(frozen=True)
class Faults:
    crash_on_load: str | None = None  # one of LOAD_CRASHES, raised in the scheduler while loading
    crash_after_s: float | None = None  # a scheduler exception this long after ready
    silent_death_after_s: float | None = None  # a scheduler abort (SIGABRT, no traceback)
    watchdog_after_s: float | None = None  # the scheduler watchdog fires (every rank)
    hang_after_s: float | None = None  # the scheduler stops making progress
    fault_rank: int = 0  # the rank that crashes, dies or hangs
    ignore_sigterm: bool = False  # main ignores SIGTERM
    escape_grandchild_mib: int = 0  # a setsid grandchild that keeps holding fake GPU memory
    flood_lines: int = 0  # main writes this many lines right after ready
    invalid_utf8: bool = False  # main writes a line of bytes that are not UTF-8
    long_line_bytes: int = 0  # main writes one line this long
    escape_sequences: bool = False  # main writes a line of terminal escape sequences
    progress_bars: int = 0  # extra \r progress-bar updates while loading

    def has(self, load_crash: str) -> bool:
        return self.crash_on_load == load_crash

    def after_ready(self, rank: int) -> tuple[str, float] | None:
        """The timed fault this rank fires after ready, if any: (kind, seconds)."""
        if self.watchdog_after_s is not None:
            return "watchdog", self.watchdog_after_s
        if rank != self.fault_rank:
            return None
        for kind, value in (
            ("crash", self.crash_after_s),
            ("silent_death", self.silent_death_after_s),
            ("hang", self.hang_after_s),
        ):
            if value is not None:
                return kind, value
        return None


def add_fault_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--standin-crash-on-load",
        choices=LOAD_CRASHES,
        help="a scheduler raises while loading: CUDA OOM, NCCL init error, 'Not enough "
        "memory', or a CUDA graph capture failure",
    )
    parser.add_argument(
        "--standin-crash-after",
        type=float,
        metavar="S",
        help="a scheduler exception S seconds after ready",
    )
    parser.add_argument(
        "--standin-silent-death-after",
        type=float,
        metavar="S",
        help="a scheduler aborts (C++-level, no traceback) S seconds after ready",
    )
    parser.add_argument(
        "--standin-watchdog-after",
        type=float,
        metavar="S",
        help="the scheduler watchdog fires S seconds after ready",
    )
    parser.add_argument(
        "--standin-hang-after",
        type=float,
        metavar="S",
        help="the scheduler stops making progress S seconds after ready",
    )
    parser.add_argument(
        "--standin-fault-rank",
        type=int,
        default=0,
        metavar="R",
        help="the TP rank that crashes, dies or hangs (default 0)",
    )
    parser.add_argument(
        "--standin-ignore-sigterm", action="store_true", help="the main process ignores SIGTERM"
    )
    parser.add_argument(
        "--standin-escape-grandchild",
        type=int,
        default=0,
        metavar="MIB",
        help="scheduler 0 starts a setsid grandchild that ignores SIGTERM and "
        "holds MIB of fake GPU memory after the server is gone",
    )
    parser.add_argument(
        "--standin-flood",
        type=int,
        default=0,
        metavar="N",
        help="write N log lines right after ready",
    )
    parser.add_argument(
        "--standin-invalid-utf8",
        action="store_true",
        help="write a line of bytes that are not UTF-8 after ready",
    )
    parser.add_argument(
        "--standin-long-line",
        type=int,
        default=0,
        metavar="BYTES",
        help="write one line of BYTES bytes after ready (1048576 for 1 MiB)",
    )
    parser.add_argument(
        "--standin-escape-sequences",
        action="store_true",
        help="write a line of terminal escape sequences (title, clear screen, colour, a C1 "
        "CSI) after ready",
    )
    parser.add_argument(
        "--standin-progress-bars",
        type=int,
        default=0,
        metavar="N",
        help="N extra \\r progress-bar updates while loading",
    )
    parser.add_argument(
        "--standin-malformed-chunk",
        default=None,
        metavar="TEXT",
        help="every streamed answer (OpenAI and /generate) begins with the event 'data: TEXT' "
        "(1, not-json, [1]: not a chunk a client can read)",
    )


def faults_from_args(args: argparse.Namespace) -> Faults:
    return Faults(
        crash_on_load=args.standin_crash_on_load,
        crash_after_s=args.standin_crash_after,
        silent_death_after_s=args.standin_silent_death_after,
        watchdog_after_s=args.standin_watchdog_after,
        hang_after_s=args.standin_hang_after,
        fault_rank=args.standin_fault_rank,
        ignore_sigterm=args.standin_ignore_sigterm,
        escape_grandchild_mib=args.standin_escape_grandchild,
        flood_lines=args.standin_flood,
        invalid_utf8=args.standin_invalid_utf8,
        long_line_bytes=args.standin_long_line,
        progress_bars=args.standin_progress_bars,
        escape_sequences=args.standin_escape_sequences,
    )
