"""A launch's compile phase, first and again, with the caches gpuwarden gives every launch.

The server (`bench/compile_server.py`, run by the real-SGLang environment's own torch: SGLang's
compile path on the CPU needs AMX) compiles the tiny Llama with torch.compile (inductor, C++ on
the CPU) as it starts. gpuwarden starts it N times in a row (`POST /restart`), each launch with
the same folder of `compile_cache.dir`; the launch's `cuda_graphs` phase (the compile) is read
from `/status`. Beside it, `compile_cache.enabled: false` with the server's inductor cache in a
fresh folder per launch: what a host gets where the caches do not persist (a container, a
private /tmp under systemd, a rebooted machine).

    python bench/compilecache.py [--launches 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.core import Daemon, measured_on, write_results
from tests.real import env as real_env
from tests.support.procs import free_port

HERE = Path(__file__).resolve().parent


# Set by --python (a GPU machine's torch): the server compiles synthetic layers on CUDA.
GPU_PYTHON: str | None = None


def config(env: Path, port: int, inductor: Path | None = None) -> dict[str, Any]:
    environ = {"HOME": str(env / "runtime" / "home"), "HF_HUB_OFFLINE": "1"}
    if inductor is not None:  # a fresh folder for inductor and Triton both
        environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
        environ["TRITON_CACHE_DIR"] = str(inductor / "triton")
    python, model = str(real_env.python_of(env)), str(real_env.model_of(env))
    if GPU_PYTHON is not None:
        python, model = GPU_PYTHON, "--synthetic"
    return {
        "command": [python, str(HERE / "compile_server.py"), model, str(port)],
        "env": environ,
        "health": {"url": f"http://127.0.0.1:{port}/health", "startup_timeout_s": 600},
    }


def launches(root: Path, env: Path, n: int, persist: bool) -> list[dict[str, Any]]:
    port = free_port()
    configs = {
        f"c{i}": config(env, port, None if persist else root / f"fresh-{i}") for i in range(n)
    }
    if persist:  # one config, started n times
        configs = {"c0": configs["c0"]}
    gpu = {"backend": "nvml" if GPU_PYTHON else "none"}
    caches = {"enabled": persist, "dir": str(root / "cache")}
    d = Daemon(root, configs, "c0", compile_cache=caches, gpu=gpu)
    out: list[dict[str, Any]] = []
    try:
        for i in range(n):
            name = "c0" if persist else f"c{i}"
            if i:
                d.http.post("/restart", params={"config": name, "wait": "true"}, timeout=900)
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                st = d.http.get("/status").json()
                if st["state"] == "ready" and st["config"] == name and st["startup"]:
                    break
                time.sleep(0.2)
            phases = st["startup"]["phases"]
            out.append(
                {"ready_s": st["startup"]["ready_s"], "compile_s": phases.get("cuda_graphs")}
            )
            print(
                f"{'persistent' if persist else 'fresh'} launch {i + 1}: compile "
                f"{out[-1]['compile_s']:.2f} s, ready {out[-1]['ready_s']:.2f} s",
                flush=True,
            )
        out[-1]["cache"] = st["compile_cache"]
    finally:
        d.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--python", help="a GPU machine's Python with torch: compile on CUDA")
    args = ap.parse_args()
    global GPU_PYTHON
    GPU_PYTHON = args.python
    env = real_env.env_dir()
    if GPU_PYTHON is None and not real_env.is_complete(env):
        print(f"the real SGLang environment is not built ({env}): `make test-real` builds it")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        kept = launches(Path(tmp) / "kept", env, args.launches, persist=True)
        fresh = launches(Path(tmp) / "fresh", env, args.launches, persist=False)
    folders = kept[-1]["cache"]["folders"]
    lines = [
        "# The compile phase, first and again",
        "",
        f"{measured_on()}: "
        + (
            f"{GPU_PYTHON}'s torch, torch.compile of four transformer layers on CUDA by "
            if GPU_PYTHON
            else "the real-SGLang environment's torch, torch.compile of the tiny Llama by "
        )
        + "`bench/compile_server.py` under gpuwarden; the launch's `cuda_graphs` phase. Reproduce: "
        "`python bench/compilecache.py`.",
        "",
        "| launch | compile (s), gpuwarden's folder | compile (s), a fresh cache each launch |",
        "|---|---|---|",
    ]
    for i, (k, f) in enumerate(zip(kept, fresh, strict=True)):
        lines.append(f"| {i + 1} | {k['compile_s']:.2f} | {f['compile_s']:.2f} |")
    first = kept[0]["compile_s"]
    later = [k["compile_s"] for k in kept[1:]]
    if later:
        lines += [
            "",
            f"Second and later starts: {max(later):.2f} s at most, "
            f"{max(later) / first:.2f}x the first ({first:.2f} s).",
        ]
    lines.append(
        f"Folder: {folders[0]['name'] if folders else '-'}, "
        f"{(folders[0]['bytes'] if folders else 0) / 2**20:.1f} MiB."
    )
    write_results(args.out, "compilecache-gpu.md" if GPU_PYTHON else "compilecache.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
