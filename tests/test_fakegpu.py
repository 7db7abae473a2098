"""The fake GPU's format and rules: liveness by (pid, create_time), zombies, release lag."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from gpuwarden.standin import fakegpu

from .support.gpu import start_holder
from .support.procs import PY, Proc


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hold_is_counted_until_killed(procs: list[Proc], fake_gpu: Path) -> None:
    holder = start_holder(procs, fake_gpu, 2, 40000)
    reader = fakegpu.FakeGpuReader(fake_gpu)
    usage = reader.usage()
    assert usage[2].used_mib == 40000
    assert [h.pid for h in usage[2].holders] == [holder.pid]
    assert usage[2].uuid == "GPU-fake-2"
    assert all(g.used_mib == 0 for g in usage if g.index != 2)
    holder.signal(signal.SIGTERM)
    assert holder.wait(5) == 0
    assert reader.usage()[2].used_mib == 0
    assert not list((fake_gpu / "holders").iterdir())


def test_dead_holder_counts_for_release_lag_then_is_pruned(
    procs: list[Proc], fake_gpu: Path
) -> None:
    fakegpu.init_dir(fake_gpu, count=2, release_lag_s=5)
    holder = start_holder(procs, fake_gpu, 1, 1000)
    clock = FakeClock()
    reader = fakegpu.FakeGpuReader(fake_gpu, clock=clock)
    holder.signal(signal.SIGKILL)  # no clean-up: the file stays
    holder.wait(5)
    assert reader.usage()[1].used_mib == 1000  # first seen dead now
    clock.now += 4.9
    assert reader.usage()[1].used_mib == 1000
    clock.now += 0.2
    assert reader.usage()[1].used_mib == 0
    assert not (fake_gpu / "holders" / f"{holder.pid}.json").exists()


def test_a_zombie_holder_is_dead() -> None:
    child = subprocess.Popen([PY, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    holder = fakegpu.Holder(child.pid, fakegpu.process_create_time(child.pid), 0, 1)
    assert fakegpu.holder_alive(holder)[0]
    assert child.stdin is not None
    child.stdin.close()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not fakegpu.holder_alive(holder)[0]
    child.wait()


def test_a_reused_pid_is_not_the_holder(fake_gpu: Path) -> None:
    holder = fakegpu.write_holder(fake_gpu, 0, 500)
    data = json.loads((fake_gpu / "holders" / f"{holder.pid}.json").read_text())
    data["create_time"] -= 1000  # same pid, another process
    (fake_gpu / "holders" / f"{holder.pid}.json").write_text(json.dumps(data))
    assert fakegpu.FakeGpuReader(fake_gpu).usage()[0].used_mib == 0


def test_uuids_and_cuda_visible_devices(fake_gpu: Path) -> None:
    fakegpu.init_dir(fake_gpu, count=4, uuids=["GPU-a", "GPU-b", "GPU-c", "GPU-d"])
    spec = fakegpu.read_spec(fake_gpu)
    assert fakegpu.gpu_for_rank(spec, 1, "GPU-d,GPU-c") == 2
    assert fakegpu.gpu_for_rank(spec, 0, "3") == 3
    assert fakegpu.gpu_for_rank(spec, 2, None) == 2
    with pytest.raises(fakegpu.FakeGpuError, match="unknown GPU 'GPU-z'"):
        fakegpu.gpu_for_rank(spec, 0, "GPU-z")


def test_malformed_files_are_clear_errors_or_skipped(fake_gpu: Path) -> None:
    (fake_gpu / "holders" / "99.json").write_text("{not json")
    assert fakegpu.FakeGpuReader(fake_gpu).usage()[0].used_mib == 0
    (fake_gpu / "gpus.json").write_text('{"count": "eight"}')
    with pytest.raises(fakegpu.FakeGpuError, match=r"gpus\.json"):
        fakegpu.read_spec(fake_gpu)


def test_hold_cli_rejects_a_gpu_the_host_lacks(fake_gpu: Path) -> None:
    res = subprocess.run(
        [
            PY,
            "-m",
            "gpuwarden.api.cli",
            "fake-gpu",
            "hold",
            "--gpu",
            "9",
            "--mib",
            "1",
            "--dir",
            str(fake_gpu),
        ],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert res.returncode == 2
    assert "the fake host has GPUs 0..7" in res.stderr
