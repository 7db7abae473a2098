"""Who holds a health URL's listening socket: real sockets, real processes, /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gpuwarden.daemon.listener import check_listener, local_ip, url_endpoint


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


def test_a_wildcard_bind_answers_for_loopback_and_the_exact_bind_wins(sleeper: int) -> None:
    with listen("0.0.0.0") as wild:
        port = wild.getsockname()[1]
        assert check_listener(f"http://127.0.0.1:{port}/", [os.getpid()]).ours is True
        assert check_listener(f"http://localhost:{port}/", [sleeper]).ours is False


def test_ipv6_loopback() -> None:
    try:
        sock = listen("::1", socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with sock:
        port = sock.getsockname()[1]
        assert check_listener(f"http://[::1]:{port}/health", [os.getpid()]).ours is True


def test_cannot_tell_is_said_with_the_reason(sleeper: int) -> None:
    free = listen()
    port = free.getsockname()[1]
    free.close()
    nothing = check_listener(f"http://127.0.0.1:{port}/health", [sleeper])
    assert (nothing.ours, nothing.detail) == (None, f"nothing listens on 127.0.0.1:{port}")
    remote = check_listener("http://192.0.2.7:30000/health", [sleeper])
    assert remote.ours is None and "192.0.2.7 is not an address of this machine" in remote.detail
    assert check_listener("http://:80", [sleeper]).ours is None


def test_endpoints_and_local_addresses() -> None:
    assert url_endpoint("http://127.0.0.1:30000/health") == ("127.0.0.1", 30000)
    assert url_endpoint("https://example.invalid/x") == ("example.invalid", 443)
    assert str(local_ip("localhost")) == "127.0.0.1"
    assert local_ip("192.0.2.7") is None
    assert local_ip("not an address") is None
