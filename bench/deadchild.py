"""A dead child of the server: SGLang's crash line -> the launch's group gone -> the next exec.

SGLang 0.5.23, with its defaults, keeps a server whose detokenizer died up for 65 s more (5 s
settling, py-spy, 60 s waiting for CUDA coredumps) with its port open and requests hanging.
gpuwarden ends the launch on SGLang's line. Measured here for the real server (the environment
`make test-real` builds; skipped, saying so, where it is not built) beside the stand-in, in one
run, each round: SIGKILL the detokenizer, then

- kill -> line: SGLang's own detection (its subprocess watchdog polls once a second),
- line -> group gone: the daemon saw the line -> no process of the launch's group is left
  (polled here every millisecond),
- line -> next exec: -> the daemon's next `launch` record (`initial_delay_s: 0`).

    python bench/deadchild.py [--rounds-real 3] [--rounds-standin 10] [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.core import Daemon, measured_on, ts
from tests.real import env as real_env
from tests.real.conftest import sglang_config
from tests.support.configs import standin_config
from tests.support.procs import free_port


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies answer kill(0) too: count only members that still run.
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def rounds(cfg: dict[str, Any], n: int, tmp: Path, label: str) -> list[dict[str, float]]:
    d = Daemon(tmp / label, {"s": cfg}, "s")
    out: list[dict[str, float]] = []
    try:
        for i in range(n):
            recs = d.wait_for(
                lambda r, k=i + 1: sum(1 for x in r if x.get("to") == "ready") >= k, timeout=900
            )
            main = [r for r in recs if r.get("event") == "server.launch"][-1]["pid"]
            detok = next(
                c for c in psutil.Process(main).children() if c.name().startswith("sglang::detok")
            )
            t_kill = time.time()
            detok.kill()
            while group_alive(main):
                time.sleep(0.001)
            t_gone = time.time()
            recs = d.wait_for(
                lambda r, k=i + 2: sum(1 for x in r if x.get("event") == "server.launch") >= k,
                timeout=120,
            )
            said = [r for r in recs if r.get("event") == "server.death_announced"]
            nxt = [r for r in recs if r.get("event") == "server.launch"][i + 1]
            # A daemon that does not act on SGLang's line (an older gpuwarden) has no record
            # of it: then only the kill -> ... figures are measured.
            t_line = ts(said[i]) if len(said) > i else float("nan")
            out.append(
                {
                    "kill_to_line": t_line - t_kill,
                    "line_to_gone": t_gone - t_line,
                    "line_to_exec": ts(nxt) - t_line,
                    "kill_to_exec": ts(nxt) - t_kill,
                }
            )
            print(
                f"{label} round {i + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in out[-1].items())
            )
    finally:
        d.close()
    return out


def summary(rows: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in rows if r[key] == r[key]]  # NaN: not measured
    if not values:
        return "-"
    return f"{statistics.median(values) * 1000:.0f} ms (max {max(values) * 1000:.0f})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds-real", type=int, default=3)
    ap.add_argument("--rounds-standin", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--name", default="deadchild.md", help="the results file, under --out")
    args = ap.parse_args()
    env = real_env.env_dir()
    with tempfile.TemporaryDirectory() as tmp:
        standin = (
            rounds(standin_config(port=free_port()), args.rounds_standin, Path(tmp), "stand-in")
            if args.rounds_standin
            else []
        )
        real: list[dict[str, float]] = []
        if args.rounds_real and real_env.is_complete(env):
            real = rounds(sglang_config(env, free_port()), args.rounds_real, Path(tmp), "sglang")
        elif args.rounds_real:
            print(f"the real SGLang environment is not built ({env}): `make test-real` builds it")
    lines = [
        "# A dead detokenizer: SGLang's crash line -> group gone -> next exec",
        "",
        f"{measured_on()}; SGLang 0.5.23 on the "
        f"CPU with its defaults (the 60 s coredump wait on), {len(real)} rounds; the stand-in "
        f"(0.5.23 profile), {len(standin)} rounds. Medians (max). Reproduce: "
        "`python bench/deadchild.py`.",
        "",
        "| measure | SGLang 0.5.23 | stand-in |",
        "|---|---|---|",
    ]
    for key, words in (
        ("kill_to_line", "detokenizer SIGKILLed -> SGLang's crash line seen"),
        ("line_to_gone", "crash line -> the launch's group gone"),
        ("line_to_exec", "crash line -> next exec (`initial_delay_s: 0`)"),
        ("kill_to_exec", "detokenizer SIGKILLed -> next exec"),
    ):
        lines.append(f"| {words} | {summary(real, key)} | {summary(standin, key)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / args.name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
