"""A swap's page-cache pre-warm, on the real SGLang on the CPU: the new server's weight phase
with and without it, against the time to copy the same bytes from the page cache, and the old
server's latency while it reads.

A daemon serves the tiny model (`small`); each trial evicts the big model's files from the page
cache (`POSIX_FADV_DONTNEED`), measures `small`'s latency for a while (sequential `/generate`
of 4 tokens), swaps to `big` (a Llama of several GiB, random weights, built once into
~/.cache/gpuwarden/bench), keeps measuring `small` while the swap is `prewarming`, and reads
big's weight phase (`Load weight begin` -> `end`) from `/status.startup` once it is ready; then
swaps back. Trials run on a daemon without `prewarm.enabled` (and once more with the files read
into the page cache before the swap: SGLang's own floor), then on one with it. The floor of IO:
reading the same files from the page cache into a buffer (after a cold read of them, which is
the disk's time). The issue's goals: the weight phase with pre-warm ≤ 1.5x that copy; the old
server's p99 while it reads within 10 % of before.

    python bench/prewarm.py [--gib 4] [--trials 2] [--rates 1024,256] [--out bench/results]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.core import Daemon, free_port, measured_on, pct, write_results
from gpuwarden.daemon import prewarm
from gpuwarden.daemon.model import PrewarmProgress
from gpuwarden.daemon.settings import PrewarmSettings
from tests.real import env as real_env
from tests.real.conftest import sglang_config

CACHE = Path.home() / ".cache" / "gpuwarden" / "bench"
BEFORE_S = 8.0


def big_model(env: Path, gib: float) -> Path:
    out = CACHE / f"model-{gib:g}g"
    if not (out / "model.safetensors.index.json").is_file():
        builder = Path(__file__).with_name("make_big_model.py")
        py = str(real_env.python_of(env))
        subprocess.run(
            [py, str(builder), str(real_env.model_of(env)), str(out), str(gib)], check=True
        )
    return out


def copy_floor(files: list[Path]) -> tuple[float, float]:
    """(cold read s, page-cache copy s) of `files`, read whole into a buffer."""
    buf = bytearray(8 * 1024 * 1024)
    out = []
    for f in files:
        prewarm.evict(f)
    for _ in range(2):
        t = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
        out.append(time.perf_counter() - t)
    return out[0], out[1]


def generate(client: httpx.Client, port: int) -> float:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    t = time.perf_counter()
    r = client.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
    r.raise_for_status()
    return time.perf_counter() - t


def wait(d: Daemon, pred: Any, timeout: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = d.http.get("/status").json()
        if pred(st):
            return st
        time.sleep(0.2)
    raise TimeoutError(what)


def trial(d: Daemon, port: int, files: list[Path], label: str) -> dict[str, Any]:
    for f in files:
        prewarm.evict(f)
    held = prewarm.Held()
    if label == "cached":  # the loader's own floor: every byte in the page cache, held there
        settings = PrewarmSettings(max_read_mib_s=1e6, keep_free_ram_fraction=0.05)
        prewarm.read(files, PrewarmProgress(), settings, threading.Event(), held=held)
    client = httpx.Client(trust_env=False)
    before: list[float] = []
    t_end = time.monotonic() + BEFORE_S
    while time.monotonic() < t_end:
        before.append(generate(client, port))
    d.http.post("/restart", params={"config": "big", "wait": "false"})
    during: list[float] = []
    read_s = None
    while True:
        st = d.http.get("/status").json()
        swap = st.get("swap") or {}
        if swap.get("phase") != "prewarming":
            if swap.get("prewarm"):
                read_s = swap["prewarm"]["elapsed_s"]
            break
        during.append(generate(client, port))
    ready = wait(
        d,
        lambda s: (
            (s["config"] == "big" and s["state"] == "ready" and s.get("startup"))
            or (s["swap"] is None and s["config"] != "big")
        ),
        1800,
        "big to be ready",
    )
    if ready["config"] != "big":
        raise RuntimeError(f"the swap to big did not come up: {ready.get('last_exit')}")
    events = d.http.get("/events", params={"kind": "prewarm_ended", "limit": 1}).json()["events"]
    ended = events[-1] if events and label == "with" else None
    row = {
        "label": label,
        "weights_s": ready["startup"]["phases"].get("weights"),
        "ready_s": ready["startup"]["ready_s"],
        "before": before,
        "during": during,
        "prewarm_s": read_s if ended is None else ended.get("elapsed_s"),
        "prewarm": ended,
    }
    held.release()
    d.http.post("/restart", params={"config": "small", "wait": "true"}, timeout=1800)
    client.close()
    print(
        f"{label}: weights {row['weights_s']:.2f} s, ready {row['ready_s']:.1f} s; small p99 "
        f"before {pct(before, 0.99) * 1000:.1f} ms ({len(before)}), during "
        f"{pct(during, 0.99) * 1000:.1f} ms ({len(during)})",
        flush=True,
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0, help="the big model's size")
    ap.add_argument("--trials", type=int, default=2, help="trials with, and without, pre-warm")
    ap.add_argument(
        "--rates",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[1024.0, 256.0],
        help="the pre-warm's max_read_mib_s, a daemon each (the first is the default's)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    env = real_env.env_dir()
    if not real_env.is_complete(env):
        print(f"the real SGLang environment is not built ({env}): `make test-real` builds it")
        return 0
    model = big_model(env, args.gib)
    files = sorted(model.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    cold_s, copy_s = copy_floor(files)
    print(f"{total / 1024**3:.2f} GiB: cold read {cold_s:.2f} s, page-cache copy {copy_s:.2f} s")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        # Its weights take a third of this machine's RAM: the KV cache is sized past them.
        big_args = {"model-path": str(model), "max-total-tokens": 2048, "mem-fraction-static": 0.6}
        configs = {
            "small": sglang_config(env, port),
            "big": sglang_config(env, port, args=big_args),
        }
        modes = [("without", None)] + [("with", rate) for rate in args.rates]
        for mode, rate in modes:
            root = Path(tmp) / f"{mode}-{rate}"
            settings = {"enabled": rate is not None, "max_read_mib_s": rate or 1024}
            d = Daemon(root, configs, "small", prewarm=settings)
            try:
                wait(d, lambda s: s["state"] == "ready", 900, "small to be ready")
                for _ in range(args.trials):
                    rows.append({**trial(d, port, files, mode), "rate": rate})
                if mode == "without":
                    rows.append({**trial(d, port, files, "cached"), "rate": None})
            finally:
                d.close()
    write_results(args.out, "prewarm.md", report(rows, total, cold_s, copy_s, args))
    return 0


def report(
    rows: list[dict[str, Any]], total: int, cold_s: float, copy_s: float, args: Any
) -> list[str]:
    def med(label: str, rate: float | None = None) -> float:
        return statistics.median(
            r["weights_s"]
            for r in rows
            if r["label"] == label and (rate is None or r["rate"] == rate)
        )

    without_w, cached_w = med("without"), med("cached")
    lines = [
        "# A swap's page-cache pre-warm (real SGLang 0.5.23, CPU)",
        "",
        f"{measured_on()}. The swap's new server serves a Llama of {total / 1024**3:.2f} GiB "
        f"(random bfloat16 weights, {args.trials} trials each way, its files evicted before "
        "each); the old one the tiny test model, answering a sequential stream of 4-token "
        "`/generate` requests. Reproduce: `python bench/prewarm.py`.",
        "",
        "| trial | pre-warm (MiB/s) | pre-warm read (s) | weight phase (s) | ready (s) "
        "| old p99 before (ms) | old p99 during (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        during_p99 = f"{pct(r['during'], 0.99) * 1000:.1f}" if r["during"] else "-"
        read = f"{r['prewarm_s']:.2f}" if r["prewarm_s"] is not None else "-"
        how = f"{r['rate']:g}" if r["rate"] else r["label"]
        lines.append(
            f"| {i} | {how} | {read} | {r['weights_s']:.2f} | {r['ready_s']:.1f} | "
            f"{pct(r['before'], 0.99) * 1000:.1f} | {during_p99} |"
        )
    lines += [
        "",
        f"- The same bytes: cold read {cold_s:.2f} s; copied from the page cache {copy_s:.2f} s.",
        f"- Weight phase (median): without pre-warm {without_w:.2f} s; with every byte in the "
        f"page cache before the swap {cached_w:.2f} s (SGLang's own work on this CPU: the floor "
        "of any pre-warm).",
    ]
    for rate in args.rates:
        with_w = med("with", rate)
        before = [x for r in rows if r["rate"] == rate for x in r["before"]]
        during = [x for r in rows if r["rate"] == rate for x in r["during"]]
        p99_before, p99_during = pct(before, 0.99), pct(during, 0.99)
        lines += [
            f"- Pre-warm at {rate:g} MiB/s: weight phase {with_w:.2f} s, {with_w / copy_s:.2f}x "
            f"the page-cache copy (goal ≤ 1.5x) and {with_w / cached_w:.2f}x the floor; the "
            f"old server's p99 while it read {p99_during * 1000:.1f} ms over {len(during)} "
            f"requests, against {p99_before * 1000:.1f} ms over {len(before)} before "
            f"({(p99_during / p99_before - 1) * 100:+.1f} %; goal within 10 %).",
        ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
