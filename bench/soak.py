"""Soak: many crash -> restart cycles with zero backoff; the daemon must end as it began.

    python bench/soak.py [--cycles 1000]

Prints open fds, threads, RSS and children of the daemon at the start and the end, zombies,
and whether every launch has its log file and its `launch` event.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core import PY, Daemon


def sample(pid: int) -> dict[str, float]:
    proc = psutil.Process(pid)
    children = proc.children()
    return {
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
        "rss_mib": proc.memory_info().rss / 2**20,
        "children": len(children),
        "zombies": sum(1 for c in children if c.status() == psutil.STATUS_ZOMBIE),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "soak"
        config = {
            "command": [PY, "-c", "import sys; sys.exit(1)"],
            "health": {
                "url": "http://127.0.0.1:9/health",
                "startup_timeout_s": 3600,
                "interval_s": 3600,
            },
        }
        d = Daemon(root, {"crash": config}, "crash")
        events = root / "state" / "events.jsonl"

        def launches() -> int:
            try:
                return events.read_bytes().count(b'"event": "launch"')
            except OSError:
                return 0

        try:
            while launches() < 20:  # warm: imports, caches, pools
                time.sleep(0.05)
            start = sample(d.proc.pid)
            t0 = time.monotonic()
            while launches() < args.cycles:
                time.sleep(0.2)
            wall = time.monotonic() - t0
            end = sample(d.proc.pid)
            d.http.post("/stop")
            d.wait_for(lambda r: any(x.get("to") == "stopped" for x in r))
            after_stop = sample(d.proc.pid)
        finally:
            d.close()
        records = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
        launch_ids = {r["launch_id"] for r in records if r.get("event") == "launch"}
        exits = {r["launch_id"] for r in records if r.get("event") == "exit"}
        logs = {p.stem for p in (root / "logs" / "crash").glob("*.log")}
    print(
        f"soak: {len(launch_ids)} launches in {wall:.1f} s "
        f"({len(launch_ids) / wall:.0f} crash -> restart cycles per second)\n"
    )
    print("| daemon | start | end | after stop |")
    print("|---|---|---|---|")
    for key in ("fds", "threads", "rss_mib", "children", "zombies"):
        fmt = "{:.1f}" if key == "rss_mib" else "{:.0f}"
        print(
            f"| {key} | {fmt.format(start[key])} | {fmt.format(end[key])} | "
            f"{fmt.format(after_stop[key])} |"
        )
    missing_logs = launch_ids - logs
    missing_exits = launch_ids - exits
    print(
        f"\nevery launch has its log: {not missing_logs} ({len(logs)} logs, "
        f"{len(missing_logs)} missing); every launch has its exit event: "
        f"{not missing_exits} ({len(missing_exits)} missing)"
    )
    # Judged after the stop, with no cycle in flight ("end" may catch a server between its
    # exit and its reap). Thread pools grow lazily to their bound, hence a little slack.
    ok = (
        not missing_logs
        and not missing_exits
        and after_stop["children"] == 0
        and after_stop["zombies"] == 0
        and after_stop["fds"] <= start["fds"] + 2
        and after_stop["threads"] <= start["threads"] + 4
        and after_stop["rss_mib"] <= start["rss_mib"] + 10
    )
    print("flat (after the stop against the start: fds +2, threads +4, RSS +10 MiB at most):", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
