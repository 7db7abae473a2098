"""A sweep's optional load: SGLang's own benchmark (`python -m sglang.benchmark.serving`, 0.5.23;
`sglang.bench_serving` is its deprecated name), run with the config's interpreter.

The interpreter is the config's `command[0]` when it is a Python, or the Python named by the
shebang of `command[0]` (`sglang serve`'s console script). The dataset is `random-ids` (random
token ids, nothing downloaded), fixed lengths (`--random-range-ratio 1`), `ignore_eos` unless
the sweep says otherwise, the sweep's warm-up, request count and concurrency. The benchmark
appends one JSON line to `--output-file`; its figures become the sweep's row (SGLang's
names and units in `bench`, the sweep's own keys beside them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from .load import LoadSpec
from .server.helpers import run_helper

MODULE = "sglang.benchmark.serving"


class BenchError(Exception):
    """The benchmark could not run or gave no result; the message says why."""


def interpreter(command: list[str], env: dict[str, str]) -> str:
    """The Python that runs the config's server: `command[0]`, or its script's shebang."""
    if not command:
        raise BenchError("the config has no command")
    first = command[0]
    path = first if os.sep in first else shutil.which(first, path=env.get("PATH"))
    if path is None:
        raise BenchError(f"{first!r} is not found on PATH")
    if Path(path).name.startswith("python"):
        return path
    try:
        with open(path, "rb") as f:
            head = f.readline(512).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise BenchError(f"{path}: {exc.strerror or exc}") from exc
    if head.startswith("#!"):
        words = head[2:].split()
        if words and Path(words[0]).name == "env" and len(words) > 1:
            words = words[1:]
        if words and Path(words[0]).name.startswith("python"):
            found = words[0] if os.sep in words[0] else shutil.which(words[0], path=env.get("PATH"))
            if found:
                return found
    raise BenchError(
        f"the config's command[0] ({first}) is not a Python interpreter nor a Python script: "
        "the sglang-bench load runs SGLang's benchmark with the server's own Python"
    )


def bench_argv(python: str, base_url: str, spec: LoadSpec, output: Path) -> list[str]:
    argv = [
        python,
        "-m",
        MODULE,
        "--backend",
        "sglang",
        "--base-url",
        base_url,
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        str(spec.input_len),
        "--random-output-len",
        str(spec.max_tokens),
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        str(spec.requests),
        "--max-concurrency",
        str(spec.concurrency),
        "--warmup-requests",
        str(spec.warmup),
        "--output-file",
        str(output),
        "--disable-tqdm",
        "--seed",
        "1",
    ]
    if not spec.ignore_eos:
        argv.append("--disable-ignore-eos")
    return argv


def _ms(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    return float(value) / 1000 if isinstance(value, int | float) else None


def read_result(output: Path, requests: int) -> dict[str, Any]:
    """The benchmark's last JSON line, as a sweep row's figures."""
    try:
        lines = [ln for ln in output.read_text().splitlines() if ln.strip()]
    except FileNotFoundError:
        raise BenchError(f"the benchmark wrote no {output.name}") from None
    if not lines:
        raise BenchError(f"the benchmark's {output.name} is empty")
    data = json.loads(lines[-1])
    if not isinstance(data, dict):
        raise BenchError(f"{output.name}: not a JSON object")
    tpot = data.get("median_tpot_ms")
    completed = int(data.get("completed") or 0)
    out: dict[str, Any] = {
        "backend": "sglang-bench",
        "requests_ok": completed,
        "requests_failed": max(0, requests - completed),
        "errors": [],
        "output_tokens": data.get("total_output_tokens"),
        "tokens_counted_by": "sglang-bench",
        "wall_s": data.get("duration"),
        # One stream's decode rate: SGLang's median time per output token, inverted.
        "tok_s": 1000.0 / tpot if isinstance(tpot, int | float) and tpot > 0 else None,
        "total_tok_s": data.get("output_throughput"),
        "accept_length": data.get("accept_length"),
        "bench_output_file": str(output),
    }
    for ours, theirs in (("ttft", "ttft"), ("itl", "itl"), ("tpot", "tpot")):
        out[f"{ours}_mean_s"] = _ms(data, f"mean_{theirs}_ms")
        out[f"{ours}_p50_s"] = _ms(data, f"median_{theirs}_ms")
        out[f"{ours}_p90_s"] = _ms(data, f"p90_{theirs}_ms")
        out[f"{ours}_p99_s"] = _ms(data, f"p99_{theirs}_ms")
    out["bench"] = {k: v for k, v in data.items() if k != "server_info"}
    return out


def _prepare(
    command: list[str], env: dict[str, str], base_url: str, spec: LoadSpec, output: Path
) -> tuple[list[str], int]:
    """(argv, the log's descriptor): the benchmark's command line, its log opened and headed."""
    python = interpreter(command, env)
    output.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        output.unlink()  # the benchmark appends: one run, one line
    argv = bench_argv(python, base_url, spec, output)
    log = output.with_suffix(".log")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, ("$ " + " ".join(argv) + "\n").encode())
    return argv, fd


async def run_sglang_bench(
    command: list[str],
    env: dict[str, str],
    base_url: str,
    spec: LoadSpec,
    *,
    output: Path,
) -> dict[str, Any]:
    """Run the benchmark against `base_url`, writing `output` (JSON lines) and its log beside
    it (`.log`); the row's figures, or `error` saying why there are none."""
    log_path = output.with_suffix(".log")
    failed: dict[str, Any] = {
        "backend": "sglang-bench",
        "requests_ok": 0,
        "requests_failed": spec.requests,
        "errors": [],
        "output_tokens": None,
        "tokens_counted_by": None,
        "tok_s": None,
        "bench_log": str(log_path),
    }
    try:
        argv, fd = await asyncio.to_thread(_prepare, command, env, base_url, spec, output)
    except (BenchError, OSError) as exc:
        return {**failed, "error": str(exc)}
    limit = spec.timeout_s * (1 + (spec.warmup + spec.requests) / max(1, spec.concurrency))
    # A sweep cancelled: the benchmark's group is killed before this raises.
    try:
        ran = await run_helper(argv, env=env, timeout_s=limit, cwd=output.parent, output_fd=fd)
    except OSError as exc:
        return {**failed, "error": f"{argv[0]}: {exc.strerror or exc}"}
    finally:
        os.close(fd)
    code = ran.returncode
    if ran.timed_out:
        return {**failed, "error": f"the benchmark ran past {limit:.0f} s (log: {log_path})"}
    if code != 0:
        tail = await asyncio.to_thread(_last_line, log_path)
        return {**failed, "error": f"the benchmark exited {code}: {tail} (log: {log_path})"}
    try:
        result = await asyncio.to_thread(read_result, output, spec.requests)
    except (BenchError, ValueError) as exc:
        return {**failed, "error": f"{exc} (log: {log_path})"}
    return {**result, "bench_log": str(log_path)}


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return lines[-1][-300:]
    return f"see {path}"
