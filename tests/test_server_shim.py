"""The shim (`daemon/server/shim.py`) as a real process, spoken to over its socket: it runs
servers, writes their logs itself, records their exits, takes signals, outlives its clients
and never waits for one that does not read."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.daemon.server import shimwire

from .support.shim import running_shim

pytestmark = pytest.mark.timeout(60)


class Client:
    """A blocking client of the shim: requests and the frames that come between."""

    def __init__(self, folder: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(folder / "shim.sock"))
        self.reader = shimwire.Reader()
        self.frames: list[tuple[int, Any]] = []
        self.req = 0

    def next_frame(self) -> tuple[int, Any]:
        while not self.frames:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("the shim closed the connection")
            self.frames += self.reader.feed(data)
        return self.frames.pop(0)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        self.req += 1
        self.sock.sendall(shimwire.json_frame({"op": op, "req": self.req, **fields}))
        kept: list[tuple[int, Any]] = []
        while True:
            kind, body = self.next_frame()
            if kind == shimwire.JSON and body.get("req") == self.req:
                self.frames = kept + self.frames
                return body
            kept.append((kind, body))

    def until_event(self, event: str) -> tuple[dict[str, Any], bytes]:
        """The notice `event`, and the output that came before it."""
        output = b""
        while True:
            kind, body = self.next_frame()
            if kind == shimwire.OUTPUT:
                output += body[2]
            elif body.get("event") == event:
                return body, output

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def shim(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "shim"
    with running_shim(folder):
        yield folder


def _spawn(client: Client, tmp_path: Path, script: str, launch_id: str = "L1") -> dict[str, Any]:
    return client.request(
        "spawn",
        launch_id=launch_id,
        token="tok",
        argv=[sys.executable, "-c", script],
        env={"PATH": os.environ.get("PATH", "")},
        log=str(tmp_path / "logs" / f"{launch_id}.log"),
        head="# header\n",
        max_bytes=None,
    )


def test_a_server_runs_its_output_is_logged_and_its_exit_recorded(
    shim: Path, tmp_path: Path
) -> None:
    client = Client(shim)
    assert client.request("hello")["version"] == list(shimwire.VERSION)
    script = "import sys; print('out line'); print('err line', file=sys.stderr); sys.exit(3)"
    reply = _spawn(client, tmp_path, script)
    assert reply["pid"] > 0
    exit_, output = client.until_event("exit")
    assert exit_["returncode"] == 3 and exit_["launch_id"] == "L1"
    if not exit_["closed"]:
        client.until_event("closed")
    log = (tmp_path / "logs" / "L1.log").read_bytes()
    assert log.startswith(b"# header\n") and b"out line\n" in log and b"err line\n" in log
    assert b"out line" in output or b"out line" in log  # handed on as written
    client.request("list")  # answered after the turn that told of the exit wrote its record
    record = json.loads((shim / "L1.exit").read_text())
    assert record["returncode"] == 3 and record["exited_at"] and record["pid"] == reply["pid"]
    assert stat.S_IMODE((shim / "shim.sock").stat().st_mode) == 0o600
    assert client.request("release", launch_id="L1", trailer="exit: code 3") == {
        "req": client.req,
        "ok": True,
    }
    assert (tmp_path / "logs" / "L1.log").read_bytes().endswith(b"# exit: code 3\n")
    assert not (shim / "L1.exit").exists() and client.request("list")["servers"] == []


def test_a_server_outlives_its_client_and_a_later_client_takes_it_over(
    shim: Path, tmp_path: Path
) -> None:
    first = Client(shim)
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "print('up', flush=True)\n"
        "for i in range(10**6):\n"
        "    print('tick', i, flush=True); time.sleep(0.01)\n"
    )
    pid = _spawn(first, tmp_path, script)["pid"]
    first.close()  # the daemon is gone: the server goes on, its output into its log
    second = Client(shim)
    [listed] = second.request("list")["servers"]
    assert (listed["pid"], listed["running"], listed["token"]) == (pid, True, "tok")
    attached = second.request("attach", launch_id="L1")
    assert attached["running"] and attached["size"] > 0
    seen = b""
    while b"tick" not in seen:  # its output reaches the new client as it is written
        kind, body = second.next_frame()
        assert kind == shimwire.OUTPUT and body[0] == "L1"
        seen += body[2]
    assert second.request("signal", launch_id="L1", sig=int(signal.SIGTERM), group=False)["ok"]
    exit_, _ = second.until_event("exit")
    assert exit_["returncode"] == 0 and not exit_["running"]


def test_a_client_that_does_not_read_never_stalls_the_server(shim: Path, tmp_path: Path) -> None:
    client = Client(shim)
    lines = 400_000  # about 24 MB: more than the shim keeps for a client, and the socket
    script = (
        f"import sys\nfor i in range({lines}):\n    sys.stdout.write('x' * 50 + ' %d\\n' % i)\n"
        "sys.stdout.write('the end of the flood\\n')\n"
    )
    _spawn(client, tmp_path, script)
    # Nothing is read until the server is done: its exit is recorded all the same.
    watcher = Client(shim)
    watcher.request("attach", launch_id="L1")
    body, _ = watcher.until_event("exit")
    assert body["returncode"] == 0
    log = (tmp_path / "logs" / "L1.log").read_bytes()
    assert log.count(b"\n") == lines + 2  # every line, and the header
    # The client that did not read gets what fitted, then a word on what did not, then the
    # newest of what was held back: the flood's end, in order, without a gap inside it.
    dropped, before = client.until_event("dropped")
    assert dropped["launch_id"] == "L1" and dropped["bytes"] > 0
    assert len(before) + dropped["bytes"] < len(log)  # it was not all dropped: the end comes
    _, after = client.until_event("exit")
    assert after.endswith(b" %d\nthe end of the flood\n" % (lines - 1))
    numbers = [int(line.split()[1]) for line in after.splitlines()[1:-1]]
    assert numbers == list(range(numbers[0], lines))  # the newest, whole and consecutive
    assert len(after) >= 256 * 1024  # (at least 256 KiB of it, in whole chunks)


def test_release_ends_a_running_server_and_bad_requests_leave_the_shim_serving(
    shim: Path, tmp_path: Path
) -> None:
    client = Client(shim)
    pid = _spawn(client, tmp_path, "import time; time.sleep(600)")["pid"]
    assert "error" in client.request("nonsense")
    assert "error" in client.request("signal", launch_id="nope", sig=15)
    assert "error" in _spawn(client, tmp_path, "pass")  # the same launch id twice
    assert (
        client.request(
            "spawn",
            launch_id="L2",
            argv=["/nonexistent/x"],
            env={},
            log=str(tmp_path / "logs" / "L2.log"),
        )["error"]
        == "exec_failed"
    )
    broken = Client(shim)
    broken.sock.sendall(b"\xff\xff\xff\xff\x00garbage")  # a frame too large: that client goes
    with pytest.raises(EOFError):
        broken.next_frame()
    gone = os.pidfd_open(pid)  # the server is the shim's child: its exit is watched so
    try:
        client.request("release", launch_id="L1", trailer="released")
        assert select.select([gone], [], [], 30)[0] == [gone]  # killed by the release
    finally:
        os.close(gone)
    assert (tmp_path / "logs" / "L1.log").read_bytes().endswith(b"# released\n")


def test_hostile_requests_are_refused_and_cost_the_shim_nothing(shim: Path, tmp_path: Path) -> None:
    client = Client(shim)
    shim_pid = client.request("hello")["pid"]
    base = dict(token="t", argv=[sys.executable, "-c", "pass"], env={}, head="")
    for bad in (
        {"launch_id": "../escape", "log": str(tmp_path / "a.log")},  # out of its folder
        {"launch_id": "x" * 70_000, "log": str(tmp_path / "b.log")},
        {"launch_id": "ok", "log": str(tmp_path / "c.log"), "max_bytes": "100"},
        {"launch_id": "ok", "log": str(tmp_path / "d.log"), "env": {"A=B": "1"}},
        {"launch_id": "ok", "log": "nul\0path"},
        {"launch_id": "ok", "log": str(tmp_path / "e.log"), "argv": []},
    ):
        assert "error" in client.request("spawn", **{**base, **bad}), bad
    assert not (tmp_path / "escape.exit").exists() and not (shim.parent / "escape.exit").exists()
    for broken in (b"\x00\x00\x00\x01\x01\x01", b"\x00\x00\x00\x05\x00" + b"[" * 5):
        other = Client(shim)
        other.sock.sendall(broken)  # that client goes; the shim serves on
        with pytest.raises(EOFError):
            other.next_frame()
    fds = len(os.listdir(f"/proc/{shim_pid}/fd"))
    for i in range(20):  # a server's whole life, twenty times: nothing of it is kept
        client.request("spawn", **{**base, "launch_id": f"c{i}", "log": str(tmp_path / f"{i}.log")})
        client.until_event("exit")
        client.request("release", launch_id=f"c{i}")
    assert len(os.listdir(f"/proc/{shim_pid}/fd")) == fds
    assert client.request("list")["servers"] == []
