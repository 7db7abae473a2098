"""The stand-in as a supervisor sees it: startup order, ports, health, load, signals, tree."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from gpuwarden.standin import fakegpu

from .support.procs import Proc, alive, wait_until

STARTUP_ORDER = [
    r"server_args=ServerArgs\(model_path='/models/fake'",
    r"Init torch distributed begin\.",
    r"Init torch distributed ends\. mem usage=0\.00 GB",
    r"Load weight begin\. avail mem=\d+\.\d\d GB",
    r"Load weight end\. elapsed=\d+\.\d\d s, type=LlamaForCausalLM",
    r"Using KV cache dtype: torch\.bfloat16",
    r"KV Cache is allocated\. #tokens: \d+, K size: [\d.]+ GB, V size: [\d.]+ GB",
    r"Memory pool end\. avail mem=[\d.]+ GB",
    r"Capture target decode CUDA graph begin\. backend=full, num_tokens_per_req=1",
    r"Capture target decode CUDA graph end\. bs=\[",
    r"max_total_num_tokens=\d+, chunked_prefill_size=\d+, max_prefill_tokens=\d+",
    r"Engine startup timings \(s\): load_weight=[\d.]+, kv_cache_allocation=[\d.]+, "
    r"scheduler_e2e=[\d.]+, cuda_graph=\{prefill=0\.00, decode=[\d.]+, ",
    r"INFO:     Started server process \[\d+\]",
    r"INFO:     Uvicorn running on http://127\.0\.0\.1:\d+ \(Press CTRL\+C to quit\)",
    r"Prefill batch, #new-seq: 1, #new-token: \d+, #cached-token: 0",
    r"The server is fired up and ready to roll!",
]


def url(proc: Proc, path: str) -> str:
    return f"http://127.0.0.1:{proc.port}{path}"  # type: ignore[attr-defined]


def test_startup_lines_in_sglang_order(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin()
    last = -1
    for pattern in STARTUP_ORDER:
        proc.wait_for(pattern, start=last + 1)
        last = proc.matched_at
    # tp=1: no TP prefix; the access log goes to stdout, the rest to stderr.
    assert proc.text("stderr").splitlines()[-1].startswith("[20")
    assert " TP0]" not in proc.text()
    # The access lines are on stdout, a pipe with no order against stderr's lines: waited for
    # apart (0.5.23's warm-up asks the new info route, then generates).
    proc.wait_for(r'"GET /model_info HTTP/1\.1" 200 OK')
    proc.wait_for(r'"POST /generate HTTP/1\.1" 200 OK')
    assert '"POST /generate HTTP/1.1" 200 OK' in proc.text("stdout")


def test_tp_prefix_and_one_scheduler_per_rank(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin("--tp-size", "4", version="0.5.5")
    proc.wait_for("fired up and ready")
    for rank in range(4):
        assert f" TP{rank}] Load weight begin." in proc.text()
    # Titles set by setproctitle; multiprocessing's resource tracker may sit beside them, as
    # it does beside SGLang's children.
    cmdlines = sorted(
        " ".join(c.cmdline()).strip()
        for c in psutil.Process(proc.pid).children()
        if "resource_tracker" not in " ".join(c.cmdline())
    )
    assert cmdlines == [
        "sglang::detokenizer",
        "sglang::scheduler_TP0",
        "sglang::scheduler_TP1",
        "sglang::scheduler_TP2",
        "sglang::scheduler_TP3",
    ]


def test_port_refused_then_503_then_200(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin(scale=0.3)
    proc.wait_for("server_args=")
    with pytest.raises(httpx.ConnectError):
        httpx.get(url(proc, "/health"), timeout=2)
    proc.wait_for("Uvicorn running on")
    assert httpx.get(url(proc, "/health"), timeout=5).status_code == 503
    proc.wait_for("fired up and ready")
    assert httpx.get(url(proc, "/health"), timeout=5).status_code == 200
    assert httpx.get(url(proc, "/health_generate"), timeout=5).status_code == 200


def test_endpoints_answer_like_sglang(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin("--served-model-name", "kimi")
    proc.wait_for("fired up and ready")
    models = httpx.get(url(proc, "/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "kimi"
    assert models["data"][0]["owned_by"] == "sglang"
    info = httpx.get(url(proc, "/get_server_info")).json()
    assert info["version"] == "0.5.23"
    assert info["frontend"] == "python"
    assert "last_gen_throughput" in info["internal_states"][0]
    proc.wait_for("Endpoint '/get_server_info' is deprecated")
    gen = httpx.post(
        url(proc, "/generate"), json={"text": "hi", "sampling_params": {"max_new_tokens": 5}}
    )
    assert gen.json()["meta_info"]["completion_tokens"] == 5
    assert httpx.get(url(proc, "/metrics")).status_code == 404  # without --enable-metrics


def test_api_key_guards_all_but_health(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin("--api-key", "sk-secret-1")
    proc.wait_for("fired up and ready")
    assert "api_key='sk-secret-1'" in proc.text()  # SGLang prints it, secrets and all
    res = httpx.get(url(proc, "/v1/models"))
    assert res.status_code == 401
    assert res.json() == {"error": "Unauthorized"}
    assert httpx.get(url(proc, "/health")).status_code == 200
    ok = httpx.get(url(proc, "/v1/models"), headers={"Authorization": "Bearer sk-secret-1"})
    assert ok.status_code == 200


def stream_chat(proc: Proc, max_tokens: int) -> tuple[int, list[str]]:
    pieces: list[str] = []
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    with httpx.stream("POST", url(proc, "/v1/chat/completions"), json=body, timeout=60) as res:
        for line in res.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                pieces.extend(c["delta"].get("content", "") for c in chunk["choices"])
        return res.status_code, pieces


def test_decode_batch_lines_with_accept_len_under_load(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin(
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "/d",
        "--decode-log-interval",
        "5",
        version="0.5.5",
    )
    proc.wait_for("fired up and ready")
    status, pieces = stream_chat(proc, 60)
    assert status == 200
    assert len("".join(pieces).split()) == 60
    m = proc.wait_for(
        r"Decode batch, #running-req: 1, #token: \d+, token usage: \d\.\d\d, "
        r"accept len: (\d\.\d\d), accept rate: (\d\.\d\d), cuda graph: True, "
        r"gen throughput \(token/s\): ([\d.]+), #queue-req: 0, $"
    )
    assert 1.0 <= float(m.group(1)) <= 6.0
    info = httpx.get(url(proc, "/get_server_info")).json()
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1.0


def test_no_accept_len_without_speculation(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin("--decode-log-interval", "5")
    proc.wait_for("fired up and ready")
    stream_chat(proc, 20)
    line = proc.wait_for(r"Decode batch, .*gen throughput").group(0)
    assert "accept" not in line
    assert not line.endswith(", ")  # 0.5.12+ dropped the trailing comma


@pytest.mark.parametrize(("version", "rc"), [("0.5.23", 0), ("0.5.12", -9), ("0.5.5", -9)])
def test_sigterm_while_serving_drains_then_ends_as_the_version_does(
    standin: Callable[..., Proc], version: str, rc: int
) -> None:
    proc: Proc = standin("--decode-log-interval", "10", version=version, scale=0.05)
    proc.wait_for("fired up and ready")
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.update(out=stream_chat(proc, 90)))
    thread.start()
    proc.wait_for(r"Decode batch")  # the request is running
    proc.signal(signal.SIGTERM)
    proc.wait_for(r"SIGTERM received\. signum=.*Draining requests and shutting down\.\.\.")
    proc.wait_for(r"Gracefully exiting\.\.\. Remaining number of requests 1\.")
    thread.join(30)
    status, pieces = result["out"]  # type: ignore[misc]
    assert status == 200 and len("".join(pieces).split()) == 90  # drained, not cut
    proc.wait_for(r"Gracefully exiting\.\.\. Remaining number of requests 0\.")
    assert proc.wait(20) == rc


def test_sigterm_while_loading_dies_at_once(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin(scale=1.0)
    proc.wait_for("Load weight begin")
    proc.signal(signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM


def test_parent_sigkill_leaves_no_scheduler_once_parent_death_is_armed(
    standin: Callable[..., Proc], fake_gpu: Path
) -> None:
    proc: Proc = standin("--tp-size", "2")
    proc.wait_for("fired up and ready")
    children = psutil.Process(proc.pid).children()
    assert sum("sglang::scheduler" in " ".join(c.cmdline()) for c in children) == 2
    proc.signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    wait_until(lambda: not any(alive(c.pid) for c in children), 10, "schedulers to die")


def test_schedulers_are_fake_gpu_holders_until_they_die(
    standin: Callable[..., Proc], fake_gpu: Path
) -> None:
    proc: Proc = standin("--tp-size", "2", env={"CUDA_VISIBLE_DEVICES": "3,GPU-fake-5"})
    proc.wait_for("fired up and ready")
    reader = fakegpu.FakeGpuReader(fake_gpu)
    usage = {g.index: g for g in reader.usage()}
    held = {i for i, g in usage.items() if g.holders}
    assert held == {3, 5}
    sched_pids = {
        c.pid for c in psutil.Process(proc.pid).children() if "scheduler" in " ".join(c.cmdline())
    }
    assert {h.pid for i in held for h in usage[i].holders} == sched_pids
    assert usage[3].used_mib > usage[3].total_mib // 2
    proc.signal(signal.SIGKILL)
    proc.wait(10)
    wait_until(lambda: not any(g.holders for g in reader.usage()), 10, "holders to go")
