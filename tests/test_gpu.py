"""GPU awareness on the fake GPU: orphans of ours killed, foreign holders left alone, lost ranks,
NVML errors survived."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from gpuwarden.daemon.gpu import render_gpu_table
from gpuwarden.daemon.nvml import NvmlBackend
from gpuwarden.daemon.states import ServerState

from .support.configs import standin_config
from .support.daemon import start_daemon
from .support.procs import Proc, alive, wait_until
from .support.supervisor import running


def test_our_orphan_from_a_previous_life_is_killed_before_the_launch(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config("--standin-escape-grandchild=30000")
    d = start_daemon(procs, tmp_path, fake_gpu, {"esc": cfg}, default="esc")
    d.wait_state("ready")
    d.wait_event("server.ranks")
    log_file = Path(d.status()["log_file"])
    escapee = int(log_file.read_text().split("escapee pid=")[1].split()[0])
    state = tmp_path / "state" / "state.json"
    wait_until(
        lambda: escapee in [p[0] for p in json.loads(state.read_text()).get("known_processes", [])],
        10,
        "the escapee to be recorded as ours",
    )
    assert d.status()["gpus"][0]["processes"]
    d.proc.signal(signal.SIGKILL)  # the daemon dies; the server and its escapee live on
    d.proc.wait(10)
    assert alive(escapee)
    try:
        d2 = start_daemon(procs, tmp_path, fake_gpu, {"esc": standin_config()}, default=None)
        killed = d2.wait_event("server.gpu_orphans_killed")
        assert [k["pid"] for k in killed["killed"]] == [escapee]
        assert killed["killed"][0]["gpu"] == 0 and killed["killed"][0]["used_mib"] == 30000
        d2.wait_state("ready")
        assert not alive(escapee)
        assert d2.status()["last_sweep_killed"][0]["pid"] == escapee
    finally:
        if alive(escapee):
            import os  # noqa: PLC0415

            os.kill(escapee, signal.SIGKILL)


def test_silent_scheduler_death_is_a_lost_rank_and_a_restart(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config("--standin-version=0.5.5", "--standin-silent-death-after=1.5")
    d = start_daemon(procs, tmp_path, fake_gpu, {"zombie": cfg}, default="zombie")
    d.wait_state("ready")
    ranks = d.wait_event("server.ranks")
    assert ranks["gpus"] == [0]  # tp=1 on an 8-GPU host: only GPU 0 is watched
    ex = d.wait_event("server.exit", timeout=20)
    assert ex["reason"] == "rank_lost"
    assert ex["evidence"].startswith("GPU 0 no longer holds a process of this launch")
    d.wait_state("backoff", reason="rank_lost")
    d.wait_event("server.launch", after=ex["_index"])
    rank_lost = [
        r for r in d.records() if r.get("event") == "server.exit" and r.get("reason") == "rank_lost"
    ]
    assert len(rank_lost) == 1


def test_tp_2_watches_two_ranks_and_nothing_else(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config("--tp-size=2", env={"CUDA_VISIBLE_DEVICES": "5,2"})
    d = start_daemon(procs, tmp_path, fake_gpu, {"tp2": cfg}, default="tp2")
    d.wait_state("ready")
    assert d.wait_event("server.ranks")["gpus"] == [2, 5]
    st = d.status()
    table = render_gpu_table(st["gpus"])
    assert "(ours)" in table and table.splitlines()[0].split()[:3] == ["GPU", "used", "MiB"]


class _NvmlError(Exception):
    pass


class StubNvml:
    """A stand-in for the pynvml module: one GPU, then errors from the chosen call on."""

    NVMLError = _NvmlError

    def __init__(self) -> None:
        self.fail = False
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        if self.fail:
            raise _NvmlError("Unknown Error")
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return type("M", (), {"used": 615 * 2**20, "total": 143771 * 2**20})()

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return type("U", (), {"gpu": 7})()

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [type("P", (), {"pid": 1, "usedGpuMemory": 2**30})()]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return "GPU-1234"

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"  # (older pynvml answers bytes)


def test_an_nvml_error_keeps_the_last_snapshot_marked_stale() -> None:
    stub = StubNvml()
    backend = NvmlBackend(module=stub)
    good = backend.snapshot()
    assert good.error is None and good.gpus[0].used_mib == 615 and good.gpus[0].uuid == "GPU-1234"
    assert good.gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert good.gpus[0].processes[0].used_mib == 1024
    stub.fail = True
    stale = backend.snapshot()
    assert stale.error == "NVML: Unknown Error"
    assert stale.gpus == good.gpus and stale.taken_at == good.taken_at
    backend.close()
    assert stub.shut


async def test_the_supervisor_survives_nvml_errors(tmp_path: Path, fake_gpu: Path) -> None:
    stub = StubNvml()
    async with running(tmp_path, NvmlBackend(module=stub), {"c": standin_config()}) as sup:
        await sup.start("c")
        await sup.wait_for_state(ServerState.READY, timeout=20)
        stub.fail = True
        await sup.wait_for(lambda s: s.status()["gpu_error"] == "NVML: Unknown Error", 10)
        assert sup.machine.state == ServerState.READY
        assert sup.status()["gpus"][0]["uuid"] == "GPU-1234"
