"""`live_restore: true`: the servers run under the shim (`daemon/server/shim.py`), which writes
their logs and outlives the daemon; the supervisor watches them through `ShimServer`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.daemon.states import ServerState
from gpuwarden.daemon.supervisor import Supervisor

from .support.configs import standin_config
from .support.supervisor import running

pytestmark = pytest.mark.timeout(90)


def events(sup: Supervisor, kind: str) -> list[dict[str, Any]]:
    return sup.events.recent(1000, kind)


@contextlib.asynccontextmanager
async def live(
    tmp_path: Path, fake_gpu: Path, configs: dict[str, Any]
) -> AsyncIterator[Supervisor]:
    """A supervisor with `live_restore`; the shim it starts is ended after it."""
    shim_pid = 0
    try:
        async with running(tmp_path, fake_gpu, configs, settings={"live_restore": True}) as sup:
            await sup.wait_for(lambda s: bool(events(s, "shim_connected")), 20)
            shim_pid = events(sup, "shim_connected")[0]["pid"]
            yield sup
    finally:
        if shim_pid:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(shim_pid).children():
                    os.killpg(child.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(shim_pid, signal.SIGKILL)


async def test_the_server_runs_under_the_shim_and_is_supervised_as_ever(
    tmp_path: Path, fake_gpu: Path
) -> None:
    async with live(tmp_path, fake_gpu, {"k": standin_config()}) as sup:
        shim_pid = events(sup, "shim_connected")[0]["pid"]
        await sup.start("k")
        await sup.wait_for_state(ServerState.READY, timeout=30)
        launch = sup.machine.launch
        assert launch is not None and launch.child is not None
        first = launch.child.pid
        assert psutil.Process(first).ppid() == shim_pid  # the shim's child, not the daemon's
        log = Path(events(sup, "launch")[0]["log_file"])
        text = await asyncio.to_thread(log.read_text)
        assert text.startswith("# gpuwarden launch ") and "fired up and ready" in text
        os.kill(first, signal.SIGKILL)  # a crash: classified, swept, relaunched under the shim
        await sup.wait_for(lambda s: len(events(s, "exit")) >= 1, 30)
        exit_ = events(sup, "exit")[0]
        assert (exit_["reason"], exit_["signal"]) == ("signal", signal.SIGKILL)
        await sup.wait_for(lambda s: len(events(s, "launch")) >= 2, 30)
        await sup.wait_for_state(ServerState.READY, timeout=30)
        assert sup.machine.launch is not None and sup.machine.launch.child is not None
        second = sup.machine.launch.child.pid
        assert second != first and psutil.Process(second).ppid() == shim_pid
        closed = await asyncio.to_thread(log.read_text)
        assert closed.rstrip().splitlines()[-1].startswith("# exit: ")  # released, its trailer
        await sup.stop()
        await sup.wait_for_state(ServerState.STOPPED, timeout=30)
        assert not psutil.pid_exists(second) or psutil.Process(second).status() == "zombie"
