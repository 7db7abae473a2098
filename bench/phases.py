"""A start's phases and the ETA `/status` gives while it starts, against when it was ready.

Each config is started N times in a row (`POST /restart?wait=false` of the config it serves);
during each start `/status` is read every 100 ms. For each reading with an ETA the predicted
ready time (the reading's time + `eta_s`) is compared with the `ready_at` the launch reached:
the error is that difference over the launch's whole time to ready. The issue's goal: within
±20 % from the third launch of a config on. Measured for the stand-in (time-scaled; its Python
start is not) and for the real SGLang on the CPU (the environment `make test-real` builds;
skipped, saying so, where it is not built).

    python bench/phases.py [--launches 5] [--launches-real 4] [--out bench/results]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.core import Daemon, measured_on, pct, write_results
from tests.real import env as real_env
from tests.real.conftest import sglang_config
from tests.support.configs import standin_config
from tests.support.procs import free_port


def _iso(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def launches(cfg: dict[str, Any], n: int, root: Path, label: str) -> list[dict[str, Any]]:
    d = Daemon(root / label, {"c": cfg}, "c")
    out: list[dict[str, Any]] = []
    try:
        for i in range(n):
            if i:
                d.http.post("/restart", params={"config": "c", "wait": "false"})
            samples: list[tuple[float, dict[str, Any]]] = []
            launch_id = None
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                st = d.http.get("/status").json()
                if st["phase"] is not None:
                    samples.append((time.time(), st["phase"]))
                    launch_id = st["launch_id"]
                # Ready, and the launch it watched start (the first start may be ready before
                # the first reading).
                seen = launch_id in (None, st["launch_id"]) and (i == 0 or launch_id)
                if st["state"] == "ready" and st["startup"] and seen:
                    break
                time.sleep(0.1)
            else:
                raise TimeoutError(f"{label}: launch {i + 1} not ready within 900 s")
            start = st["startup"]
            ready_at = _iso(st["ready_at"])
            errors = [
                (at + p["eta_s"] - ready_at) / start["ready_s"]
                for at, p in samples
                if p["eta_s"] is not None
            ]
            row = {"launch": i + 1, "ready_s": start["ready_s"], "phases": start["phases"]}
            row["errors"] = errors
            out.append(row)
            worst = max((abs(e) for e in errors), default=float("nan"))
            print(
                f"{label} launch {i + 1}: ready in {start['ready_s']:.2f} s "
                f"({', '.join(f'{k} {v:.2f}' for k, v in start['phases'].items())}); "
                f"{len(errors)} ETAs, worst error {worst * 100:.1f} %",
                flush=True,
            )
    finally:
        d.close()
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """From the third launch on: the median and the worst |error| of the ETAs read."""
    errors = [abs(e) for r in rows if r["launch"] >= 3 for e in r["errors"]]
    if not errors:
        return "-"
    within = sum(1 for e in errors if e <= 0.2) / len(errors)
    return (
        f"{pct(errors, 0.5) * 100:.1f} % median, {max(errors) * 100:.1f} % worst, "
        f"{within * 100:.0f} % of {len(errors)} readings within ±20 %"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=5, help="starts of the stand-in's config")
    ap.add_argument("--launches-real", type=int, default=4, help="starts of the real SGLang")
    ap.add_argument("--scale", type=float, default=1.0, help="the stand-in's time scale")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    env = real_env.env_dir()
    with tempfile.TemporaryDirectory() as tmp:
        standin = launches(
            standin_config(port=free_port(), scale=args.scale), args.launches, Path(tmp), "stand-in"
        )
        real: list[dict[str, Any]] = []
        if args.launches_real and real_env.is_complete(env):
            real = launches(
                sglang_config(env, free_port()), args.launches_real, Path(tmp), "sglang"
            )
        elif args.launches_real:
            print(f"the real SGLang environment is not built ({env}): `make test-real` builds it")
    lines = [
        "# A start's phases, and the ETA while it starts",
        "",
        f"{measured_on()}: the stand-in (0.5.23 "
        f"profile, time scale {args.scale:g}), {len(standin)} starts of one config; SGLang 0.5.23 "
        f"on the CPU (tiny model), {len(real)} starts. ETA error: (reading time + eta_s - "
        "ready_at) / time to ready, for every `/status` read every 100 ms while it started. "
        "Reproduce: `python bench/phases.py`.",
        "",
        "| server | launch | ready (s) | phases (s) | ETAs read | worst error |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in (("stand-in", standin), ("SGLang 0.5.23", real)):
        for r in rows:
            worst = max((abs(e) for e in r["errors"]), default=None)
            lines.append(
                f"| {label} | {r['launch']} | {r['ready_s']:.2f} | "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
                + f" | {len(r['errors'])} | "
                + (f"{worst * 100:.1f} %" if worst is not None else "-")
                + " |"
            )
    lines += [
        "",
        f"From the third launch on, stand-in: {summary(standin)}.",
        f"From the third launch on, SGLang 0.5.23: {summary(real)}.",
    ]
    write_results(args.out, "phases.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
