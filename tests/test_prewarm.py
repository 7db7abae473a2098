"""A swap's page-cache pre-warm: the machine's decisions (the old server serves on while the
next config's weights are read; a stop, an exit or a failed read end it), the reader on real
files (throttled, skipping what is cached, bounded by RAM, given up under pressure), which files
a config names, and a real daemon swapping stand-ins with a real memory hog beside it."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwarden.daemon import prewarm, weightfiles
from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.messages import BackoffElapsed, PrewarmEnded, TaskFailed
from gpuwarden.daemon.model import PrewarmProgress
from gpuwarden.daemon.resolvedconfig import ResolvedConfig
from gpuwarden.daemon.settings import PrewarmSettings
from gpuwarden.daemon.states import ServerState, SwapPhase

from .support.configs import standin_config, two_configs, write_configs
from .support.daemon import start_daemon
from .support.machine import FAST, World
from .support.procs import PY, Proc, wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1024 * 1024


def _weights_file(path: Path, mib: int) -> Path:
    """A file of `mib` MiB of random bytes, not in the page cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MiB))
    prewarm.evict(path)
    return path


def _resident(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        cache = prewarm.FileMap(fd, size)
        try:
            return sum(
                min(prewarm.CHUNK, size - off)
                for off in range(0, size, prewarm.CHUNK)
                if cache.resident(off, min(prewarm.CHUNK, size - off))
            )
        finally:
            cache.close()
    finally:
        os.close(fd)


# -- the machine's decisions ----------------------------------------------------------------------


def _prewarming(tmp_path: Path, **settings: Any) -> World:
    w = World(tmp_path, **{**FAST, **settings})
    w.up()
    w.restart("b", weights=(tmp_path / "w.safetensors",))
    return w


def test_a_swap_reads_the_weights_while_the_old_server_serves_then_stops_it(
    tmp_path: Path,
) -> None:
    w = _prewarming(tmp_path)
    assert w.swap.phase == SwapPhase.PREWARMING and w.m.state == ServerState.READY
    assert w.host.called("terminate") == []  # a still serves
    ((swap_id, files, progress),) = w.host.called("prewarm")
    assert swap_id == w.swap.id and files == (tmp_path / "w.safetensors",)
    assert w.swap.view()["prewarm"]["state"] == "reading"
    assert w.m.intent.config == "b"  # what is asked to run now
    with pytest.raises(Exception, match="under way \\(prewarming\\)"):
        w.restart("c")  # one swap at a time
    progress.read_bytes, progress.state = 5 * MiB, "done"
    w.send(PrewarmEnded(w.swap.id, "done", "read 0.01 GiB"))
    assert w.swap.phase == SwapPhase.STOPPING and w.m.state == ServerState.STOPPING
    assert len(w.host.called("terminate")) == 1
    (ended,) = w.host.events("prewarm_ended")
    assert ended["outcome"] == "done" and ended["read_bytes"] == 5 * MiB
    w.send(PrewarmEnded(w.swap.id, "done", "again"))  # a late duplicate changes nothing
    assert len(w.host.events("prewarm_ended")) == 1
    w.exits(0)
    w.relaunch()
    w.ready()
    assert w.launch.config.name == "b" and w.swap.outcome is not None
    assert w.swap.outcome["outcome"] == "ready"


@pytest.mark.parametrize(
    "case", ["no files", "disabled", "a restart", "not ready"], ids=lambda c: c.replace(" ", "-")
)
def test_no_prewarm_where_there_is_nothing_to_gain(tmp_path: Path, case: str) -> None:
    w = World(tmp_path, **FAST, **({"prewarm": {"enabled": False}} if case == "disabled" else {}))
    w.up()
    if case == "not ready":
        w.exits(1)  # a crashed: in backoff
    weights = () if case == "no files" else (tmp_path / "w.safetensors",)
    w.restart("a" if case == "a restart" else "b", weights=weights)
    assert w.host.called("prewarm") == []
    assert w.swap.phase in (SwapPhase.STOPPING, SwapPhase.WAITING_GPU)


def test_a_stop_while_it_reads_cancels_the_read_and_settles_the_swap(tmp_path: Path) -> None:
    w = _prewarming(tmp_path)
    w.stop()
    assert w.host.called("cancel_prewarm") and w.swap.phase == SwapPhase.DONE
    assert w.swap.outcome is not None and w.swap.outcome["reason"] == "requested_stop"
    w.exits(0)
    assert w.m.state == ServerState.STOPPED
    w.send(PrewarmEnded(w.swap.id, "done", "late"))  # nothing starts
    assert w.m.state == ServerState.STOPPED and not w.host.events("prewarm_ended")


def test_the_old_server_ending_first_starts_the_new_config_without_waiting(
    tmp_path: Path,
) -> None:
    w = _prewarming(tmp_path)
    w.exits(1)  # a crashes while b's weights are read: the retry is b's
    assert w.m.state == ServerState.BACKOFF and w.swap.phase == SwapPhase.PREWARMING
    w.send(BackoffElapsed(w.launch.gen, w.cfg("b")))
    assert w.swap.phase == SwapPhase.WAITING_GPU and w.launch.config.name == "b"
    assert w.host.called("cancel_prewarm")
    (ended,) = w.host.events("prewarm_ended")
    assert ended["outcome"] == "cancelled"
    w.send(PrewarmEnded(w.swap.id, "done", "late"))  # the read's own end, after: ignored
    assert w.swap.phase == SwapPhase.WAITING_GPU
    w.relaunch()
    w.ready()
    assert w.swap.outcome is not None and w.swap.outcome["outcome"] == "ready"


def test_a_failed_prewarm_task_lets_the_swap_go_on(tmp_path: Path) -> None:
    w = _prewarming(tmp_path)
    w.send(TaskFailed("prewarm", 0, "OSError: boom"))
    assert w.swap.phase == SwapPhase.STOPPING and w.m.state == ServerState.STOPPING
    (ended,) = w.host.events("prewarm_ended")
    assert ended["outcome"] == "failed" and "boom" in ended["detail"]


# -- the reader, on real files ---------------------------------------------------------------------


def _read(
    files: list[Path],
    memory: Any = prewarm.meminfo,
    held: prewarm.Held | None = None,
    **settings: Any,
) -> tuple[str, str, PrewarmProgress, float]:
    progress = PrewarmProgress()
    began = time.monotonic()
    outcome, detail = prewarm.read(
        files, progress, PrewarmSettings(**settings), threading.Event(), memory=memory, held=held
    )
    return outcome, detail, progress, time.monotonic() - began


def test_the_read_is_throttled_and_held_in_the_page_cache_until_released(
    tmp_path: Path,
) -> None:
    files = [_weights_file(tmp_path / f"m-{i}.safetensors", 24) for i in range(2)]
    assert all(_resident(f) == 0 for f in files)
    held = prewarm.Held()
    outcome, detail, progress, took = _read(files, held=held, max_read_mib_s=16)
    assert outcome == "done", detail
    assert progress.read_bytes == progress.total_bytes == 48 * MiB and progress.files == 2
    # At most 16 MiB/s: 48 MiB take at least 3 s (the first chunk's time is not waited for).
    assert took >= (48 - prewarm.CHUNK / MiB) / 16
    # Held (locked) in the page cache: the kernel may not reclaim it before the server reads it.
    assert progress.held_bytes == held.bytes == 48 * MiB
    assert all(_resident(f) == 24 * MiB for f in files)
    # Read again while held, it is all cached: nothing is read, nothing waits for the throttle.
    outcome, _, again, took = _read(files, max_read_mib_s=1)
    assert outcome == "done" and again.read_bytes == 0 and again.held_bytes == 0
    assert again.cached_bytes == 48 * MiB and took < 48 / 1
    assert held.release() == 48 * MiB and held.bytes == 0


def test_it_reads_no_more_than_leaves_the_ram_kept_free(tmp_path: Path) -> None:
    big = _weights_file(tmp_path / "m.safetensors", 64)
    total = 10 * 1024 * MiB
    reserve = int(0.2 * total)
    outcome, detail, progress, _ = _read([big], lambda: (total, reserve + 20 * MiB))
    assert outcome == "abandoned" and "less than 20% of RAM" in detail, detail
    assert 0 < progress.read_bytes <= 20 * MiB
    outcome, detail, progress, _ = _read([big], lambda: (total, reserve - 1))
    assert outcome == "abandoned" and detail.startswith("memory pressure"), detail
    assert progress.read_bytes == 0


def test_it_gives_up_when_memory_runs_short_as_it_reads(tmp_path: Path) -> None:
    big = _weights_file(tmp_path / "m.safetensors", 64)
    total, calls = 10 * 1024 * MiB, [0]

    def memory() -> tuple[int, int]:
        calls[0] += 1
        return total, (8 if calls[0] < 4 else 1) * 1024 * MiB  # another process took RAM

    outcome, detail, progress, _ = _read([big], memory)
    assert outcome == "abandoned" and detail.startswith("memory pressure"), detail
    assert 0 < progress.read_bytes < 64 * MiB


def test_a_cancel_ends_the_read_within_a_chunk(tmp_path: Path) -> None:
    big = _weights_file(tmp_path / "m.safetensors", 32)
    progress, cancel = PrewarmProgress(), threading.Event()
    result: list[tuple[str, str]] = []
    reader = threading.Thread(
        target=lambda: result.append(
            prewarm.read([big], progress, PrewarmSettings(max_read_mib_s=2), cancel)
        )
    )
    reader.start()
    wait_until(lambda: progress.read_bytes > 0, 10, "the first chunk")
    cancel.set()
    reader.join(10)
    assert result and result[0][0] == "cancelled" and progress.state == "cancelled"
    assert progress.read_bytes < 32 * MiB


def test_a_missing_file_fails_the_read_with_its_name(tmp_path: Path) -> None:
    outcome, detail, _, _ = _read([tmp_path / "gone.safetensors"])
    assert outcome == "failed" and "gone.safetensors" in detail


# -- which files a config names ------------------------------------------------------------------


def _cfg(tmp_path: Path, args: dict[str, Any], command: list[str] | None = None) -> ResolvedConfig:
    write_configs(tmp_path, {"x": {"command": command or ["python3"], "args": args}})
    return ConfigStore(tmp_path / "configs").load("x")


def test_the_files_are_those_sglang_would_load(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("a-1.safetensors", "a-2.safetensors", "stale.safetensors", "x.bin", "c.json"):
        (model / name).write_bytes(b"w")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"l0": "a-1.safetensors", "l1": "a-2.safetensors"}})
    )
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "pytorch_model.bin").write_bytes(b"w")
    (draft / "notes.txt").write_bytes(b"w")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"w")
    cfg = _cfg(tmp_path, {"model-path": str(model), "speculative-draft-model-path": str(draft)})
    assert weightfiles.weight_files(cfg, {}) == (
        model / "a-1.safetensors",
        model / "a-2.safetensors",
        draft / "pytorch_model.bin",
    )
    assert weightfiles.weight_files(_cfg(tmp_path, {"model-path": str(gguf)}), {}) == (gguf,)
    # `sglang serve MODEL`: the positional model.
    served = _cfg(tmp_path, {}, ["sglang", "serve", str(draft)])
    assert weightfiles.weight_files(served, {}) == (draft / "pytorch_model.bin",)
    # A hub id, from the hub cache the server's environment names; not cached: nothing.
    repo = tmp_path / "hf" / "hub" / "models--org--name"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"w")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    hub = _cfg(tmp_path, {"model-path": "org/name"})
    assert weightfiles.weight_files(hub, {"HF_HOME": str(tmp_path / "hf")}) == (
        snap / "model.safetensors",
    )
    assert weightfiles.weight_files(_cfg(tmp_path, {"model-path": "org/other"}), {}) == ()


# -- a real daemon, real stand-ins, real memory ----------------------------------------------------


def _hog(mib: int) -> str:
    """A process that takes `mib` MiB of RAM (touched) and holds it until killed."""
    return (
        "import sys, time\n"
        f"blocks = [bytearray({MiB}) for _ in range({mib})]\n"
        "for b in blocks:\n    b[::4096] = b'x' * len(b[::4096])\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )


def _swap_setup(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, mib: int, **prewarm_settings: Any
) -> tuple[Any, int, Path]:
    """A daemon serving `good`, whose swap to `big` pre-warms `mib` MiB of weights."""
    model = tmp_path / "model"
    _weights_file(model / "model-00001.safetensors", mib)
    configs = two_configs(big=standin_config())
    configs["big"]["args"]["model-path"] = str(model)
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="good", prewarm=prewarm_settings)
    d.wait_state("ready")
    return d, configs["good"]["args"]["port"], model


def _serves(d: Any, name: str) -> bool:
    st = d.status()
    return st["config"] == name and st["state"] == "ready" and st["swap"] is None


def test_a_swap_prewarms_while_the_old_server_serves(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d, port, _ = _swap_setup(procs, tmp_path, fake_gpu, 48, max_read_mib_s=12)
    d.http.post("/restart", params={"config": "big", "wait": "false"})

    def reading() -> bool:
        swap = d.status()["swap"]
        return bool(swap and swap["phase"] == "prewarming" and swap["prewarm"]["read_bytes"])

    wait_until(reading, 30, "the pre-warm to read")
    st = d.status()
    assert st["state"] == "ready" and st["config"] == "good"  # the old server serves on
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    assert st["swap"]["prewarm"]["total_bytes"] == 48 * MiB
    argv = [PY, "-m", "gpuwarden.api.cli", "status", "--url", d.url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout
    assert "(prewarming)" in out and "MiB/48 MiB read" in out, out
    ended = d.wait_event("server.prewarm_ended", timeout=30)
    assert ended["outcome"] == "done" and ended["read_bytes"] == 48 * MiB, ended
    assert ended["held_bytes"] == 48 * MiB  # held in the page cache for big to read
    wait_until(lambda: _serves(d, "big"), 30, "big to serve")
    released = d.wait_event("server.prewarm_released", timeout=30)
    assert released["reason"] == "the swap settled" and released["held_bytes"] == 48 * MiB


def test_under_real_memory_pressure_the_prewarm_gives_up_and_the_swap_goes_on(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    total, available = prewarm.meminfo()
    fraction = (available - 1024 * MiB) / total  # 1 GiB over what is kept free
    d, _, _ = _swap_setup(
        procs, tmp_path, fake_gpu, 48, max_read_mib_s=4, keep_free_ram_fraction=round(fraction, 4)
    )
    d.http.post("/restart", params={"config": "big", "wait": "false"})
    d.wait_event("server.prewarm_began", timeout=30)
    hog = Proc([PY, "-c", _hog(2048)])  # another process takes 2 GiB as it reads
    procs.append(hog)
    hog.wait_for("held", timeout=60)
    ended = d.wait_event("server.prewarm_ended", timeout=30)
    assert ended["outcome"] == "abandoned" and "memory pressure" in ended["detail"], ended
    assert ended["read_bytes"] < 48 * MiB
    wait_until(lambda: _serves(d, "big"), 30, "big to serve")
