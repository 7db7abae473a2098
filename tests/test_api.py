"""The control plane over real HTTP: swaps, rollback, concurrency, auth, input, metrics, CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from .support.configs import standin_config, two_configs
from .support.daemon import Daemon, start_daemon, until
from .support.procs import PY, Proc, wait_until


def test_swap_to_a_good_config_becomes_last_good(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs, tmp_path, fake_gpu, two_configs(), default="good", restart={"probation_s": 0.3}
    )
    d.wait_state("ready")
    res = d.http.post("/restart", params={"config": "other", "wait": "true"})
    assert res.status_code == 200
    body = res.json()
    assert body["outcome"] == "ready" and body["config"] == "other"
    assert body["state"] == "ready"  # the state when it answers, not when it accepted
    assert len(body["launch_ids"]) == 1
    d.wait_event("server.probation_passed")
    st = d.status()
    assert st["config"] == "other" and st["last_good_config"] == "other"
    assert st["swap"] is None and st["rolled_back_from"] is None


def test_swap_refused_by_preflight_never_touches_the_running_server(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    configs = two_configs(bad=standin_config("--speculative-eagle-top-k=4", "--tp=2"))
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="good")
    d.wait_state("ready")
    port = configs["good"]["args"]["port"]
    pid = d.status()["pid"]
    stop = threading.Event()
    codes: list[int] = []

    def hammer() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                codes.append(
                    c.post(
                        f"http://127.0.0.1:{port}/generate",
                        json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                    ).status_code
                )

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for wait in ("false", "true"):
            res = d.http.post("/restart", params={"config": "bad", "wait": wait})
            assert res.status_code == 422
            body = res.json()
            assert body["error"] == "preflight_refused"
            assert body["problems"] == [
                "sglang serve: error: unrecognized arguments: --speculative-eagle-top-k 4"
            ]
    finally:
        stop.set()
        thread.join(30)
    assert codes and set(codes) == {200}
    st = d.status()
    assert st["pid"] == pid and st["state"] == "ready" and st["config"] == "good"


def test_swap_whose_config_crashes_during_load_rolls_back_at_once(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    configs = two_configs(oom=standin_config("--standin-crash-on-load=cuda_oom"))
    d = start_daemon(
        procs, tmp_path, fake_gpu, configs, default="good", restart={"initial_delay_s": 30}
    )  # a backoff would show as a 30 s wait
    d.wait_state("ready")
    res = d.http.post("/restart", params={"config": "oom", "wait": "true"})
    body = res.json()
    assert res.status_code == 200
    assert body["outcome"] == "rolled_back"
    assert body["reason"] == "cuda_oom"
    assert "CUDA out of memory" in body["evidence"]
    assert len(body["launch_ids"]) == 2  # the failed one and the rollback
    rollback = d.wait_event("server.rollback")
    assert rollback["from_config"] == "oom" and rollback["to_config"] == "good"
    st = d.status()
    assert st["state"] == "ready" and st["config"] == "good"
    assert st["rolled_back_from"] == "oom"
    port = configs["good"]["args"]["port"]
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
    assert not [r for r in d.records() if r.get("to") == "backoff"]
    cli = subprocess.run(
        [PY, "-m", "gpuwarden.api.cli", "restart", "oom", "--wait", "--url", d.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 1  # a rollback is a failure for scripts
    assert "rolled_back" in cli.stderr


def test_crash_inside_probation_rolls_back(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    configs = two_configs(flaky=standin_config("--standin-crash-after=0.3"))
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        configs,
        default="good",
        restart={"probation_s": 30, "initial_delay_s": 30},
    )
    d.wait_state("ready")
    body = d.http.post(
        "/restart", params={"config": "flaky", "wait": "true", "probation": "false"}
    ).json()
    assert body["outcome"] == "ready"  # it came up ...
    rollback = d.wait_event("server.rollback")  # ... and crashed within probation_s
    assert rollback["from_config"] == "flaky" and rollback["reason"] == "crash"
    d.wait_state("ready", after=rollback["_index"])
    st = d.status()
    assert st["config"] == "good" and st["last_good_config"] == "good"


def test_swap_without_a_last_good_config_ends_failed(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    configs = two_configs(oom=standin_config("--standin-crash-on-load=cuda_oom"))
    d = start_daemon(procs, tmp_path, fake_gpu, configs)
    body = d.http.post("/restart", params={"config": "oom", "wait": "true"}).json()
    assert body["outcome"] == "failed" and body["reason"] == "cuda_oom"
    assert d.status()["state"] == "failed"


def test_stop_during_a_swap_wins(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    configs = two_configs(slow=standin_config(scale=1.0))
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="good")
    d.wait_state("ready")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(d.http.post, "/restart", params={"config": "slow", "wait": "true"})
        d.wait_event("server.launch", config="slow")
        assert d.http.post("/stop").status_code == 202
        body = waiting.result(30).json()
    assert body["outcome"] == "failed" and body["reason"] == "requested_stop"
    d.wait_state("stopped")
    assert d.status()["intent"]["running"] is False


def test_status_built_once_per_snapshot_shows_each_change_and_a_moving_uptime(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """`/status` is rendered once per snapshot and reused: the time fields still move, and a
    change (the server killed) shows in the first answer after the daemon records it."""
    d = start_daemon(procs, tmp_path, fake_gpu, {"good": standin_config()}, default="good")
    d.wait_state("ready")
    first = d.status()
    assert first["state"] == "ready" and first["uptime_s"] is not None
    until(lambda: d.status()["uptime_s"] > first["uptime_s"], 10, "uptime_s to move on")
    again = d.status()
    assert (again["launch_id"], again["pid"]) == (first["launch_id"], first["pid"])
    mark = d.mark()
    os.kill(first["pid"], signal.SIGKILL)
    d.wait_event("server.exit", after=mark, launch_id=first["launch_id"])
    st = d.status()  # at once: no waiting for the cached body to age out
    assert st["last_exit"]["launch_id"] == first["launch_id"]
    assert st["last_exit"]["signal"] == signal.SIGKILL
    assert st["pid"] != first["pid"]


def test_auth_names_and_methods(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    (tmp_path / "token").write_text("s3cret-token\n")
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs(), token_file="./token")
    assert d.http.get("/healthz").status_code == 200
    for method, path in (
        ("GET", "/status"),
        ("POST", "/restart"),
        ("GET", "/metrics"),
        ("GET", "/configs"),
    ):
        res = d.http.request(method, path)
        assert res.status_code == 401, path
        assert res.json()["error"] == "unauthorized"
    assert d.http.get("/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": "Bearer s3cret-token"}
    assert d.http.get("/status", headers=auth).status_code == 200
    res = d.http.post("/restart", params={"config": "../../etc/passwd"}, headers=auth)
    assert res.status_code == 400 and res.json()["error"] == "bad_request"
    assert d.http.post("/restart", params={"config": "nope"}, headers=auth).status_code == 404
    assert d.http.get("/configs/nope", headers=auth).status_code == 404
    res = d.http.get("/restart", params={"config": "good"}, headers=auth)
    assert res.status_code == 405
    assert res.json()["error"] == "method_not_allowed" and "use POST" in res.json()["detail"]
    res = d.http.get("/logs", params={"lines": "many"}, headers=auth)
    assert res.status_code == 400


def test_configs_view_check_events_and_metrics(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    configs = two_configs(
        secret=standin_config("--api-key=sk-very-secret", env={"HF_TOKEN": "hf_zzz"})
    )
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="good")
    d.wait_state("ready")
    assert d.http.get("/configs").json()["configs"] == ["good", "other", "secret"]
    view = d.http.get("/configs/secret").json()
    assert "sk-very-secret" not in str(view) and "hf_zzz" not in str(view)
    assert d.http.post("/configs/other/check").json()["ok"] is True
    bad = d.http.post("/configs/secret/check")
    assert bad.status_code == 200  # valid flags
    events = d.http.get("/events", params={"limit": 3}).json()["events"]
    assert len(events) == 3 and events[-1]["seq"] > events[0]["seq"]
    text = d.http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["gpuwarden_state"].samples
    ready = [s for s in families["gpuwarden_state"].samples if s.labels["state"] == "ready"]
    assert ready[0].value == 1.0
    assert "gpuwarden_gpu_memory_used_bytes" in families


def test_logs_previous_and_stream(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs(), default="good")
    d.wait_state("ready")
    first = d.status()["launch_id"]
    tail = d.http.get("/logs", params={"lines": 500}).json()
    assert tail["launch_id"] == first
    assert any("fired up and ready" in line for line in tail["lines"])
    d.http.post("/restart", params={"wait": "true", "probation": "false"})  # settled at ready
    prev = d.http.get("/logs", params={"launch": "previous", "lines": 5}).json()
    assert prev["launch_id"] == first and prev["lines"]
    with httpx.stream("GET", f"{d.url}/logs/stream", params={"history": 3}, timeout=10) as res:
        lines = []
        for raw in res.iter_lines():
            if raw.startswith("data: "):
                lines.append(raw[6:])
            if len(lines) == 3:
                break
    assert len(lines) == 3


def test_slow_stream_reader_does_not_grow_the_daemon(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    flood = standin_config("--standin-flood=300000", health={"interval_s": 600})
    d = start_daemon(procs, tmp_path, fake_gpu, {"flood": flood}, default="flood")
    rss0 = psutil.Process(d.proc.pid).memory_info().rss
    dropped = []
    with httpx.stream("GET", f"{d.url}/logs/stream", timeout=60) as res:
        lines = res.iter_lines()
        for raw in lines:  # a slow reader: one line, then nothing until the end
            if raw.startswith("data: "):
                break
        d.wait_event("server.state", to="ready")
        log_file = Path(d.status()["log_file"])

        wait_until(lambda: b"flood done" in log_file.read_bytes()[-200:], 60, "the flood")
        rss1 = psutil.Process(d.proc.pid).memory_info().rss
        for raw in lines:
            if raw.startswith("event: dropped"):
                dropped.append(raw)
                break
    assert dropped  # told, not buffered without bound
    assert rss1 - rss0 < 40 * 2**20, (rss0, rss1)


def test_each_cli_command_against_a_live_daemon(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d: Daemon = start_daemon(procs, tmp_path, fake_gpu, two_configs(), default="good")
    d.wait_state("ready")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PY, "-m", "gpuwarden.api.cli", *args, "--url", d.url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    res = cli("status")
    assert res.returncode == 0 and "ready" in res.stdout and "good" in res.stdout
    assert '"state": "ready"' in cli("status", "--json").stdout
    assert cli("configs").stdout.splitlines() == ["good  (current, last good)", "other"]
    assert cli("check", "other").returncode == 0
    assert "fired up and ready" in cli("logs", "-n", "200").stdout
    assert "server.state" not in cli("events").stderr and cli("events").returncode == 0
    res = cli("restart", "other", "--wait", "--no-probation")
    assert res.returncode == 0 and res.stdout.startswith("ready")
    mark = d.mark()
    assert cli("stop").returncode == 0
    d.wait_state("stopped", after=mark)
    mark = d.mark()
    assert cli("start", "good").returncode == 0
    # This start's ready, not the first one: the offline check below needs the port taken.
    d.wait_state("ready", after=mark)
    res = cli("start")
    assert res.returncode == 1 and "conflict" in res.stderr
    res = subprocess.run(
        [PY, "-m", "gpuwarden.api.cli", "status", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 1 and "cannot reach the daemon" in res.stderr

    def offline_check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                PY,
                "-m",
                "gpuwarden.api.cli",
                "check",
                "good",
                "--offline",
                "--settings",
                str(tmp_path / "settings.yaml"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    res = subprocess.run(
        [PY, "-m", "gpuwarden.api.cli", "restart", "--bogus"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 2
    res = offline_check()
    # Offline, nobody knows the port belongs to our own running server: a real problem.
    assert res.returncode == 1 and "address already in use" in res.stdout
    mark = d.mark()
    assert cli("stop").returncode == 0
    d.wait_state("stopped", after=mark)
    res = offline_check()
    assert res.returncode == 0, res.stdout + res.stderr


def test_date_header_stays_current(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    """uvicorn's tick runs once a second here: the Date header must still move with time."""
    from email.utils import parsedate_to_datetime  # noqa: PLC0415

    d = start_daemon(procs, tmp_path, fake_gpu, {})

    def date() -> float:
        return parsedate_to_datetime(d.http.get("/healthz").headers["date"]).timestamp()

    first = date()
    wait_until(lambda: date() > first, 5, "the Date header to move on")
    assert abs(date() - time.time()) <= 2


def test_a_swap_begun_during_probation_rolls_back_to_the_config_that_was_serving(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """good (last-good) -> other (ready, on probation) -> oom fails: back to other, not good."""
    configs = two_configs(oom=standin_config("--standin-crash-on-load=cuda_oom"))
    d = start_daemon(
        procs, tmp_path, fake_gpu, configs, default="good", restart={"probation_s": 600}
    )
    d.wait_state("ready")
    assert (
        d.http.post(
            "/restart", params={"config": "other", "wait": "true", "probation": "false"}
        ).json()["outcome"]
        == "ready"
    )
    assert d.status()["last_good_config"] == "good"  # still on probation
    body = d.http.post("/restart", params={"config": "oom", "wait": "true"}).json()
    assert body["outcome"] == "rolled_back" and body["state"] == "ready"
    rollback = d.wait_event("server.rollback")
    assert rollback["to_config"] == "other"
    st = d.status()
    assert st["config"] == "other" and st["last_good_config"] == "other"
