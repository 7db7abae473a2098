"""A sweep over the seed's four configs plus one refused and one crashing config, unattended."""

from __future__ import annotations

import asyncio
import csv
import io
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .support.configs import standin_config
from .support.daemon import start_daemon
from .support.procs import PY, Proc, free_port, wait_until

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
    # Each swap away from a config on probation passed it; a swept config's never counts.
    assert st["last_good_config"] == "baseline"
    md = d.http.get(f"/sweeps/{sid}/table.md").text
    assert (
        "| eagle3_cg_5 |" in md
        and "speculative-num-draft-tokens=5" in md
        and "winner: baseline" in md
    )
    for name in SEED:  # fixed-length answers, counted by the server, with their spread
        r = rows[name]
        assert r["output_tokens"] == 2 * 120 and r["ignore_eos"] is True, r
        assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"] <= r["ttft_max_s"]
        assert r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
        assert abs(r["itl_p50_s"] * r["tok_s"] - 1) < 0.05, r  # ITL and tok/s from tokens
    csv_text = d.http.get(f"/sweeps/{sid}/table.csv").text
    assert csv_text.splitlines()[0].startswith("config,flags vs baseline,status,reason,tok/s")
    assert_numeric(csv_text)
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
    # A plain aligned table, not Markdown: the header and each row start in column 0.
    lines = res.stdout.splitlines()
    header = next(line for line in lines if line.startswith("config "))
    assert "|" not in res.stdout and "tok/s (p50)" in header and "TTFT p50 (ms)" in header
    assert "ready (s)" in header  # each config's time to ready, from its phases
    row = next(line for line in lines if line.startswith("eagle3_cg_5 "))
    assert header.index("flags vs baseline") == row.index("speculative"), (header, row)
    assert "restored: baseline" in res.stdout and "chart.png" in res.stdout
    sid = d.http.post(
        "/sweeps", json={"configs": ["eagle3_cg_5", "baseline"], "max_tokens": 400, "requests": 3}
    ).json()["id"]
    d.wait_event("server.sweep_progress", sweep_id=sid)
    cancelled = d.http.delete(f"/sweeps/{sid}").json()
    assert cancelled["state"] == "cancelled"
    d.wait_event("server.sweep_restored", sweep_id=sid, timeout=60)
    assert d.status()["config"] == "baseline"


def assert_numeric(text: str) -> None:
    """Every cell of a number column is a number or empty; the units are in the header."""
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows
    words = {"config", "flags vs baseline", "status", "reason", "evidence"}
    for row in rows:
        for column, cell in row.items():
            if column not in words and cell != "":
                float(cell)  # raises on "82.3 tok/s", "1.10x", "-", "2/0"
                assert "(" not in cell and "x" not in cell, (column, cell)


def sweep_of(d: Any, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    res = d.http.post("/sweeps", json=body)
    assert res.status_code == 202, res.text
    sid = res.json()["id"]

    def ended() -> bool:
        return d.http.get(f"/sweeps/{sid}").json().get("ended_at") is not None

    wait_until(ended, timeout, f"sweep {sid} to end")
    view: dict[str, Any] = d.http.get(f"/sweeps/{sid}").json()
    return view


def test_tokens_are_the_servers_count_never_words_and_answers_are_fixed_length(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A server whose tokens are half-words, that ends answers at EOS after 20 tokens unless
    told `ignore_eos`, and (`mute`) sends no usage even when asked."""
    port = free_port()
    flags = ("--standin-token-text=pieces", "--standin-eos-after=20", "--standin-seed=3")
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {
            "usage": standin_config(*flags, port=port),
            "mute": standin_config(*flags, "--standin-stream-usage=never", port=port),
        },
        default="usage",
    )
    d.wait_state("ready")
    body = {"configs": ["usage", "mute"], "requests": 3, "warmup": 1, "max_tokens": 60}
    rows = {r["config"]: r for r in sweep_of(d, body)["rows"]}
    assert rows["usage"]["tokens_counted_by"] == "usage"
    assert rows["mute"]["tokens_counted_by"] == "length"  # finish_reason: length at max_tokens
    for r in rows.values():
        assert r["status"] == "ok", r
        # ignore_eos was sent: 60 tokens each (30 words; EOS would have ended them at 20).
        assert r["output_tokens"] == 3 * 60, r
        # ITL = (last token - first) / 59 tokens; 90 tok/s is the stand-in's pace.
        assert 0.85 / 90 <= r["itl_p50_s"] <= 1.15 / 90, r
        assert 90 * 0.85 <= r["tok_s"] <= 90 * 1.15, r
    # Without ignore_eos the server's EOS ends each answer at 20 tokens.
    body = {**body, "configs": ["usage"], "ignore_eos": False}
    row = sweep_of(d, body)["rows"][0]
    assert row["output_tokens"] == 3 * 20 and row["tokens_counted_by"] == "usage", row


def test_itl_is_from_token_counts_and_a_stream_without_a_count_gives_none() -> None:
    from gpuwarden.daemon.load import LoadSpec, RequestResult, count, summarise  # noqa: PLC0415

    # Three chunks of text over one second; the server says 6 tokens.
    arrivals = [10.5, 11.0, 11.5]
    res = RequestResult(ok=True, started=10.0)
    count(res, arrivals, usage=6, finish="length", max_tokens=8)
    assert (res.tokens, res.counted_by, res.ttft_s) == (6, "usage", 0.5)
    assert res.itl_s == 0.2 and res.tok_s == 5.0  # 1 s over 5 gaps between 6 tokens
    length = RequestResult(ok=True, started=10.0)
    count(length, arrivals, usage=None, finish="length", max_tokens=8)
    assert (length.tokens, length.counted_by, length.itl_s) == (8, "length", 1 / 7)
    unknown = RequestResult(ok=True, started=10.0)
    count(unknown, arrivals, usage=None, finish="stop", max_tokens=8)
    assert (unknown.tokens, unknown.counted_by, unknown.itl_s) == (None, None, None)
    out = summarise([res, length, unknown], wall=2.0, spec=LoadSpec())
    assert out["tokens_counted_by"] == "mixed" and out["total_tok_s"] is None
    assert out["output_tokens"] == 14 and out["requests_ok"] == 3
    assert out["tok_s_min"] == pytest.approx(5.0) and out["tok_s_max"] == pytest.approx(7.0)
    assert out["tok_s"] == pytest.approx(6.0)  # the median of two requests' rates


def test_sweeps_are_listed_pruned_to_the_newest_and_kept_across_a_restart(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfgs = {"a": standin_config("--standin-seed=3")}
    d = start_daemon(procs, tmp_path, fake_gpu, cfgs, default="a", retention={"sweeps": 2})
    d.wait_state("ready")
    body = {"configs": ["a"], "requests": 2, "warmup": 0, "max_tokens": 8}
    ids = [sweep_of(d, body)["id"] for _ in range(3)]
    listed = d.http.get("/sweeps").json()["sweeps"]
    assert [s["id"] for s in listed] == ids[1:]  # the oldest went, folder and all
    assert sorted(p.name for p in (tmp_path / "state" / "sweeps").iterdir()) == sorted(ids[1:])
    assert d.wait_event("server.sweeps_pruned")["sweep_ids"] == ids[:1]
    first = listed[0]
    assert first["configs"] == ["a"] and first["state"] == "done" and first["best"] == "a"
    assert first["best_tok_s"] > 0 and first["ended_at"] >= first["started_at"]
    assert d.http.get(f"/sweeps/{ids[0]}").status_code == 404

    d.proc.signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    again = start_daemon(procs, tmp_path, fake_gpu, cfgs, default="a", retention={"sweeps": 2})
    assert again.http.get("/sweeps").json()["sweeps"] == listed
    view = again.http.get(f"/sweeps/{ids[2]}").json()
    assert view["rows"][0]["config"] == "a" and view["rows"][0]["status"] == "ok"
    assert_numeric(again.http.get(f"/sweeps/{ids[2]}/table.csv").text)
    assert again.http.get(f"/sweeps/{ids[2]}/chart.png").content[:4] == b"\x89PNG"


SWEEP_CLI = [PY, "-m", "gpuwarden.api.cli", "sweep"]
NO_MATPLOTLIB = """
import sys


class NoCharts:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoCharts())
"""


def test_a_chart_without_the_charts_extra_says_how_to_get_it(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """matplotlib is hidden from the daemon (an import hook in its sitecustomize): the sweep's
    table and CSV come, and the chart's absence names the extra, over HTTP and in the CLI."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NO_MATPLOTLIB)
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"a": standin_config()},
        default="a",
        env={"PYTHONPATH": str(hook)},
    )
    d.wait_state("ready")
    view = sweep_of(d, {"configs": ["a"], "requests": 1, "warmup": 0, "max_tokens": 8})
    assert view["state"] == "done" and view["rows"][0]["status"] == "ok"
    res = d.http.get(f"/sweeps/{view['id']}/chart.png")
    assert res.status_code == 404, res.text
    assert res.json()["extra"] == "charts"
    assert "pip install 'gpuwarden[charts]'" in res.json()["detail"]
    assert d.http.get(f"/sweeps/{view['id']}/table.csv").status_code == 200
    assert not (Path(view["folder"]) / "chart.png").exists()
    cli = subprocess.run(
        [*SWEEP_CLI, "a", "--requests=1", "--warmup=0", "--max-tokens=8", "--url", d.url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    assert "no chart: charts need matplotlib" in cli.stdout
    assert "pip install 'gpuwarden[charts]'" in cli.stdout


def test_the_sglang_bench_load_runs_with_the_configs_python_and_says_why_it_failed(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The stand-in's Python has no SGLang: the benchmark runs, exits 1, and the row says so
    (`make test-real` runs it against the real SGLang)."""
    d = start_daemon(procs, tmp_path, fake_gpu, {"a": standin_config()}, default="a")
    d.wait_state("ready")
    body = {"configs": ["a"], "backend": "sglang-bench", "requests": 2, "warmup": 0}
    row = sweep_of(d, body)["rows"][0]
    assert row["status"] == "failed" and row["reason"] == "load_failed", row
    assert "the benchmark exited 1" in row["evidence"] and "sglang" in row["evidence"], row
    head = Path(row["bench_log"]).read_text().splitlines()[0]
    assert head.startswith(f"$ {PY} -m sglang.benchmark.serving --backend sglang --base-url")
    assert "--dataset-name random-ids" in head and "--random-range-ratio 1.0" in head


def test_the_benchmarks_python_is_command0_or_its_scripts_shebang(tmp_path: Path) -> None:
    from gpuwarden.daemon.sglangbench import BenchError, interpreter  # noqa: PLC0415

    script = tmp_path / "sglang"
    script.write_text(f"#!{PY}\nprint('hi')\n")
    assert interpreter([PY, "-m", "sglang.launch_server"], {}) == PY
    assert interpreter([str(script), "serve"], {}) == PY
    other = tmp_path / "server"
    other.write_text("#!/bin/sh\nexit 0\n")
    with pytest.raises(BenchError, match="not a Python interpreter"):
        interpreter([str(other)], {})


def run_cli_sweep(d: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SWEEP_CLI, *args, "--url", d.url],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


@pytest.mark.timeout(180)
def test_the_restore_waits_for_the_last_configs_rollback(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The last config crashes during its load and the machine rolls back to `base`, which
    takes seconds to start: the restore waits for that rollback to settle, and says `base`
    is back. Before, its restart was refused (a swap under way), silently: `restored` null."""
    port = free_port()
    cfgs = {
        "base": standin_config(port=port, scale=0.3),
        "crashy": standin_config("--standin-crash-after=1", port=port),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, cfgs, default="base")
    d.wait_state("ready", timeout=60)
    res = run_cli_sweep(d, "crashy", "--requests=30", "--warmup=0", "--max-tokens=30")
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "restored: base" in res.stdout, res.stdout
    st = d.status()
    assert (st["config"], st["state"]) == ("base", "ready"), st


@pytest.mark.timeout(180)
def test_a_sweep_whose_original_config_cannot_return_says_so_and_the_cli_fails(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """`base` is edited during the sweep into a config that cannot load: the restore's swap
    rolls back to the swept config. The record says `base` is not back, and why; the CLI exits
    1 saying so. Before, `restored` named `base` while `b` served, and the CLI exited 0."""
    port = free_port()
    cfgs = {"base": standin_config(port=port), "b": standin_config(port=port)}
    d = start_daemon(
        procs, tmp_path, fake_gpu, cfgs, default="base", restart={"initial_delay_s": 30}
    )
    d.wait_state("ready")
    cli = subprocess.Popen(
        [*SWEEP_CLI, "b", "--requests=3", "--warmup=0", "--max-tokens=90", "--url", d.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        d.wait_event("server.sweep_progress", config="b")
        broken = standin_config("--standin-crash-on-load=cuda_oom", port=port)
        (tmp_path / "configs" / "base.yaml").write_text(yaml.safe_dump(broken))
        out, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 1, (out, err)
    assert "not restored: base is not serving: rolled_back: cuda_oom" in err, err
    assert "not restored: base is not serving" in out, out
    view = d.http.get("/sweeps").json()["sweeps"][-1]
    record = d.http.get(f"/sweeps/{view['id']}").json()
    assert record["restored"] is False and "cuda_oom" in record["restore_error"], record
    assert d.status()["config"] == "b"


def test_a_config_with_an_api_key_is_measured_with_it_and_the_key_is_never_recorded(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """The server asks for `Authorization: Bearer KEY` (SGLang's --api-key): the sweep's
    client sends the key of the launch's argv, and the key is in no file, record or log line.
    Before, every request got 401."""
    key = "sk-sweep-7f3a9c1e"
    port = free_port()
    cfgs = {
        "base": standin_config(port=port),
        "keyed": standin_config(f"--api-key={key}", port=port),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, cfgs, default="base")
    d.wait_state("ready")
    view = sweep_of(d, {"configs": ["keyed"], "requests": 2, "warmup": 0, "max_tokens": 10})
    row = view["rows"][0]
    assert row["status"] == "ok" and row["requests_ok"] == 2, row
    assert view["restored"] == "base"
    folder = Path(view["folder"])
    written = [p.read_bytes() for p in folder.iterdir() if p.is_file()]
    written.append((tmp_path / "state" / "events.jsonl").read_bytes())
    written.append(d.proc.text().encode())
    assert written and all(key.encode() not in blob for blob in written)
    assert key not in d.http.get(f"/sweeps/{view['id']}").text


def test_the_api_key_is_read_from_the_argv_as_argparse_reads_it() -> None:
    from gpuwarden.daemon.sweep import auth_headers, flag_value  # noqa: PLC0415

    assert flag_value(["sglang", "--api-key", "a", "--port", "1"], "--api-key") == "a"
    assert flag_value(["sglang", "--api-key=b=c"], "--api-key") == "b=c"
    assert flag_value(["sglang", "--api-key", "a", "--api-key=z"], "--api-key") == "z"
    assert flag_value(["sglang", "--api-keys", "a"], "--api-key") is None
    assert flag_value(["sglang", "--api-key"], "--api-key") is None
    assert auth_headers(["s", "--api-key", "k"]) == {"Authorization": "Bearer k"}
    assert auth_headers(["s"]) == {}


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ("1", "a stream chunk is not a JSON object: '1'"),
        ("[1]", "a stream chunk is not a JSON object: '[1]'"),
        ("not-json", "a stream chunk is not JSON: 'not-json'"),
        ('{"choices": [1]}', "a stream chunk's choices are not objects"),
        ('{"choices": "x"}', "a stream chunk's choices are not objects"),
        ('{"usage": 5}', "a stream chunk's usage is not an object"),
        ('{"usage": {"completion_tokens": "5"}}', "token count is not a number"),
        ('{"choices": [{"delta": "x"}]}', "a stream chunk's delta is not an object"),
        ('{"error": {"message": "boom"}}', "the server sent an error in the stream: 'boom'"),
    ],
)
def test_a_chunk_that_is_not_a_chunk_is_refused_with_its_reason(payload: str, why: str) -> None:
    from gpuwarden.daemon.load import AnswerError, read_chunk  # noqa: PLC0415

    with pytest.raises(AnswerError, match=re.escape(why)):
        read_chunk(payload)
    chunk = '{"choices": [{"delta": {"content": "hi"}, "finish_reason": "length"}]}'
    assert read_chunk(chunk) == (None, "length", True)
    assert read_chunk('{"choices": [], "usage": {"completion_tokens": 7}}') == (7, None, False)


def test_lines_are_split_across_reads_and_a_long_one_stops_the_reading() -> None:
    import httpx  # noqa: PLC0415

    from gpuwarden.daemon.load import AnswerError, lines  # noqa: PLC0415

    served: list[int] = []

    async def body(parts: list[bytes]) -> Any:
        for part in parts:
            served.append(len(part))
            yield part

    async def read(parts: list[bytes], limit: int) -> list[str]:
        response = httpx.Response(200, content=body(parts))
        return [line async for line in lines(response, limit)]

    assert asyncio.run(read([b"da", b"ta: 1\r\n\nda", b"ta: 2"], 16)) == ["data: 1", "", "data: 2"]
    served.clear()
    endless = [b"data: " + b"x" * 10] * 1000
    with pytest.raises(AnswerError, match="longer than 64 bytes"):
        asyncio.run(read(endless, 64))
    assert len(served) < 10  # not read on to the end
