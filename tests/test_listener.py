"""Who holds a health URL's listening socket: real sockets, real processes, /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.daemon.listener import (
    _diag_rows,
    _proc_rows,
    check_listener,
    local_ip,
    url_endpoint,
)


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A process that holds no socket."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def listen(host: str = "127.0.0.1", family: int = socket.AF_INET) -> socket.socket:
    sock = socket.socket(family)
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_a_socket_of_the_launch_is_its_own() -> None:
    with listen() as sock:
        port = sock.getsockname()[1]
        check = check_listener(f"http://127.0.0.1:{port}/health", [os.getpid()])
    assert check.ours is True, check.detail


def test_a_socket_held_elsewhere_is_named_with_its_holder(sleeper: int) -> None:
    with listen() as sock:
        port = sock.getsockname()[1]
        check = check_listener(f"http://127.0.0.1:{port}/health", [sleeper])
    assert check.ours is False
    assert check.holder == os.getpid()
    assert f"127.0.0.1:{port} is held by pid {os.getpid()} (" in check.detail


def test_a_wildcard_bind_answers_for_loopback_and_the_exact_bind_wins() -> None:
    wild = socket.socket()
    wild.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    wild.bind(("0.0.0.0", 0))
    wild.listen()
    with wild:
        port = wild.getsockname()[1]
        assert check_listener(f"http://127.0.0.1:{port}/", [os.getpid()]).ours is True
        # Another process binds 127.0.0.1 on the same port (SO_REUSEPORT, same user): the
        # kernel sends connections to 127.0.0.1 to that exact bind, not to the wildcard one.
        code = (
            "import socket, time\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
            f"s.bind(('127.0.0.1', {port})); s.listen(); print('bound', flush=True)\n"
            "time.sleep(60)\n"
        )
        other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout is not None and other.stdout.readline().strip() == "bound"
            exact = check_listener(f"http://127.0.0.1:{port}/", [os.getpid()])
            assert exact.ours is False and exact.holder == other.pid, exact
            assert check_listener(f"http://localhost:{port}/", [other.pid]).ours is True
        finally:
            other.kill()
            other.wait()


def test_ipv6_loopback() -> None:
    try:
        sock = listen("::1", socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with sock:
        port = sock.getsockname()[1]
        assert check_listener(f"http://[::1]:{port}/health", [os.getpid()]).ours is True


def test_cannot_tell_is_said_with_the_reason(sleeper: int) -> None:
    with socket.socket() as bound:  # bound, not listening: the port is ours and silent
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        nothing = check_listener(f"http://127.0.0.1:{port}/health", [sleeper])
    assert (nothing.ours, nothing.detail) == (None, f"nothing listens on 127.0.0.1:{port}")
    assert nothing.nothing_listens
    remote = check_listener("http://192.0.2.7:30000/health", [sleeper])
    assert remote.ours is None and "192.0.2.7 is not an address of this machine" in remote.detail
    assert check_listener("http://:80", [sleeper]).ours is None


def test_endpoints_and_local_addresses() -> None:
    assert url_endpoint("http://127.0.0.1:30000/health") == ("127.0.0.1", 30000)
    assert url_endpoint("https://example.invalid/x") == ("example.invalid", 443)
    assert str(local_ip("localhost")) == "127.0.0.1"
    assert local_ip("192.0.2.7") is None
    assert local_ip("not an address") is None


def test_a_holder_that_cannot_be_found_proves_nothing(tmp_path: Path) -> None:
    """A /proc where the socket's holder is invisible (another user's process, a container's
    proxy): "cannot tell", never "not ours"."""
    (tmp_path / "net").mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   0: 0100007F:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 424242 1\n"
    (tmp_path / "net" / "tcp").write_text(header + row)
    (tmp_path / "123" / "fd").mkdir(parents=True)
    os.symlink("socket:[99]", tmp_path / "123" / "fd" / "3")
    check = check_listener("http://127.0.0.1:30000/health", [123], proc=tmp_path)
    assert check.ours is None
    assert "held by a process whose descriptors are unreadable" in check.detail
    os.symlink("socket:[424242]", tmp_path / "123" / "fd" / "4")
    assert check_listener("http://127.0.0.1:30000/health", [123], proc=tmp_path).ours is True


def test_the_kernels_listening_table_agrees_with_proc_net_tcp() -> None:
    """sock_diag (what the check asks) and /proc/net/tcp{,6} (its fallback) name the same
    sockets: exact and wildcard binds, both families, one port each."""
    socks = [
        listen("127.0.0.1"),
        listen("0.0.0.0"),
        listen("::1", socket.AF_INET6),
        listen("::", socket.AF_INET6),
    ]
    try:
        for s in socks:
            port = s.getsockname()[1]
            diag = _diag_rows(port)
            assert diag is not None, "netlink sock_diag answered nothing"
            assert sorted(diag) == sorted(_proc_rows(port, Path("/proc"))), port
            assert len(diag) == 1
    finally:
        for s in socks:
            s.close()
