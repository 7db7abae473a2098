"""A sweep whose load is SGLang's own benchmark (`python -m sglang.benchmark.serving`), run with
the config's interpreter against the real SGLang 0.5.23 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.procs import wait_until

from .conftest import STARTUP_S, DaemonFactory, sglang_config

pytestmark = pytest.mark.timeout(900)


def test_a_sweep_with_sglangs_own_benchmark_reads_its_output_file(
    real_daemon: DaemonFactory, sglang_env: Path
) -> None:
    d = real_daemon({"tiny": sglang_config(sglang_env)}, default="tiny")
    wait_until(lambda: d.status()["state"] == "ready", STARTUP_S, "the real server")
    body = {
        "configs": ["tiny"],
        "backend": "sglang-bench",
        "requests": 4,
        "warmup": 1,
        "concurrency": 2,
        "max_tokens": 16,
        "input_len": 32,
    }
    res = d.http.post("/sweeps", json=body)
    assert res.status_code == 202, res.text
    sid = res.json()["id"]
    wait_until(
        lambda: d.http.get(f"/sweeps/{sid}").json()["ended_at"] is not None,
        STARTUP_S,
        "the sweep to end",
    )
    view = d.http.get(f"/sweeps/{sid}").json()
    row = view["rows"][0]
    assert view["state"] == "done" and row["status"] == "ok", row
    assert row["backend"] == "sglang-bench" and row["tokens_counted_by"] == "sglang-bench"
    # Fixed lengths (ignore_eos, range ratio 1): every request gave exactly 16 tokens.
    assert row["requests_ok"] == 4 and row["output_tokens"] == 4 * 16, row
    assert row["total_tok_s"] > 0 and row["tok_s"] > 0
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert 0 < row["itl_p50_s"] <= row["itl_p99_s"]
    lines = Path(row["bench_output_file"]).read_text().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data["dataset_name"] == "random-ids" and data["completed"] == 4
    assert data["output_throughput"] == row["total_tok_s"]
    assert "sglang.benchmark.serving" in Path(row["bench_log"]).read_text().splitlines()[0]
