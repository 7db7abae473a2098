"""Every stand-in fault, run for real and checked against SGLang's output and exit status."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from gpuwarden.standin import fakegpu
from gpuwarden.standin.specmodel import DecodeModel, SpecParams

from .support.gpu import start_holder
from .support.procs import Proc, alive, free_port, wait_until


def url(proc: Proc, path: str) -> str:
    return f"http://127.0.0.1:{proc.port}{path}"  # type: ignore[attr-defined]


LOAD_CRASH_LINES = {
    "cuda_oom": r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate [\d.]+ GiB",
    "nccl_init": r"torch\.distributed\.DistBackendError: NCCL error in: .*ProcessGroupNCCL\.cpp",
    "not_enough_memory": (
        r"RuntimeError: Not enough memory\. Please try to increase --mem-fraction-static\."
    ),
    "capture": r"Exception: Capture cuda graph failed: CUDA error: out of memory",
}


@pytest.mark.parametrize("kind", sorted(LOAD_CRASH_LINES))
def test_crash_during_load_goes_through_sigquit_to_minus_9(
    standin: Callable[..., Proc], kind: str
) -> None:
    proc: Proc = standin("--standin-crash-on-load", kind, "--tp-size", "2")
    proc.wait_for(
        r"\[[\d\- :]+ TP\d\] Scheduler hit an exception: Traceback \(most recent call last\):"
    )
    proc.wait_for(LOAD_CRASH_LINES[kind])
    proc.wait_for(r"Received sigquit from a child process\. It usually means the child failed\.")
    assert proc.wait(20) == -signal.SIGKILL
    if kind == "capture":
        text = proc.text()
        assert "Possible solutions:" in text
        assert "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)" in text
        assert "4. disable CUDA graph by --disable-cuda-graph." in text
    assert "fired up" not in proc.text()


def test_a_busy_fake_gpu_makes_the_load_oom(
    standin: Callable[..., Proc], procs: list[Proc], fake_gpu: Path
) -> None:
    start_holder(procs, fake_gpu, 0, 120000)
    proc: Proc = standin()
    proc.wait_for(r"Load weight begin\. avail mem=2[0-3]\.\d\d GB")
    proc.wait_for(LOAD_CRASH_LINES["cuda_oom"])
    assert proc.wait(20) == -signal.SIGKILL


def test_scheduler_crash_after_ready(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin("--standin-crash-after", "0.2")
    proc.wait_for("fired up and ready")
    proc.wait_for(r"Scheduler hit an exception: Traceback")
    proc.wait_for(r"RuntimeError: CUDA error: an illegal memory access was encountered")
    proc.wait_for(
        r"SIGQUIT received\. signum=None, frame=None\. It usually means one child failed\."
    )
    # The scheduler is gone: no coredump wait (SGLang 0.5.23's crash diagnostics).
    proc.wait_for(r"No live scheduler processes found; skipping py-spy and CUDA coredump\.")
    assert proc.wait(20) == -signal.SIGKILL


def test_silent_scheduler_death_is_unnoticed_by_0_5_5(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin("--standin-silent-death-after", "0", version="0.5.5", scale=0.05)
    proc.wait_for("fired up and ready")
    # /proc/PID/comm ("sglang::schedul", set by setproctitle) stays readable for a zombie.
    sched = next(
        c for c in psutil.Process(proc.pid).children() if c.name().startswith("sglang::sch")
    )
    wait_until(lambda: not alive(sched.pid), 10, "the scheduler to abort")
    # The parent keeps answering: a zombie service (SGLANG.md §2).
    assert httpx.get(url(proc, "/v1/models")).status_code == 200
    assert httpx.get(url(proc, "/health"), timeout=10).status_code == 503  # after 20 s x scale
    proc.wait_for(
        r"Health check failed\. Server couldn't get a response from detokenizer for "
        r"last 20 seconds\. tic start time: \d\d:\d\d:\d\d\. last_heartbeat time: "
    )
    assert proc.popen.poll() is None
    assert "Traceback" not in proc.text()


@pytest.mark.parametrize("version", ["0.5.12", "0.5.23"])
def test_silent_scheduler_death_is_caught_by_the_subprocess_watchdog(
    standin: Callable[..., Proc], version: str
) -> None:
    proc: Proc = standin("--standin-silent-death-after", "0.1", version=version)
    proc.wait_for("fired up and ready")
    proc.wait_for(
        r"Subprocess scheduler_0 \(pid=\d+\) crashed with exit code -6\. "
        r"Triggering SIGQUIT for cleanup\.\.\."
    )
    assert proc.wait(20) == -signal.SIGKILL


@pytest.mark.parametrize(
    ("version", "line"),
    [
        ("0.5.5", r"\[[\d\- :]+ TP1\] Watchdog timeout \(self\.watchdog_timeout=300\)"),
        (
            "0.5.23",
            r"\[[\d\- :]+ TP1\] Scheduler watchdog timeout "
            r"\(self\.watchdog_timeout=300, self\.soft=False\)",
        ),
    ],
)
def test_watchdog_timeout_on_every_rank_then_minus_9(
    standin: Callable[..., Proc], version: str, line: str
) -> None:
    # The hung schedulers are alive: 0.5.23 would wait 60 s for CUDA coredumps first.
    no_wait = {"SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0"}
    proc: Proc = standin(
        "--standin-watchdog-after", "0.1", "--tp-size", "2", version=version, env=no_wait
    )
    proc.wait_for("fired up and ready")
    proc.wait_for(line.replace("TP1", "TP0"))
    proc.wait_for(line)
    proc.wait_for(r"SIGQUIT received")
    assert proc.wait(20) == -signal.SIGKILL


@pytest.mark.parametrize(("version", "rc"), [("0.5.23", 3), ("0.5.5", 1)])
def test_port_in_use_is_noticed_only_after_loading(
    standin: Callable[..., Proc], foreign_http: Callable[[int], Proc], version: str, rc: int
) -> None:
    port = free_port()
    foreign_http(port)  # another server answers on the port
    proc: Proc = standin(version=version, port=port)
    m = proc.wait_for(
        r"ERROR:    \[Errno 98\] error while attempting to bind on address "
        r"\('127\.0\.0\.1', (\d+)\): address already in use"
    )
    assert int(m.group(1)) == port
    assert proc.index_of("Load weight end") < proc.matched_at
    assert proc.wait(20) == rc
    # 0.5.23's warm-up runs from the app's lifespan, before the bind, and is joined on the way
    # out: it reached the other server, so the ready line is printed all the same.
    assert ("fired up and ready to roll" in proc.text()) is (version == "0.5.23")


def _detokenizer(proc: Proc) -> psutil.Process:
    return next(
        c for c in psutil.Process(proc.pid).children() if c.name().startswith("sglang::detok")
    )


def test_a_dead_detokenizer_leaves_the_port_open_and_requests_hanging(
    standin: Callable[..., Proc],
) -> None:
    """0.5.23 with its defaults: a scheduler is still alive, so after 5 s of settling and a
    py-spy attempt it waits 60 s for CUDA coredumps; its loop is blocked the while."""
    proc: Proc = standin()
    proc.wait_for("fired up and ready")
    _detokenizer(proc).kill()
    proc.wait_for(
        r"Subprocess detokenizer \(pid=\d+\) crashed with exit code -9\. "
        r"Triggering SIGQUIT for cleanup\.\.\."
    )
    proc.wait_for(
        r"SIGQUIT received\. signum=None, frame=None\. It usually means one child failed\."
    )
    proc.wait_for(r"Sleeping 5 seconds before crash diagnostics to let GPU activity settle\.")
    proc.wait_for(r"Pyspy failed \(py-spy dump --native --pid \d+\)\. Error: ")
    proc.wait_for(r"Waiting 60\.0 seconds for CUDA coredumps before exiting\.")
    with socket.create_connection(("127.0.0.1", proc.port), timeout=5):  # type: ignore[attr-defined]
        pass  # the port still takes connections
    with pytest.raises(httpx.TimeoutException):
        httpx.get(url(proc, "/health"), timeout=1.0)
    assert proc.popen.poll() is None
    proc.kill_group()  # (its loop is blocked for 60 s: a SIGTERM would wait for it)


def test_with_crash_diagnostics_off_a_dead_child_ends_the_server_at_once(
    standin: Callable[..., Proc],
) -> None:
    off = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
    proc: Proc = standin(env=off)
    proc.wait_for("fired up and ready")
    _detokenizer(proc).kill()
    proc.wait_for(r"SIGQUIT received\. signum=None, frame=None\.")
    assert proc.wait(20) == -signal.SIGKILL
    assert "Sleeping 5 seconds" not in proc.text()


def test_hang_times_out_health_and_stalls_requests(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin("--standin-hang-after", "0", scale=0.05)
    proc.wait_for("fired up and ready")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url(proc, "/generate"),
            json={"text": "x", "sampling_params": {"max_new_tokens": 4}},
            timeout=1.5,
        )
    assert httpx.get(url(proc, "/health"), timeout=10).status_code == 503
    proc.wait_for("Health check failed")
    assert proc.popen.poll() is None


def test_main_ignoring_sigterm_keeps_serving(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin("--standin-ignore-sigterm")
    proc.wait_for("fired up and ready")
    proc.signal(signal.SIGTERM)
    # The request below is served after the signal was delivered (signals to a running
    # process are delivered before it next runs user code).
    assert httpx.get(url(proc, "/health"), timeout=5).status_code == 200
    assert proc.popen.poll() is None
    assert "SIGTERM received" not in proc.text()
    proc.kill_group()  # (it ignores the SIGTERM the teardown would send first)


def test_escaping_grandchild_keeps_holding_gpu_memory(
    standin: Callable[..., Proc], fake_gpu: Path
) -> None:
    proc: Proc = standin("--standin-escape-grandchild", "30000")
    m = proc.wait_for(r"escapee pid=(\d+) holds 30000 MiB on GPU 0 \(setsid, ignores SIGTERM\)")
    escapee = int(m.group(1))
    try:
        proc.wait_for("fired up and ready")
        assert psutil.Process(escapee).ppid() != proc.pid  # double-forked away
        assert alive(escapee)
        assert os.getsid(escapee) == escapee  # its own session, out of the server's group
        proc.kill_group()  # SIGKILL to the whole server group
        reader = fakegpu.FakeGpuReader(fake_gpu)

        def only_escapee_holds() -> bool:
            return all(h.pid == escapee for h in reader.usage()[0].holders)

        wait_until(only_escapee_holds, 10, "the schedulers' memory to be released")
        usage = fakegpu.FakeGpuReader(fake_gpu).usage()[0]
        assert [(h.pid, h.mib) for h in usage.holders] == [(escapee, 30000)]
        os.kill(escapee, signal.SIGTERM)  # ignored
        assert alive(escapee)
    finally:
        if alive(escapee):
            os.kill(escapee, signal.SIGKILL)


def test_output_faults_flood_invalid_utf8_long_line_progress_bars(
    standin: Callable[..., Proc],
) -> None:
    proc: Proc = standin(
        "--standin-flood",
        "20000",
        "--standin-invalid-utf8",
        "--standin-long-line",
        "1048576",
        "--standin-progress-bars",
        "5",
    )
    proc.wait_for("flood done: 20000 lines")
    proc.wait_for(r"long line: L{1048576}$", timeout=30)
    raw = bytes(proc.raw["stderr"])
    assert raw.count(b"] flood line ") == 20000
    assert b"invalid bytes: \xff\xfe\xc3\x28 \x80 end\n" in raw
    assert raw.count(b"\rLoading safetensors checkpoint shards:") == 4 + 5 + 1
    numbers = [int(line.split()[4]) for line in raw.split(b"\n") if b"] flood line " in line]
    assert numbers == list(range(20000))


# -- the speculative model's calibration, through the real process ------------------------------

SEED_TABLE = {
    # name: (flags, tok/s, accept len)
    "baseline": ([], 90.0, None),
    "eagle3_cg_5": (["--speculative-num-draft-tokens", "5"], 82.3, 2.1),
    "eagle3_cg_16": (["--speculative-num-draft-tokens", "16"], 74.9, 2.2),
    "eagle3_nocg_16": (["--speculative-num-draft-tokens", "16", "--disable-cuda-graph"], 53.2, 2.2),
}
EAGLE = [
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-draft-model-path",
    "/d",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "4",
]


def measure_stream(proc: Proc, max_tokens: int) -> tuple[float, int]:
    """Client-side tok/s from the first streamed token to the last, and the token count."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    stamps: list[tuple[float, int]] = []
    with httpx.stream("POST", url(proc, "/v1/chat/completions"), json=body, timeout=60) as res:
        for line in res.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                n = sum(len(c["delta"].get("content", "").split()) for c in chunk["choices"])
                stamps.append((time.perf_counter(), n))
    total = sum(n for _, n in stamps)
    return (total - stamps[0][1]) / (stamps[-1][0] - stamps[0][0]), total


@pytest.mark.parametrize("name", sorted(SEED_TABLE))
def test_speculative_numbers_follow_the_seed_table(standin: Callable[..., Proc], name: str) -> None:
    flags, seed_tok_s, seed_accept = SEED_TABLE[name]
    args = [*flags, "--decode-log-interval", "20", "--standin-seed", "7"]
    if seed_accept is not None:
        args = [*EAGLE, *args]
    proc: Proc = standin(*args)
    proc.wait_for("fired up and ready")
    tok_s, total = measure_stream(proc, 240)
    assert total == 240
    # Client-visible rate within 12 % of the seed's figure (a busy 2-core machine only slows).
    assert seed_tok_s * 0.85 <= tok_s <= seed_tok_s * 1.12, tok_s
    proc.wait_for(r"Decode batch")
    lines = [line for _, line in proc.lines if "Decode batch" in line]
    rates = [float(line.split("gen throughput (token/s): ")[1].split(",")[0]) for line in lines]
    assert abs(statistics.median(rates) - tok_s) / tok_s < 0.2  # the log agrees with the client
    info = httpx.get(url(proc, "/get_server_info")).json()["internal_states"][0]
    assert abs(info["last_gen_throughput"] - tok_s) / tok_s < 0.3
    if seed_accept is None:
        assert "avg_spec_accept_length" not in info
        assert not any("accept len" in line for line in lines)
        return
    accept = [float(line.split("accept len: ")[1].split(",")[0]) for line in lines]
    assert abs(statistics.mean(accept) - seed_accept) <= 0.35, accept
    assert abs(info["avg_spec_accept_length"] - seed_accept) <= 0.35


def test_model_matches_the_seed_table_exactly_in_expectation() -> None:
    for name, (flags, seed_tok_s, seed_accept) in SEED_TABLE.items():
        if seed_accept is None:
            model = DecodeModel(None, cuda_graph=True)
        else:
            draft = int(flags[1])
            model = DecodeModel(
                SpecParams(3, 4, draft), cuda_graph="--disable-cuda-graph" not in flags
            )
        assert abs(model.expected_tok_s() - seed_tok_s) / seed_tok_s < 0.01, name
        if seed_accept is not None:
            assert 2.0 <= model.expected_accept_len() <= 2.4


def test_auto_chosen_and_topk_1_rules(standin: Callable[..., Proc]) -> None:
    proc: Proc = standin(
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d"
    )
    m = proc.wait_for(r"server_args=ServerArgs\(.*")
    for auto in (
        "speculative_num_steps=5",
        "speculative_eagle_topk=4",
        "speculative_num_draft_tokens=8",
    ):
        assert auto in m.group(0)
    proc2: Proc = standin(
        *EAGLE[:4],
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "9",
    )
    proc2.wait_for(
        "speculative_num_draft_tokens is adjusted to speculative_num_steps \\+ 1 when "
        "speculative_eagle_topk == 1"
    )
    assert "speculative_num_draft_tokens=3" in proc2.wait_for(r"server_args=.*").group(0)
