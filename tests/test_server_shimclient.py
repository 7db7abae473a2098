"""`ShimServer`, the second `ServerHandle`: a server the shim runs, watched from the daemon's
loop through `ShimClient`, against a real shim process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.daemon.server.shimclient import ShimClient, ShimError, ShimServer

from .support.shim import running_shim

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shim_dir(tmp_path: Path) -> Iterator[Path]:
    with running_shim(tmp_path / "shim"):
        yield tmp_path / "shim"


def spawn(client: ShimClient, tmp_path: Path, script: str, launch_id: str = "L1") -> ShimServer:
    return client.spawn(
        launch_id=launch_id,
        token="tok",
        path=sys.executable,
        argv=[sys.executable, "-c", script],
        env={},
        log=tmp_path / "logs" / f"{launch_id}.log",
        head="# header\n",
        max_bytes=None,
    )


async def test_a_server_under_the_shim_behind_the_handle(shim_dir: Path, tmp_path: Path) -> None:
    client = await ShimClient.connect(shim_dir)
    script = "import os, sys; print(os.environ['GPUWARDEN_LAUNCH_ID']); sys.exit(3)"
    server = spawn(client, tmp_path, script)
    await server.spawned
    assert server.pid > 0 and server.pgid == server.pid
    exited: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
    server.on_exit(exited.set_result)
    assert await exited == 3
    assert await server.wait_output_closed(10)
    log = tmp_path / "logs" / "L1.log"
    assert log.read_bytes() == b"# header\nL1\n"  # the launch's id in its environment
    out: list[bytes] = []
    await server.read_output(lambda data, fd: out.append(data))
    assert b"".join(out) == b"L1\n"  # what came before anyone read it was held for the reader
    server.release("exit: code 3")
    await client.request("list")  # answered after the release: the log is closed by now
    assert log.read_bytes().endswith(b"# exit: code 3\n")
    assert (await client.request("list"))["servers"] == []
    client.close()


async def test_a_later_client_attaches_and_signals_a_running_server(
    shim_dir: Path, tmp_path: Path
) -> None:
    first = await ShimClient.connect(shim_dir)
    script = "import time\nprint('up', flush=True)\nwhile True:\n    print('tick', flush=True); time.sleep(0.02)\n"
    server = spawn(first, tmp_path, script)
    await server.spawned
    first.close()  # a daemon's life ends; the server runs on
    second = await ShimClient.connect(shim_dir)
    taken = await second.attach("L1", tmp_path / "logs" / "L1.log")
    assert taken.pid == server.pid and not taken.exited.done()
    seen: asyncio.Queue[bytes] = asyncio.Queue()
    await taken.read_output(lambda data, fd: seen.put_nowait(data))
    got = b""
    while b"tick" not in got:  # its output reaches the new life as it is written
        got += await seen.get()
    assert taken.signal(signal.SIGTERM)
    assert await taken.exited == -signal.SIGTERM
    assert not taken.signal(signal.SIGTERM)  # exited: nothing to signal
    taken.close()
    second.close()


async def test_a_refused_spawn_and_a_lost_shim_end_the_waits(tmp_path: Path) -> None:
    with running_shim(tmp_path / "shim") as proc:
        client = await ShimClient.connect(tmp_path / "shim")
        bad = client.spawn(
            launch_id="L0",
            token="",
            path="/nonexistent/server",
            argv=["/nonexistent/server"],
            env={},
            log=tmp_path / "logs" / "L0.log",
            head="",
            max_bytes=None,
        )
        with pytest.raises(ShimError) as refused:
            await bad.spawned
        assert refused.value.reason == "exec_failed"
        server = spawn(client, tmp_path, "import time; time.sleep(600)")
        await server.spawned
        try:
            proc.kill()  # the shim is gone: nothing will come through it
            assert await client.lost
            assert await server.exited is None and server.output_closed
            with pytest.raises(ConnectionError):
                await client.request("list")
        finally:  # its server, orphaned now, is not the shim's to end any more
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
