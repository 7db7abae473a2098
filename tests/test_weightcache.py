"""SGLang's weight cache daemon as a sidecar: its fingerprint and argv (pure), and a real daemon
running the stand-in's sidecar and engine on fake GPUs: the sidecar survives an engine SIGKILL
and a swap to a config of the same fingerprint (neither killed nor waited for), and a swap to
another model or a stop ends it, leaving no GPU memory of ours behind."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.daemon import weightcache
from gpuwarden.daemon.configs import ConfigError, ConfigStore
from gpuwarden.daemon.messages import TaskFailed
from gpuwarden.daemon.preflight import check_weight_cache
from gpuwarden.daemon.resolvedconfig import ResolvedConfig
from gpuwarden.daemon.states import ServerState
from gpuwarden.standin import fakegpu

from .support.configs import standin_config, write_configs
from .support.daemon import Daemon, start_daemon
from .support.machine import FAST, World
from .support.procs import Proc, free_port, wait_until
from .support.shim import shims_ended

pytestmark = pytest.mark.timeout(120)


def _load(tmp_path: Path, name: str, cfg: dict[str, Any]) -> ResolvedConfig:
    write_configs(tmp_path, {name: cfg})
    return ConfigStore(tmp_path / "configs").load(name)


def _cfg(model: str = "org/a", **args: Any) -> dict[str, Any]:
    return {
        "command": ["python3", "-m", "sglang.launch_server"],
        "weight_cache": True,
        "args": {"model-path": model, **args},
    }


def test_the_fingerprint_is_what_the_daemon_loads_and_where(tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    base = _load(tmp_path, "a", _cfg(**{"tp-size": 2, "dtype": "bfloat16"}))
    spec = weightcache.spec_of(base, "/venv/bin/python", env)
    assert spec is not None and spec.config == "a"
    assert spec.argv == (
        "/venv/bin/python",
        "-m",
        "sglang.srt.weight_cache.daemon",
        "--model-path",
        "org/a",
        "--dtype",
        "bfloat16",
        "--tp-size",
        "2",
    )
    assert base.argv[-2:] == ["--weight-cache-mode", "client"]  # the engine, in client mode
    # Other flags (a speculative or batch setting): the same sidecar.
    other_flags = _load(tmp_path, "b", _cfg(**{"tp-size": 2, "dtype": "bfloat16", "port": 9}))
    same = weightcache.spec_of(other_flags, "/venv/bin/python", env)
    assert same is not None and same.fingerprint == spec.fingerprint
    # Another model, layout, GPU set or interpreter: another.
    for cfg, py, e in (
        (_load(tmp_path, "c", _cfg("org/b", **{"tp-size": 2, "dtype": "bfloat16"})), None, env),
        (_load(tmp_path, "d", _cfg(**{"tp-size": 4, "dtype": "bfloat16"})), None, env),
        (base, None, {"CUDA_VISIBLE_DEVICES": "2,3"}),
        (base, "/other/python", env),
    ):
        other = weightcache.spec_of(cfg, py or "/venv/bin/python", e)
        assert other is not None and other.fingerprint != spec.fingerprint
    # `sglang serve MODEL`, and the stand-in's own daemon.
    served = _load(tmp_path, "e", {"command": ["sglang", "serve", "org/a"], "weight_cache": True})
    spec_e = weightcache.spec_of(served, "/venv/bin/python", {})
    assert spec_e is not None and spec_e.argv[3:] == ("--model-path", "org/a")
    stand = _load(tmp_path, "f", {**standin_config(), "weight_cache": True})
    spec_f = weightcache.spec_of(stand, "/venv/bin/python", {})
    assert spec_f is not None and spec_f.argv[2] == "gpuwarden.standin.weightcache"
    plain = _load(tmp_path, "g", {**_cfg(), "weight_cache": False})
    assert weightcache.spec_of(plain, "/venv/bin/python", {}) is None
    assert "--weight-cache-mode" not in plain.argv


def test_a_config_that_cannot_run_with_the_weight_cache_says_why(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--weight-cache-mode client"):
        _load(tmp_path, "a", _cfg(**{"weight-cache-mode": "daemon"}))
    spec = _load(tmp_path, "b", _cfg(**{"speculative-algorithm": "EAGLE3"}))
    (problem,) = check_weight_cache(spec)
    assert "speculative decoding" in problem
    assert check_weight_cache(_load(tmp_path, "c", _cfg())) == []


# -- a real daemon, the stand-in's sidecar and engine --------------------------------------------


@pytest.fixture
def sockets() -> Iterator[Path]:
    """A short folder for the sidecar's sockets (a Unix socket's path has at most 107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _wc(sockets: Path, model: str, port: int, **args: Any) -> dict[str, Any]:
    cfg = standin_config("--standin-load-shards=8", scale=0.05, port=port)
    cfg["args"].update({"model-path": model, **args})
    cfg["weight_cache"] = True
    cfg["env"].update(
        {
            "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE": str(sockets / "{device_uuid}.sock"),
            "SGLANG_WEIGHT_CACHE_READY_TEMPLATE": str(sockets / "{device_uuid}.ready"),
        }
    )
    return cfg


def _sidecar(d: Daemon) -> dict[str, Any] | None:
    wc: dict[str, Any] | None = d.status()["weight_cache"]
    return wc


def _holders(fake_gpu: Path) -> dict[int, int]:
    """pid -> MiB of the live holders of the fake GPUs."""
    return {h.pid: h.mib for h in fakegpu.read_holders(fake_gpu) if fakegpu.holder_alive(h)[0]}


def _serving(d: Daemon, name: str) -> bool:
    st = d.status()
    return st["config"] == name and st["state"] == "ready" and st["swap"] is None


def _ipc_loaded(d: Daemon) -> bool:
    log = Path(d.status()["log_file"]).read_text()
    return "Loaded model via IPC (mode=client)" in log


def test_the_sidecar_outlives_engine_crashes_and_same_fingerprint_swaps(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, sockets: Path
) -> None:
    port = free_port()
    configs = {
        "wc": _wc(sockets, "org/a", port),
        "wc2": _wc(sockets, "org/a", port, **{"max-running-requests": 8}),
        "other": _wc(sockets, "org/b", port),
        "plain": standin_config(port=port),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="wc")
    wait_until(lambda: _serving(d, "wc"), 60, "wc to serve")
    wc = _sidecar(d)
    assert wc is not None and wc["state"] == "ready" and wc["config"] == "wc"
    side = psutil.Process(wc["pid"])
    daemons = [c.pid for c in side.children(recursive=True)]
    assert daemons and all(p in _holders(fake_gpu) for p in daemons)  # its weights' memory
    assert _ipc_loaded(d)
    first_ready = d.status()["startup"]["phases"]["weights"]

    # The engine dies: the sidecar is neither killed nor waited for, and the relaunch maps it.
    mark = d.mark()
    os.kill(d.status()["pid"], signal.SIGKILL)
    d.wait_state("ready", after=mark, timeout=60)
    assert _sidecar(d) == wc and side.is_running()
    assert all(p in _holders(fake_gpu) for p in daemons)
    assert _ipc_loaded(d)
    assert d.status()["startup"]["phases"]["weights"] < 8 * 0.05  # no shard was read
    assert first_ready < 8 * 0.05

    # A swap to a config of the same fingerprint keeps it.
    d.http.post(
        "/restart", params={"config": "wc2", "wait": "true", "probation": "false"}, timeout=60
    )
    assert _serving(d, "wc2") and _sidecar(d)["pid"] == wc["pid"] and _ipc_loaded(d)

    # Another model's weights need its memory: it is stopped, the other's started.
    d.http.post(
        "/restart", params={"config": "other", "wait": "true", "probation": "false"}, timeout=60
    )
    assert _serving(d, "other")
    new = _sidecar(d)
    assert new is not None and new["pid"] != wc["pid"] and new["fingerprint"] != wc["fingerprint"]
    assert not side.is_running() and not any(p in _holders(fake_gpu) for p in daemons)
    stopped = d.wait_event("server.weight_cache_stopped", pid=wc["pid"])
    assert "needs its GPU memory" in stopped["reason"]

    # A config without it: stopped; nothing of it holds a GPU, no socket is left.
    d.http.post(
        "/restart", params={"config": "plain", "wait": "true", "probation": "false"}, timeout=60
    )
    assert _serving(d, "plain") and _sidecar(d) is None
    assert not psutil.pid_exists(new["pid"]) or psutil.Process(new["pid"]).status() == "zombie"
    assert list(sockets.iterdir()) == []
    engine = d.status()["pid"]
    assert set(_holders(fake_gpu)) <= {
        engine,
        *(c.pid for c in psutil.Process(engine).children(recursive=True)),
    }


def test_a_stop_ends_the_sidecar(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, sockets: Path
) -> None:
    d = start_daemon(
        procs, tmp_path, fake_gpu, {"wc": _wc(sockets, "org/m", free_port())}, default="wc"
    )
    wait_until(lambda: _serving(d, "wc"), 60, "wc to serve")
    wc = _sidecar(d)
    assert wc is not None
    d.http.post("/stop")
    d.wait_event("server.weight_cache_stopped", pid=wc["pid"], timeout=30)
    assert _sidecar(d) is None and d.status()["state"] == "stopped"
    assert _holders(fake_gpu) == {} and list(sockets.iterdir()) == []


def test_with_live_restore_the_next_life_keeps_the_sidecar_and_its_server(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, sockets: Path
) -> None:
    """The daemon SIGKILLed while its server maps the sidecar's weights: the next life adopts
    both (the sidecar from `weight-cache.json`), and a crash after that keeps it still."""
    configs = {"wc": _wc(sockets, "org/m", free_port())}
    with shims_ended(tmp_path / "state", procs):
        first = start_daemon(procs, tmp_path, fake_gpu, configs, default="wc", live_restore=True)
        wait_until(lambda: _serving(first, "wc"), 60, "wc to serve")
        wc = _sidecar(first)
        assert wc is not None
        server = first.status()["pid"]
        first.proc.signal(signal.SIGKILL)
        first.proc.popen.wait(10)
        second = start_daemon(procs, tmp_path, fake_gpu, configs, live_restore=True)
        adopted = second.wait_event("server.weight_cache_adopted", timeout=30)
        assert adopted["pid"] == wc["pid"]
        second.wait_event("server.adopted", timeout=30)
        assert second.status()["pid"] == server and _sidecar(second)["pid"] == wc["pid"]
        mark = second.mark()
        os.kill(server, signal.SIGKILL)  # the server crashes: relaunched on the same sidecar
        second.wait_state("ready", after=mark, timeout=60)
        assert _sidecar(second)["pid"] == wc["pid"] and _ipc_loaded(second)
        second.http.post("/stop")
        second.wait_event("server.weight_cache_stopped", pid=wc["pid"], timeout=30)
        assert not psutil.pid_exists(wc["pid"]) and list(sockets.iterdir()) == []


def test_without_live_restore_the_next_life_stops_the_previous_sidecar(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, sockets: Path
) -> None:
    """Nothing of a SIGKILLed daemon's life runs on without live restore: its server is
    stopped at the next boot, and so is its sidecar, found through its record."""
    configs = {"wc": _wc(sockets, "org/m", free_port())}
    first = start_daemon(procs, tmp_path, fake_gpu, configs, default="wc")
    wait_until(lambda: _serving(first, "wc"), 60, "wc to serve")
    wc = _sidecar(first)
    assert wc is not None
    first.proc.signal(signal.SIGKILL)
    first.proc.popen.wait(10)
    assert psutil.pid_exists(wc["pid"])  # its own session: the daemon's death left it
    second = start_daemon(procs, tmp_path, fake_gpu, configs)
    second.wait_event("server.weight_cache_adopted", pid=wc["pid"], timeout=30)
    stopped = second.wait_event("server.weight_cache_stopped", pid=wc["pid"], timeout=30)
    assert "live_restore is off" in stopped["reason"]
    wait_until(lambda: not psutil.pid_exists(wc["pid"]), 30, "the sidecar gone")


def test_a_sidecar_that_fails_to_start_leaves_the_server_to_load_from_disk(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, sockets: Path
) -> None:
    cfg = _wc(sockets, "org/m", free_port())
    cfg["env"]["SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"] = "/dev/null/wc/{device_uuid}.sock"
    d = start_daemon(procs, tmp_path, fake_gpu, {"wc": cfg}, default="wc")
    exited = d.wait_event("server.weight_cache_exited", timeout=60)
    assert exited["returncode"] != 0 and exited["detail"], exited
    wait_until(lambda: _serving(d, "wc"), 60, "wc to serve from disk")
    log = Path(d.status()["log_file"]).read_text()
    assert "falling back to disk load" in log and _sidecar(d) is None


def test_a_failed_watch_or_stop_of_the_sidecar_is_recorded_and_the_server_serves_on(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, **FAST)
    w.up()
    for task in ("weight_cache", "stop_weight_cache"):
        w.send(TaskFailed(task, w.launch.gen, "OSError: boom"))
        assert w.m.state == ServerState.READY and w.host.called("terminate") == []
    assert [e["task"] for e in w.host.events("internal_error")] == [
        "weight_cache",
        "stop_weight_cache",
    ]
