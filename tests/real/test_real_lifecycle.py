"""Scenarios that end their daemon or their server for good: each has its own daemon."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.procs import Proc, alive, free_port, wait_until
from tests.support.shim import shims_ended

from .conftest import STARTUP_S, DaemonFactory, sglang_config

pytestmark = pytest.mark.timeout(900)


def test_the_daemons_sigterm_stops_sglang_gracefully_and_leaves_nothing(
    real_daemon: DaemonFactory, sglang_env: Path
) -> None:
    d = real_daemon({"tiny": sglang_config(sglang_env)}, default="tiny")
    wait_until(lambda: d.status()["state"] == "ready", STARTUP_S, "the real server")
    st = d.status()
    tree = [st["pid"], *(c.pid for c in psutil.Process(st["pid"]).children(recursive=True))]
    assert len(tree) >= 3  # main, scheduler, detokenizer (and multiprocessing's tracker)
    d.proc.signal(signal.SIGTERM)
    assert d.proc.wait(120) == 0
    log = Path(st["log_file"]).read_text()
    # SIGTERM went to SGLang's main process alone: it drained and exited 0. Had the whole group
    # been signalled, the scheduler's -15 would have shown as a crash.
    assert "SIGTERM received. signum=None frame=None. Draining requests and shutting down" in log
    assert "Gracefully exiting... Remaining number of requests 0." in log
    assert "crashed with exit code -15" not in log
    assert "# exit: stopped on request (exited with code 0)" in log
    assert not [pid for pid in tree if alive(pid)]


def test_a_port_taken_while_sglang_loads_is_port_in_use_never_ready(
    real_daemon: DaemonFactory, sglang_env: Path, foreign_http: Callable[[int], Proc]
) -> None:
    """SGLang binds only after loading, and prints its ready line when its warm-up reached
    whatever answers on the port: the daemon checks who holds the socket."""
    port = free_port()
    d = real_daemon(
        {"tiny": sglang_config(sglang_env, port)},
        default="tiny",
        restart={"initial_delay_s": 600},
    )
    d.wait_event("server.launch", timeout=60)
    foreign = foreign_http(port)
    ex = d.wait_event("server.exit", reason="port_in_use", timeout=STARTUP_S)
    assert f"127.0.0.1:{port} is held by pid {foreign.pid} (" in ex["evidence"], ex
    states = [r["to"] for r in d.records() if r.get("event") == "server.state"]
    assert "ready" not in states, states
    assert d.status()["state"] == "backoff"


def test_a_daemon_sigkilled_while_sglang_serves_is_adopted_and_chats_answer_throughout(
    real_daemon: DaemonFactory, sglang_env: Path, procs: list[Proc], tmp_path: Path
) -> None:
    """live_restore: the daemon is SIGKILLed while the real SGLang serves; the next life adopts
    the same server (no signal, no reload) and chat completions, asked one after another
    through the outage, all answer."""
    port = free_port()
    configs = {"tiny": sglang_config(sglang_env, port)}
    with shims_ended(tmp_path / "state", procs):
        d = real_daemon(configs, default="tiny", live_restore=True)
        wait_until(lambda: d.status()["state"] == "ready", STARTUP_S, "the real server")
        pid, log = d.status()["pid"], Path(d.status()["log_file"])
        answered: list[float] = []
        failed: list[str] = []
        halt = threading.Event()

        def chats() -> None:
            with httpx.Client(timeout=120, trust_env=False) as http:
                while not halt.is_set():
                    body = {
                        "model": "default",
                        "messages": [{"role": "user", "content": "Say hello."}],
                        "max_tokens": 8,
                    }
                    try:
                        res = http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                        res.raise_for_status()
                        answered.append(time.monotonic())
                    except httpx.HTTPError as exc:
                        failed.append(repr(exc))

        client = threading.Thread(target=chats, daemon=True)
        client.start()
        wait_until(lambda: len(answered) >= 2, 120, "chats answered")
        d.proc.signal(signal.SIGKILL)
        d.proc.wait(10)
        killed_at = time.monotonic()
        d = real_daemon(configs, default="tiny", live_restore=True)
        adopted = d.wait_event("server.adopted", timeout=60)
        wait_until(lambda: len([t for t in answered if t > killed_at]) >= 3, 120, "chats after")
        halt.set()
        client.join(130)
        assert failed == [] and adopted["pid"] == pid
        status = d.status()
        assert (status["state"], status["pid"], status["restarts"]) == ("ready", pid, 0)
        assert log.read_text().count("The server is fired up and ready to roll!") == 1
        d.http.post("/stop").raise_for_status()
        wait_until(lambda: d.status()["state"] == "stopped", 120, "the stop")
        assert not alive(pid)
