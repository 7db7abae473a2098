"""A sweep over the seed's four configs plus one refused and one crashing config, unattended."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from .conftest import PY, Proc, free_port
from .daemon_harness import standin_config, start_daemon

EAGLE = [
    "--speculative-algorithm=EAGLE3",
    "--speculative-draft-model-path=org/drafter",
    "--speculative-num-steps=3",
    "--speculative-eagle-topk=4",
]
SEED = {  # name: (flags, tok/s, accept len)
    "baseline": ([], 90.0, None),
    "eagle3_cg_5": ([*EAGLE, "--speculative-num-draft-tokens=5"], 82.3, 2.1),
    "eagle3_cg_16": ([*EAGLE, "--speculative-num-draft-tokens=16"], 74.9, 2.2),
    "eagle3_nocg_16": (
        [*EAGLE, "--speculative-num-draft-tokens=16", "--disable-cuda-graph"],
        53.2,
        2.2,
    ),
}


def configs(port: int) -> dict[str, dict[str, Any]]:
    out = {
        name: standin_config(*flags, "--standin-seed=3", "--decode-log-interval=10", port=port)
        for name, (flags, _, _) in SEED.items()
    }
    out["typo"] = standin_config("--speculative-eagle-top-k=4", port=port)
    out["oom"] = standin_config("--standin-crash-on-load=cuda_oom", port=port)
    return out


def test_a_sweep_runs_unattended_and_answers(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        configs(free_port()),
        default="baseline",
        restart={"initial_delay_s": 30},
    )
    d.wait_state("ready")
    body = {"configs": [*SEED, "typo", "oom"], "requests": 2, "warmup": 1, "max_tokens": 120}
    res = d.http.post("/sweeps", json=body)
    assert res.status_code == 202
    sid = res.json()["id"]
    assert d.http.post("/restart", params={"config": "oom"}).status_code == 409  # a sweep runs
    assert d.http.post("/sweeps", json=body).status_code == 409
    d.wait_event("server.sweep_finished", timeout=240)
    sweep = d.http.get(f"/sweeps/{sid}").json()
    assert sweep["state"] == "done" and sweep["restored"] == "baseline"
    rows = {r["config"]: r for r in sweep["rows"]}
    for name, (_, tok_s, accept) in SEED.items():
        r = rows[name]
        assert r["status"] == "ok", r
        assert tok_s * 0.85 <= r["tok_s"] <= tok_s * 1.12, (name, r["tok_s"])
        if accept is not None:
            assert abs(r["server_accept_len"] - accept) <= 0.4, (name, r["server_accept_len"])
            assert r["avg_spec_accept_length"] is not None
        assert r["server_gen_tok_s"] is not None
        assert r["tokens_counted_by"] == "usage"
    assert rows["typo"]["status"] == "refused" and rows["typo"]["reason"] == "preflight_refused"
    assert "--speculative-eagle-top-k 4" in rows["typo"]["evidence"]
    assert rows["oom"]["status"] == "rolled_back" and rows["oom"]["reason"] == "cuda_oom"
    assert rows["oom"]["log"] and Path(rows["oom"]["log"]).exists()
    assert sweep["winner"] == "baseline"
    st = d.status()
    assert st["config"] == "baseline" and st["state"] == "ready" and st["sweep"] is None
    md = d.http.get(f"/sweeps/{sid}/table.md").text
    assert (
        "| eagle3_cg_5 |" in md
        and "speculative-num-draft-tokens=5" in md
        and "winner: baseline" in md
    )
    csv = d.http.get(f"/sweeps/{sid}/table.csv").text
    assert csv.splitlines()[0].startswith("config,flags vs baseline,tok/s")
    png = d.http.get(f"/sweeps/{sid}/chart.png")
    assert png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"
    assert (tmp_path / "state" / "sweeps" / sid / "chart.png").exists()


def test_cli_sweep_and_cancel_restores(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    port = free_port()
    cfgs = configs(port)
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {k: cfgs[k] for k in ("baseline", "eagle3_cg_5")},
        default="baseline",
    )
    d.wait_state("ready")
    res = subprocess.run(
        [
            PY,
            "-m",
            "gpuwarden.api.cli",
            "sweep",
            "eagle3_cg_5",
            "baseline",
            "--baseline",
            "baseline",
            "--requests",
            "1",
            "--warmup",
            "0",
            "--max-tokens",
            "40",
            "--url",
            d.url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "| eagle3_cg_5 |" in res.stdout and "restored: baseline" in res.stdout
    sid = d.http.post(
        "/sweeps", json={"configs": ["eagle3_cg_5", "baseline"], "max_tokens": 400, "requests": 3}
    ).json()["id"]
    d.wait_event("server.sweep_progress", sweep_id=sid)
    cancelled = d.http.delete(f"/sweeps/{sid}").json()
    assert cancelled["state"] == "cancelled"
    d.wait_event("server.sweep_restored", sweep_id=sid, timeout=60)
    assert d.status()["config"] == "baseline"


def test_tokens_are_the_streams_usage_and_words_only_without_it() -> None:
    from gpuwarden.daemon.load import RequestResult, _count  # noqa: PLC0415

    # Three chunks of text; the words say 9, the server says 6 tokens.
    arrivals = [(10.5, 3), (11.0, 3), (11.5, 3)]
    res = RequestResult(ok=True, started=10.0)
    _count(res, arrivals, usage=6)
    assert (res.tokens, res.counted_by, res.ttft_s) == (6, "usage", 0.5)
    assert res.itl_s == [0.25, 0.25, 0.25, 0.25]  # 0.5 s per chunk of 2 tokens
    words = RequestResult(ok=True, started=10.0)
    _count(words, arrivals, usage=None)
    assert (words.tokens, words.counted_by) == (9, "words")
