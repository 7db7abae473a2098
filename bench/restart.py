"""The restart rows, measured in interleaved rounds: crash -> next start, and exit -> the
tool's report of it, for gpuwarden, PM2, supervisord and the floor (a bare Popen/wait loop).

    python bench/restart.py [--repeat N] [--rounds R] [--supervisord]

Every tool runs the same child under its minimum restart delay. The child notes its first
instruction's time, then waits for SIGUSR1; on it, it notes the time and exits 1. Each round the
bench ends one child of each tool in turn, waits for that tool's next start and its report of the
exit, lets it settle, and goes on to the next tool; the order rotates every round. A drift on a
shared machine (another job, a CPU frequency change) thus lands on every tool alike instead of on
whichever tool ran its rounds at the time.

`make bench` takes the rows from here (`interleaved`); `make bench-repeat N=5` runs them alone N
times, each run with fresh tools, and prints each run's medians, gpuwarden's ratio to PM2 and its
margin over the floor, then in how many runs gpuwarden was ahead of PM2 and near the floor.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import core  # noqa: E402 - bench/core.py
import peers  # noqa: E402 - bench/peers.py: the tools and how each is set up

# Notes its first instruction's time; on SIGUSR1 (blocked first, so one sent early waits),
# notes the time and exits 1.
GATED = """
import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
t = time.time()
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, f"start {t} {os.getpid()}\\n".encode())
signal.sigwait({signal.SIGUSR1})
os.write(fd, f"end {time.time()} {os.getpid()}\\n".encode())
sys.exit(1)
"""

# The floor: restarts the child the moment it is reaped, and notes when that was.
FLOOR = """
import subprocess, sys, time
out = open(sys.argv[1], "a", buffering=1)
argv = sys.argv[2:]
p = subprocess.Popen(argv)
while True:
    p.wait()
    t = time.time()
    p = subprocess.Popen(argv)
    out.write(f"{t}\\n")
"""

# The thresholds `make bench-repeat` counts runs against (the project's goals): gpuwarden's margin
# over the floor, ms.
GOAL_RESTART_MS = 3.0
GOAL_EXIT_MS = 2.0
SETTLE_S = 0.05  # after each tool's round: its bookkeeping ends before the next tool's round
WARMUP = 2  # rounds run and not counted (the first launches pay for imports and caches)


class Floor(peers.Tool):
    """A bare Popen/wait loop in a process of its own; its `exit` reports are its reap times."""

    name = "floor"

    def start(self) -> None:
        self.reaps = self.root / "reaps.txt"
        self.proc = subprocess.Popen(
            peers.py(FLOOR, str(self.reaps), *self.prog.argv),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its children share its group: close() ends them all
        )

    def events(self) -> list[peers.Event]:
        if not self.reaps.exists():
            return []
        whole = self.reaps.read_text().split("\n")[:-1]  # the last line may be mid-write
        return [peers.Event(float(x), "exit") for x in whole]

    def supervisor_pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


TOOLS: dict[str, type[peers.Tool]] = {
    "gpuwarden": peers.Gpuwarden,
    "PM2": peers.Pm2,
    "supervisord": peers.Supervisord,
    "floor": Floor,
}


class Stamp(NamedTuple):
    kind: str  # "start" or "end"
    t: float
    pid: int


def stamps(path: Path) -> list[Stamp]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().split("\n")[:-1]:  # whole lines: the last may be mid-write
        kind, t, pid = line.split()
        out.append(Stamp(kind, float(t), int(pid)))
    return out


def poll(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Runner:
    """One tool under the gated child, and its rounds."""

    def __init__(
        self,
        name: str,
        root: Path,
        gpu_backend: str = "none",
        no_site: bool = False,
        live_restore: bool = False,
    ) -> None:
        self.name = name
        self.path = root / f"{name}-stamps.txt"
        # gpuwarden's GPU backend: none (the default), or nvml on a GPU host, where the sweep
        # and the GPU wait on the restart path ask NVML.
        gpu: dict[str, Any] = {"gpu": {"backend": gpu_backend}, "live_restore": live_restore}
        argv = peers.py(GATED, str(self.path))
        if no_site:  # the child's Python skips `site` (see --no-site)
            argv.insert(1, "-S")
        prog = peers.Program(argv, gw_settings=gpu)
        self.tool = TOOLS[name](root / name, prog)
        self.gap_s: list[float] = []
        self.exit_s: list[float] = []

    def starts(self) -> list[Stamp]:
        return [s for s in stamps(self.path) if s.kind == "start"]

    def round(self, count: bool) -> None:
        """End the running child; wait for the next start and the exit's report."""
        before = self.starts()
        os.kill(before[-1].pid, signal.SIGUSR1)
        poll(lambda: len(self.starts()) > len(before), 60, f"{self.name}: the next start")
        run = stamps(self.path)
        end = next(s for s in run if s.kind == "end" and s.pid == before[-1].pid)
        start = [s for s in run if s.kind == "start"][len(before)]
        report: list[peers.Event] = []

        def reported() -> bool:
            e = peers.first_after(self.tool.events(), "exit", end.t)
            report[:] = [e] if e is not None else []
            return bool(report)

        poll(reported, 30, f"{self.name}: its report of the exit")
        if count:
            self.gap_s.append(start.t - end.t)
            self.exit_s.append(report[0].t - end.t)


@contextlib.contextmanager
def started(
    names: list[str],
    root: Path,
    gpu_backend: str = "none",
    no_site: bool = False,
    live_restore: bool = False,
) -> Iterator[list[Runner]]:
    runners: list[Runner] = []
    try:
        for name in names:
            runner = Runner(name, root, gpu_backend, no_site, live_restore)
            runners.append(runner)
            runner.tool.start()
            poll(lambda r=runner: bool(r.starts()), 60, f"{name}: its first child")
        yield runners
    finally:
        for runner in runners:
            with contextlib.suppress(Exception):
                runner.tool.close()
        end_shims(root)


def end_shims(root: Path) -> None:
    """The shims a `live_restore` run started outlive its daemon by design: ended here, with
    the process groups their servers lead."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"shim.py" in cmdline and str(root).encode() in cmdline:
                for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                    with contextlib.suppress(OSError):
                        os.killpg(int(child), signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)


def interleaved(
    names: list[str],
    rounds: int,
    root: Path,
    gpu_backend: str = "none",
    no_site: bool = False,
    *,
    live_restore: bool = False,
) -> dict[str, dict[str, list[float]]]:
    """Each tool's crash -> next start and exit -> report times (s), `rounds` interleaved
    rounds after the warm-up; `names` from TOOLS."""
    root.mkdir(parents=True, exist_ok=True)
    with started(names, root, gpu_backend, no_site, live_restore) as runners:
        for i in range(WARMUP + rounds):
            k = i % len(runners)
            for runner in runners[k:] + runners[:k]:
                runner.round(count=i >= WARMUP)
                time.sleep(SETTLE_S)
    return {r.name: {"gap_s": r.gap_s, "exit_s": r.exit_s} for r in runners}


# -- figures -------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and p95 (nearest rank), s."""
    return {f"p{round(q * 100)}": core.pct(values, q) for q in (0.25, 0.5, 0.75, 0.95)}


def cell(values: list[float] | None) -> str:
    """`median (p25-p75)` in ms, for the README's table."""
    if not values:
        return "—"
    s = spread(values)
    return f"{s['p50'] * 1000:.1f} ms ({s['p25'] * 1000:.1f}-{s['p75'] * 1000:.1f})"


ROWS = (
    ("gap_s", "crash → next start", GOAL_RESTART_MS),
    ("exit_s", "exit → state change", GOAL_EXIT_MS),
)


def judge(res: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    """Per row: each tool's median (ms), gpuwarden ÷ PM2, its margin over the floor (ms), and
    whether it was ahead of PM2 and within the goal."""
    out = {}
    for key, _, goal_ms in ROWS:
        med = {name: core.pct(x[key], 0.5) * 1000 for name, x in res.items()}
        margin = med["gpuwarden"] - med["floor"]
        out[key] = {
            "median_ms": med,
            "ratio_pm2": med["gpuwarden"] / med["PM2"],
            "over_floor_ms": margin,
            "ahead": med["gpuwarden"] < med["PM2"],
            "within_goal": margin <= goal_ms,
        }
    return out


def report_run(n: int, total: int, rounds: int, res: dict[str, dict[str, list[float]]]) -> str:
    """The run's medians (p25-p75) per tool, gpuwarden ÷ PM2 and its margin over the floor."""
    verdict = judge(res)
    names = list(res)
    lines = [
        f"run {n} of {total}: {rounds} interleaved rounds; ms, median (p25-p75)",
        " " * 23 + "".join(f"{name:<19}" for name in names) + "÷ PM2   over floor",
    ]
    for key, label, _ in ROWS:
        v = verdict[key]
        cells = "".join(f"{cell(res[name][key]).replace(' ms', ''):<19}" for name in names)
        lines.append(f"  {label:<21}{cells}{v['ratio_pm2']:.2f}x   {v['over_floor_ms']:+.1f}")
    return "\n".join(lines)


def summary(verdicts: list[dict[str, dict[str, Any]]]) -> str:
    n = len(verdicts)
    ahead = sum(all(v[k]["ahead"] for k, _, _ in ROWS) for v in verdicts)
    near = sum(all(v[k]["within_goal"] for k, _, _ in ROWS) for v in verdicts)
    both = sum(all(v[k]["ahead"] and v[k]["within_goal"] for k, _, _ in ROWS) for v in verdicts)
    return (
        f"gpuwarden ahead of PM2 on both rows in {ahead} of {n} runs; within "
        f"{GOAL_RESTART_MS:g} ms (restart) and {GOAL_EXIT_MS:g} ms (exit notice) of the floor in "
        f"{near} of {n}; both in {both} of {n}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs, each with fresh tools")
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds per run")
    ap.add_argument("--supervisord", action="store_true", help="supervisord too (~1 s a round)")
    ap.add_argument(
        "--gpu-backend",
        choices=("none", "nvml"),
        default="none",
        help="gpuwarden's GPU backend (nvml: on a GPU host, NVML on the restart path)",
    )
    ap.add_argument(
        "--no-site",
        action="store_true",
        help="the child runs `python -S`: where Python's site is heavy (a venv of ML packages"
        " with .pth files) its start takes tens of ms and varies by more than the tools differ",
    )
    ap.add_argument(
        "--live-restore",
        action="store_true",
        help="gpuwarden with live_restore: true (its servers run under the shim)",
    )
    args = ap.parse_args()
    if args.repeat < 1 or args.rounds < 1:
        ap.error("--repeat and --rounds must be at least 1")
    if not peers.PM2_BIN.exists() or (args.supervisord and not peers.SUPERVISORD.exists()):
        print(
            f"the peers are missing from {peers.PEERS} (`make bench` installs them)",
            file=sys.stderr,
        )
        return 2
    names = ["gpuwarden", "PM2", *(["supervisord"] if args.supervisord else []), "floor"]
    print(
        f"{peers.machine()['cpu']}, {os.cpu_count()} cores; {', '.join(names)}; "
        f"gpuwarden's GPU backend: {args.gpu_backend}"
        + ("; the child without site (-S)" if args.no_site else "")
        + ("; gpuwarden with live_restore (the shim)" if args.live_restore else ""),
        flush=True,
    )
    verdicts = []
    for n in range(1, args.repeat + 1):
        with tempfile.TemporaryDirectory() as tmp:
            res = interleaved(
                names,
                args.rounds,
                Path(tmp),
                args.gpu_backend,
                args.no_site,
                live_restore=args.live_restore,
            )
        verdicts.append(judge(res))
        print(report_run(n, args.repeat, args.rounds, res), flush=True)
    print(summary(verdicts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
