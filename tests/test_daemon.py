"""The daemon as a real process supervising the real stand-in."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil

from .support.configs import standin_config, write_setup
from .support.daemon import serve, start_daemon
from .support.procs import PY, Proc, alive, free_port, group_members, wait_until


def test_boot_starts_the_default_config_and_status_shows_it(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"base": standin_config()}, default="base")
    ready = d.wait_state("ready")
    assert ready["via"] in ("ready line",) or ready["via"].startswith("GET ")
    st = d.status()
    assert st["state"] == "ready"
    assert st["config"] == "base"
    assert st["pid"] and alive(st["pid"])
    assert st["launch_id"].count("-") == 1 and st["launch_id"][8] == "T"
    log_file = Path(st["log_file"])
    assert log_file.parent == tmp_path / "logs" / "base"
    head = log_file.read_text().splitlines()[:4]
    assert head[0].startswith("# gpuwarden launch ")
    assert head[2].startswith("# argv: ")
    # GPU snapshots are samples (refreshed at ready, then every second).
    wait_until(lambda: d.status()["gpus"][0]["processes"], 5, "the GPU sample to show the holder")
    assert d.status()["gpus"][0]["processes"][0]["ours"] is True
    assert d.http.get("/healthz").json() == {"ok": True, "booting": False}


def test_crash_during_load_backs_off_and_relaunches(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config("--standin-crash-on-load=cuda_oom")
    d = start_daemon(procs, tmp_path, fake_gpu, {"oom": cfg}, default="oom")
    exit1 = d.wait_event("server.exit", reason="cuda_oom")
    assert "CUDA out of memory" in exit1["evidence"]
    backoff = d.wait_state("backoff", reason="cuda_oom")
    assert backoff["delay_s"] == 0.05
    second = d.wait_event("server.launch", after=backoff["_index"])
    assert second["launch_id"] != exit1["launch_id"]
    loop = d.wait_event("server.crash_loop", timeout=30)  # the third failure in a row
    # The operator's levels: the crash is an error, the retry and the crash loop warnings.
    assert (exit1["level"], backoff["level"], loop["level"]) == ("error", "warning", "warning")
    assert second["level"] == "info"


def test_unknown_flag_is_refused_by_preflight_at_boot(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"bad": standin_config("--speculative-eagle-top-k=4")},
        default="bad",
    )
    d.wait_state("failed", reason="preflight_refused")
    st = d.status()
    assert st["last_exit"]["reason"] == "preflight_refused"
    assert st["last_exit"]["evidence"] == (
        "sglang serve: error: unrecognized arguments: --speculative-eagle-top-k 4"
    )
    assert not [r for r in d.records() if r.get("event") == "server.launch"]


def test_unknown_flag_without_preflight_fails_at_once_with_the_argparse_line(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config("--speculative-eagle-top-k=4", preflight={"argv": False})
    d = start_daemon(procs, tmp_path, fake_gpu, {"bad": cfg}, default="bad")
    failed = d.wait_state("failed", reason="config_error")
    st = d.status()
    assert st["state"] == "failed"
    assert st["last_exit"]["reason"] == "config_error"
    assert st["last_exit"]["code"] == 2
    assert st["last_exit"]["evidence"].endswith(
        "error: unrecognized arguments: --speculative-eagle-top-k 4"
    )
    launches = [r for r in d.records() if r.get("event") == "server.launch"]
    assert len(launches) == 1  # not retried blindly
    assert not [r for r in d.records()[failed["_index"] :] if r.get("event") == "server.launch"]


def test_hang_goes_unhealthy_and_is_restarted(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config(
        "--standin-hang-after=0",
        scale=0.02,
        health={"interval_s": 0.1, "timeout_s": 0.3, "failures": 2},
    )
    d = start_daemon(procs, tmp_path, fake_gpu, {"hang": cfg}, default="hang")
    d.wait_state("ready")
    d.wait_state("unhealthy")
    ex = d.wait_event("server.exit", reason="liveness_failed")
    assert "2 consecutive failed probes" in ex["evidence"]
    d.wait_state("backoff", reason="liveness_failed")
    d.wait_event("server.launch", after=ex["_index"])


def test_term_ignoring_server_is_killed_after_grace(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"stubborn": standin_config("--standin-ignore-sigterm")},
        default="stubborn",
        stop={"grace_s": 0.5},
    )
    d.wait_state("ready")
    pid = d.status()["pid"]
    assert d.http.post("/stop").status_code == 202
    d.wait_event("server.stop_escalated")
    ex = d.wait_event("server.exit")
    assert ex["reason"] == "requested_stop" and ex["signal"] == signal.SIGKILL
    d.wait_state("stopped")
    assert not alive(pid)
    assert not group_members(pid)


def test_escaping_grandchild_is_found_and_killed_by_the_sweep(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"esc": standin_config("--standin-escape-grandchild=1000", "--standin-crash-after=0.2")},
        default="esc",
    )
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])
    wait_until(lambda: "escapee pid=" in log_file.read_text(), 5, "the escapee line in the log")
    escapee = int(log_file.read_text().split("escapee pid=")[1].split()[0])
    assert alive(escapee)
    # The exit is seen while the escapee still holds the server's stderr pipe ...
    ex = d.wait_event("server.exit", reason="crash")
    sweep = d.wait_event("server.sweep", after=0)
    # ... and the sweep that follows finds it (setsid, double-forked, reparented) and kills it.
    assert escapee in [k["pid"] for k in sweep["killed"]]
    assert sweep["_index"] > ex["_index"] - 5
    wait_until(lambda: not alive(escapee), 5, "the escapee to die")
    assert d.status()["last_sweep_killed"]


# A server that leaves a short-lived orphan: an intermediate forks it and exits at once, so it
# reparents to the daemon (a subreaper), prints its pid and exits a moment later.
ORPHANING = """
import os, sys, time
if os.fork() == 0:
    if os.fork() == 0:
        time.sleep(1.0)
        os._exit(0)
    os._exit(0)
os.wait()
print("ready: orphan left", flush=True)
time.sleep(3600)
"""


def test_an_orphan_that_exits_is_reaped_while_the_server_runs(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = {
        "command": [PY, "-c", ORPHANING],
        "preflight": {"argv": False},
        "health": {"url": "http://127.0.0.1:9/health", "startup_timeout_s": 600, "interval_s": 600},
    }
    d = start_daemon(procs, tmp_path, fake_gpu, {"orph": cfg}, default="orph")
    daemon = psutil.Process(d.proc.popen.pid)

    def zombies() -> list[int]:
        return [c.pid for c in daemon.children() if c.status() == psutil.STATUS_ZOMBIE]

    log_file = Path(d.wait_event("server.launch")["log_file"])
    wait_until(lambda: "orphan left" in log_file.read_text(), 10, "the server's line")
    shim = d.wait_event("server.shim_connected")["pid"]  # the server's parent, the daemon's child
    orphan: list[int] = []

    def orphan_seen_or_gone() -> bool:
        # The orphan is the daemon's child that is neither the shim nor gone yet (the shim is
        # no subreaper: its servers' orphans go to the daemon, the nearest one above it).
        kids = [c.pid for c in daemon.children() if c.pid not in (shim, d.status()["pid"])]
        orphan.extend(k for k in kids if k not in orphan)
        return bool(orphan)

    wait_until(orphan_seen_or_gone, 10, "the orphan to reparent to the daemon")
    # It exits 1 s after its birth; the daemon reaps it (no zombie of it stays).
    wait_until(lambda: not any(p in zombies() for p in orphan), 10, "the orphan to be reaped")
    wait_until(lambda: not psutil.pid_exists(orphan[0]), 10, "the orphan's pid to be gone")
    assert d.status()["state"] == "starting"  # the server itself was never touched


def test_daemon_sigterm_leaves_nothing_and_exits_0(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs, tmp_path, fake_gpu, {"base": standin_config("--tp-size=2")}, default="base"
    )
    d.wait_state("ready")
    server = d.status()["pid"]
    tree = [server, *(c.pid for c in psutil.Process(server).children(recursive=True))]
    d.proc.signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    assert not [p for p in tree if alive(p)]
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["intent"] == {"config": "base", "running": True}  # kept for the next start
    assert state["current_launch"] is None


def test_busy_port_for_the_daemon_exits_1_naming_it(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    import socket  # noqa: PLC0415

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = write_setup(tmp_path, {}, None)
        proc = serve(procs, path, fake_gpu, "--listen", f"127.0.0.1:{port}")
        assert proc.wait(20) == 1
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.text("stderr")


def test_env_null_removes_the_variable_from_the_server_even_from_the_daemon_env(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    base = standin_config(env={"GW_FROM_PARENT": "parent-value", "GW_KEPT": "kept"})
    child = {"extends": "base", "env": {"GW_FROM_PARENT": None, "GW_FROM_DAEMON": None}}
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"base": base, "child": child},
        default="child",
        env={"GW_FROM_DAEMON": "daemon-value", "GW_FROM_PARENT": "daemon-too"},
    )
    d.wait_state("ready")
    pid = d.status()["pid"]
    environ = psutil.Process(pid).environ()
    assert environ["GW_KEPT"] == "kept"
    assert "GW_FROM_PARENT" not in environ and "GW_FROM_DAEMON" not in environ
    header = Path(d.status()["log_file"]).read_text().splitlines()
    assert any("unset: " in line and "GW_FROM_DAEMON" in line for line in header[:5])


def _health_probes_answered(log_file: str) -> int:
    """The server's own access lines for `GET /health` answered 200: probes that reached it."""
    text = Path(log_file).read_text(errors="replace")
    return text.count('"GET /health HTTP/1.1" 200')


def test_a_port_given_in_command_or_as_a_flag_key_or_abbreviated_is_the_one_probed(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Before: only `args: {port: N}` was read; every other spelling the server's parser
    accepts left the daemon probing 30000, so a healthy server went `unhealthy` and was killed
    over and over (and a swap between two of them was refused: port held)."""
    port, elsewhere = free_port(), free_port()

    def spelled(command_tail: list[str], args: dict[str, object]) -> dict[str, object]:
        cfg = standin_config(port=port)
        del cfg["args"]["port"]
        cfg["command"] = [*cfg["command"], *command_tail]
        cfg["args"].update(args)
        return cfg

    configs = {
        "in_command": spelled(["--port", str(port)], {}),
        "flag_key": spelled([], {"--port": port}),
        # The last occurrence wins, `=` and an unambiguous prefix included, as argparse reads it.
        "abbreviated": spelled([f"--port={elsewhere}", "--po", str(port)], {}),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="in_command")
    d.wait_state("ready")
    for name in configs:
        mark = d.mark()
        if name != "in_command":
            res = d.http.post(
                "/restart", params={"config": name, "wait": "true", "probation": "false"}
            )
            assert res.status_code == 200, res.text  # the old server's port is the new one's
            assert res.json()["outcome"] == "ready", res.json()
        view = d.http.get(f"/configs/{name}").json()
        assert view["health_url"] == f"http://127.0.0.1:{port}/health", view
        st = d.status()
        assert (st["state"], st["config"]) == ("ready", name)
        # Liveness probes reach the server itself: three answered after ready, none failed.
        seen = _health_probes_answered(st["log_file"])
        wait_until(
            lambda st=st, seen=seen: _health_probes_answered(st["log_file"]) >= seen + 3,
            15,
            f"three liveness probes of {name} answered by the server on port {port}",
        )
        after = d.status()
        assert (after["state"], after["launch_id"]) == ("ready", st["launch_id"]), after
        records = d.proc.lines[0 if name == "in_command" else mark :]
        for unwanted in ("server.probe_failed", "server.listener_unchecked"):
            assert not [line for _, line in records if f'"event": "{unwanted}"' in line], unwanted
