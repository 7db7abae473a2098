"""A launch's start in phases: which one it is in (from its log lines), how long each took, and
when it will be ready (from earlier launches of the same config).

The phases, in SGLang's order (`sglanglines.phase_of` says which line begins which):
`init` (from the exec: Python, torch, the distributed setup, and the engine's own work between
the named phases), `weights`, `kv_cache`, `cuda_graphs`, `warmup` (its HTTP server is up; the
warm-up request and the first health probe), then ready. A speculative config repeats
`weights`, `kv_cache` and `cuda_graphs` for its draft model: each repeat is a segment of its own
and a phase's total adds them up.

The ETA: the newest launches of the same config (name and hash) that reached ready, lined up
segment by segment with this one. What remains is the rest of the current segment (its median
duration less what has passed, never below zero) and the medians of the segments after it.
Where this launch's segments so far differ from theirs (a config that logs otherwise, a
retried capture), the median time to ready less the time since the exec stands in.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PHASES = ("init", "weights", "kv_cache", "cuda_graphs", "warmup")
ETA_LAUNCHES = 5  # the newest launches of a config an ETA is made from
MAX_MARKS = 64  # a log that flaps between phases keeps its first marks only


@dataclass
class PhaseClock:
    """The phases a launch's log said it began, with when (monotonic). Written by the log
    pipeline only; read by the views (a snapshot holds the object, as it holds the log)."""

    marks: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, phase: str, at: float) -> None:
        if self.marks and self.marks[-1][0] == phase:
            return
        if len(self.marks) < MAX_MARKS:
            self.marks.append((phase, at))

    def segments(self, start: float, end: float) -> list[tuple[str, float]]:
        """The segments from `start` (the exec) to `end`: (phase, seconds), in order."""
        points = [
            ("init", start),
            *((p, min(max(start, t), end)) for p, t in self.marks if t <= end),
        ]
        out: list[tuple[str, float]] = []
        for i, (phase, t) in enumerate(points):
            seconds = max(0.0, (points[i + 1][1] if i + 1 < len(points) else end) - t)
            if out and out[-1][0] == phase:
                out[-1] = (phase, out[-1][1] + seconds)
            else:
                out.append((phase, seconds))
        if len(out) > 1 and out[0] == ("init", 0.0):  # its first line came with the exec
            del out[0]
        return out


def record(segments: list[tuple[str, float]]) -> list[list[Any]]:
    """A launch's segments as its history entry keeps them: [[phase, seconds], ...]."""
    return [[phase, round(seconds, 3)] for phase, seconds in segments]


def totals(value: Any) -> dict[str, float]:
    """Seconds in each phase of a record's `phases` (checked: see `_segments_of`), in the
    order of `PHASES` (those it never entered left out)."""
    out: dict[str, float] = {}
    for phase, seconds in _segments_of(value):
        out[phase] = out.get(phase, 0.0) + seconds
    return {p: round(out[p], 3) for p in PHASES if p in out}


@dataclass(frozen=True)
class Expected:
    """What earlier launches of a config took: each segment's median, and the median total."""

    segments: tuple[tuple[str, float], ...]
    total_s: float
    launches: int


def expected(
    history: Iterable[Mapping[str, Any]], config: str | None, config_hash: str | None
) -> Expected | None:
    """From the newest launches of `config` (with this hash) that reached ready, or None."""
    runs: list[list[tuple[str, float]]] = []
    for entry in reversed(list(history)):
        if entry.get("config") != config or entry.get("config_hash") != config_hash:
            continue
        segs = _segments_of(entry.get("phases"))
        if segs:
            runs.append(segs)
        if len(runs) == ETA_LAUNCHES:
            break
    if not runs:
        return None
    shape = [p for p, _ in runs[0]]  # the newest launch's shape; the others that share it
    alike = [r for r in runs if [p for p, _ in r] == shape]
    medians = tuple(
        (phase, statistics.median(r[i][1] for r in alike)) for i, phase in enumerate(shape)
    )
    total = statistics.median(sum(s for _, s in r) for r in runs)
    return Expected(medians, total, len(runs))


MAX_SECONDS = 7 * 86400.0  # a segment longer than a week is no record of a start


def seconds(value: Any) -> float | None:
    """`value` as a duration of a start, or None where it is none (a bool, a string, NaN,
    infinity, below zero, past a week): what a record or a server's answer says is input."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 <= value <= MAX_SECONDS else None  # (NaN fails the comparison)


def _segments_of(value: Any) -> list[tuple[str, float]]:
    """A history entry's `phases`, checked: a hand-edited state file is no reason to fail, and
    a value that is not a record of seconds (a bool, NaN, infinity) makes the whole entry none."""
    if not isinstance(value, list) or len(value) > MAX_MARKS + 1:
        return []
    out: list[tuple[str, float]] = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in PHASES):
            return []
        took = seconds(item[1])
        if took is None:
            return []
        out.append((item[0], took))
    return out


def now(segments: list[tuple[str, float]], expect: Expected | None) -> dict[str, Any]:
    """`/status`'s `phase`: the current phase, its elapsed seconds, and the seconds until ready
    (`eta_s`, None before any launch of the config reached ready)."""
    phase, elapsed = segments[-1] if segments else ("init", 0.0)
    return {"name": phase, "elapsed_s": round(elapsed, 3), "eta_s": eta(segments, expect)}


def eta(segments: list[tuple[str, float]], expect: Expected | None) -> float | None:
    if expect is None:
        return None
    k = len(segments) - 1
    ref = expect.segments
    if 0 <= k < len(ref) and [p for p, _ in segments] == [p for p, _ in ref[: k + 1]]:
        left = max(0.0, ref[k][1] - segments[k][1]) + sum(s for _, s in ref[k + 1 :])
    else:
        left = max(0.0, expect.total_s - sum(s for _, s in segments))
    return round(left, 1)
