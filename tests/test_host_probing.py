"""The host's probes with real sockets and a real server process: the probe loop posts
`ProbeFailed` where nobody listens and `ProbeSucceeded` where an HTTP server answers 200; the
listener check tells the launch's own listener from another program's."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from gpuwarden.daemon.clock import SystemClock
from gpuwarden.daemon.health import HttpProber
from gpuwarden.daemon.messages import ListenerChecked, Message, ProbeFailed, ProbeSucceeded
from gpuwarden.daemon.model import Launch
from gpuwarden.daemon.probing import Probes
from gpuwarden.daemon.server import local

from .support.host import launch_of, posted, tasks_posting
from .support.procs import PY, Proc, free_port

FAST = {"interval_s": 0.05, "timeout_s": 5}

# Listens on the port it is given, says so, and waits to be ended.
LISTENS = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(600)
"""


def probes(messages: list[Message]) -> Probes:
    return Probes(
        prober=HttpProber(),
        clock=SystemClock(),
        tasks=tasks_posting(messages),
        post=messages.append,
    )


@asynccontextmanager
async def answering_200() -> AsyncIterator[int]:
    """A tiny HTTP server in this process that answers every request 200; its port."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


def health_launch(root: Path, port: int, gen: int = 1) -> Launch:
    """A launch of a server that listens on `port`, probed there."""
    health = {**FAST, "url": f"http://127.0.0.1:{port}/health"}
    return launch_of(root, [PY, "-c", LISTENS, str(port)], gen, health=health)


async def test_liveness_probes_post_each_failure_where_nobody_listens(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = probes(messages)
    launch = health_launch(tmp_path, free_port())
    part.probe(launch, readiness=False)
    failed = await posted(messages, ProbeFailed, gen=launch.gen)
    assert "refused" in failed.detail.lower()
    part.tasks.end_tasks(launch)
    await part.close()


async def test_readiness_probes_post_success_once_a_server_answers(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = probes(messages)
    async with answering_200() as port:
        launch = health_launch(tmp_path, port)
        part.probe(launch, readiness=True)
        ok = await posted(messages, ProbeSucceeded, gen=launch.gen)
    assert "200" in ok.detail
    await part.close()


async def test_a_liveness_success_is_posted_only_after_failures(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = probes(messages)
    async with answering_200() as port:
        launch = health_launch(tmp_path, port)
        launch.probe_failures = 2  # the machine counted two failures in a row
        part.probe(launch, readiness=False)
        await posted(messages, ProbeSucceeded, gen=launch.gen)
        part.tasks.end_tasks(launch)
    assert not any(isinstance(m, ProbeFailed) for m in messages)
    await part.close()


async def test_the_listener_check_tells_the_launchs_listener_from_a_foreign_one(
    procs: list[Proc], tmp_path: Path
) -> None:
    messages: list[Message] = []
    part = probes(messages)
    launch = health_launch(tmp_path, free_port())
    listening = asyncio.Event()
    child = local.start(launch.config.argv, dict(os.environ), launch.launch_id, token=launch.token)
    launch.child = child
    try:
        await child.read_output(lambda data, fd: listening.set() if b"listening" in data else None)
        await asyncio.wait_for(listening.wait(), 20)
        part.check_listener(launch, "ready line")
        ours = await posted(messages, ListenerChecked, gen=launch.gen)
        assert ours.how == "ready line" and ours.check.ours is True
    finally:
        child.kill_group()
        child.close()
    async with answering_200() as port:
        other = health_launch(tmp_path, port, gen=2)
        other.child = child  # its tree is gone; the test's own process listens there
        part.check_listener(other, "probe")
        foreign = await posted(messages, ListenerChecked, gen=2)
    assert foreign.check.ours is False and foreign.check.holder == os.getpid()
    await part.close()
