"""A start's phases: which line begins which, the segments of a launch, the ETA made from
earlier launches of the same config, and all of it through a real daemon and the stand-in."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.daemon import phases, startup
from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.sglanglines import parse_line, phase_of
from gpuwarden.daemon.views import startup_of

from .support.configs import standin_config
from .support.daemon import start_daemon
from .support.procs import PY, Proc, wait_until

P = "[2026-12-06 10:00:00] "


@pytest.mark.parametrize(
    ("line", "phase"),
    [
        # 0.5.23, as the real server prints them on the CPU and on an H100
        (P + "Load weight begin. avail mem=61.17 GB", "weights"),
        (
            P + "Load weight end. elapsed=0.10 s, type=LlamaForCausalLM, avail mem=60.9 GB",
            "kv_cache",
        ),
        (P + "KV Cache is allocated. dtype: torch.float16, #tokens: 8192, K size: 0.00 GB", "init"),
        (P + "Memory pool end. avail mem=20.46 GB", "init"),
        (
            P + "Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1",
            "cuda_graphs",
        ),
        (P + "Capture draft decode CUDA graph end. bs=[1, 2], elapsed=0.40 s", "init"),
        (
            P + "Capture target decode CPU graph begin. backend=full, num_tokens_per_req=1",
            "cuda_graphs",
        ),
        ("INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)", "warmup"),
        # older logs, and the ranks of a tensor-parallel server (rank 0 speaks for them all)
        (
            P.replace("] ", " TP0] ")
            + "Capture cuda graph begin. This can take up to several minutes.",
            "cuda_graphs",
        ),
        (
            P.replace("] ", " DP0 TP0] ")
            + "Capture draft extend cuda graph end. Time elapsed: 2 s.",
            "init",
        ),
        (P.replace("] ", " TP3] ") + "Load weight begin. avail mem=61.17 GB", None),
        (P.replace("] ", " PP1 TP0] ") + "Load weight begin. avail mem=61.17 GB", None),
        # what only mentions the words
        (P + "Capture cuda graph bs [1, 2, 4, 8]", None),
        (P + "Receive: obj=GenerateReqInput(text='Load weight begin. please')", None),
        (P + "Prefill batch, #new-seq: 1, Load weight begin", None),
    ],
)
def test_the_lines_that_begin_a_phase(line: str, phase: str | None) -> None:
    assert phase_of(line) == phase
    assert parse_line(line).phase == phase


def test_segments_follow_the_marks_and_a_repeated_phase_is_one_segment() -> None:
    clock = phases.PhaseClock()
    for name, at in [("weights", 12.0), ("weights", 13.0), ("kv_cache", 20.0), ("init", 21.0)]:
        clock.mark(name, at)
    clock.mark("cuda_graphs", 21.0)
    clock.mark("warmup", 25.0)
    segs = clock.segments(10.0, 26.5)
    assert segs == [
        ("init", 2.0),
        ("weights", 8.0),
        ("kv_cache", 1.0),
        ("init", 0.0),
        ("cuda_graphs", 4.0),
        ("warmup", 1.5),
    ]
    # Up to a moment in the middle: what was marked later is not there yet.
    assert clock.segments(10.0, 15.0) == [("init", 2.0), ("weights", 3.0)]
    assert phases.totals(phases.record(segs)) == {
        "init": 2.0,
        "weights": 8.0,
        "kv_cache": 1.0,
        "cuda_graphs": 4.0,
        "warmup": 1.5,
    }
    # A first line at the exec leaves no empty init before it; no line at all is all init.
    first = phases.PhaseClock()
    first.mark("weights", 10.0)
    assert first.segments(10.0, 11.0) == [("weights", 1.0)]
    assert phases.PhaseClock().segments(10.0, 11.0) == [("init", 1.0)]


def _entry(segs: list[tuple[str, float]], config: str = "a", hash_: str = "h1") -> dict[str, Any]:
    return {"launch_id": "x", "config": config, "config_hash": hash_, "phases": phases.record(segs)}


def test_the_eta_is_what_the_earlier_launches_of_the_config_took_from_here() -> None:
    shape = ["init", "weights", "cuda_graphs", "warmup"]
    runs = [[10.0, 100.0, 20.0, 5.0], [12.0, 110.0, 22.0, 5.0], [11.0, 90.0, 21.0, 6.0]]
    history = [_entry(list(zip(shape, r, strict=True))) for r in runs]
    history.append(_entry([("init", 1.0), ("weights", 1.0)], config="b"))  # another config
    history.append(_entry([("init", 1.0), ("weights", 1.0)], hash_="h0"))  # its file changed
    history.append({"launch_id": "y", "config": "a", "config_hash": "h1", "phases": "junk"})
    history.append({"launch_id": "z", "config": "a", "config_hash": "h1", "phases": [["x", -1]]})
    expect = phases.expected(history, "a", "h1")
    assert expect is not None and expect.launches == 3
    assert expect.segments == (
        ("init", 11.0),
        ("weights", 100.0),
        ("cuda_graphs", 21.0),
        ("warmup", 5.0),
    )
    # 30 s into the weights (median 100 s): 70 + 21 + 5 left.
    now = phases.now([("init", 11.5), ("weights", 30.0)], expect)
    assert now == {"name": "weights", "elapsed_s": 30.0, "eta_s": 96.0}
    # A phase running past its median leaves the phases after it.
    assert phases.eta([("init", 11.0), ("weights", 300.0)], expect) == 26.0
    # A start that went otherwise (no weights line): the median total (135 s) less the time so far.
    assert phases.eta([("init", 20.0), ("cuda_graphs", 1.0)], expect) == 114.0
    # No earlier launch of the config that reached ready: no ETA.
    assert phases.expected(history, "c", "h1") is None
    assert phases.now([("init", 2.0)], None) == {"name": "init", "elapsed_s": 2.0, "eta_s": None}


def test_only_figures_of_a_servers_startup_time_are_kept() -> None:
    real = {
        "load_weight": 0.02,
        "kv_cache_allocation": 0.62,
        "scheduler_e2e": 2.47,
        "cuda_graph": {"prefill": 0.0, "decode": 1.25, "draft_decode": 0.5},
        "tokenizer_e2e": 3.1,
    }
    assert startup.checked(real) == {
        "load_weight": 0.02,
        "kv_cache_allocation": 0.62,
        "scheduler_e2e": 2.47,
        "tokenizer_e2e": 3.1,
        "cuda_graph": {"decode": 1.25, "draft_decode": 0.5},
    }
    hostile = {"load_weight": "1e309", "scheduler_e2e": float("nan"), "cuda_graph": {"x": True}}
    assert startup.checked(hostile) is None
    assert startup.checked(1796590940.5) is None  # what an older stand-in served
    assert startup.checked({"load_weight": -1, "tokenizer_e2e": 1e30}) is None


def test_a_start_shows_its_phase_and_eta_and_its_record_keeps_them(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config(scale=0.3)}, default="base")
    seen: list[dict[str, Any]] = []

    def loading() -> bool:
        phase = d.status()["phase"]
        if phase is not None:
            seen.append(phase)
        return phase is not None and phase["name"] == "weights"

    wait_until(loading, 30, "the first start to load its weights")
    assert seen[-1]["eta_s"] is None  # nothing to go by yet
    d.wait_state("ready")
    st = d.status()
    assert st["phase"] is None
    start = st["startup"]
    assert list(start["phases"]) == ["init", "weights", "kv_cache", "cuda_graphs", "warmup"]
    assert start["ready_s"] == pytest.approx(sum(start["phases"].values()), abs=0.01)
    assert start["phases"]["weights"] >= 4 * 0.3  # four shards of 1 s, time-scaled
    # SGLang's own account (the stand-in's, as 0.5.23 serves it), read once it serves.
    wait_until(lambda: d.status()["startup"]["server"] is not None, 20, "/server_info's")
    server = d.status()["startup"]["server"]
    assert server["load_weight"] == pytest.approx(start["phases"]["weights"], abs=0.3)
    assert server["cuda_graph"]["decode"] > 0
    # On the launch's record in state.json, saved as it came (a daemon killed now keeps it).
    launch_id = d.status()["launch_id"]

    def recorded() -> dict[str, Any]:
        state = json.loads((tmp_path / "state" / "state.json").read_text())
        return next(e for e in state["launches"] if e["launch_id"] == launch_id)

    wait_until(lambda: "server_startup" in recorded(), 10, "the record saved")
    entry = recorded()
    assert entry["server_startup"] == server and entry["ready_s"] == start["ready_s"]
    assert [p for p, _ in entry["phases"]][:2] == ["init", "weights"]

    # The next start of the same config has an ETA, shown by `status` and the record.
    mark = d.mark()
    d.http.post("/restart", params={"wait": "false"})
    d.wait_state("starting", after=mark)
    seen.clear()
    wait_until(loading, 30, "the second start to load its weights")
    assert seen[-1]["eta_s"] is not None and 0 < seen[-1]["eta_s"] < start["ready_s"]

    def cli_status() -> str:
        argv = [PY, "-m", "gpuwarden.api.cli", "status", "--url", d.url]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout

    out = cli_status()
    assert "loading weights" in out and "ready in ~" in out, out
    d.wait_state("ready", after=mark)
    out = cli_status()
    assert "start took" in out and "weights" in out, out


def test_a_hand_edited_record_is_no_reason_to_fail() -> None:
    for bad in (
        "abc",
        5,
        [["weights"]],
        [["weights", "x"]],
        [["weights", True]],
        [["weights", float("nan")]],
        [["weights", 1e308]],
        [["nope", 1.0]],
    ):
        entry = {"launch_id": "x", "config": "a", "config_hash": "h", "ready_s": 3.0, "phases": bad}
        assert startup_of([entry], "x") == {"ready_s": 3.0, "phases": {}, "server": None}, bad
        assert phases.expected([entry], "a", "h") is None, bad
    for ready_s in ("3", True, float("nan"), float("inf"), -1):
        entry = {"launch_id": "x", "ready_s": ready_s, "phases": [["weights", 1.0]]}
        assert startup_of([entry], "x") is None, ready_s


async def test_a_server_info_answer_too_deep_to_parse_is_no_figure(tmp_path: Path) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b"[" * 200_000
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "x.yaml").write_text(
        f"command: [{PY!r}, -m, gpuwarden.standin]\nargs: {{port: {port}}}\n"
    )
    cfg = ConfigStore(tmp_path / "configs").load("x")
    async with server:
        assert await startup.read(cfg) is None
