"""The front proxy against hostile or broken peers: clients that smuggle, stall or leave,
servers that answer garbage, bad words on its control socket. Each answer is well formed, no
client gets another's answer, and the proxy serves on."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from .support.procs import Proc, wait_until
from .support.proxy import running_proxy
from .support.upstream import ok, raw, scripted

pytestmark = pytest.mark.timeout(60)

GET = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /a HTTP/1.1\r\nhost: x\r\nx: a\n\nGET /b HTTP/1.1\r\nhost: y\r\n\r\n",  # bare LF
        b"GET /a HTTP/1.1\r\nhost: x\r\nx: a\rb\r\n\r\n",  # bare CR
        b"GET /a HTTP/1.1\r\nhost: x\x00\r\n\r\n",  # NUL
        b"GET /a HTTP/1.1\r\nbad name: x\r\n\r\n",
        b"POST /a HTTP/1.1\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
        b"POST /a HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /a HTTP/1.1\r\ntransfer-encoding: xchunked\r\n\r\n",
        b"POST /a HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n-7\r\nabc\r\n0\r\n\r\n",
        b"POST /a HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
        b"POST /a HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
        b"GET /a HTTP/1.2\r\n\r\n",
    ],
    ids=[
        "bare-lf",
        "bare-cr",
        "nul",
        "bad-name",
        "two-lengths",
        "length-and-chunked",
        "xchunked",
        "negative-chunk",
        "hex-prefix-chunk",
        "negative-length",
        "version",
    ],
)
def test_a_request_that_could_be_framed_two_ways_gets_400_and_reaches_no_server(
    procs: list[Proc], tmp_path: Path, request_bytes: bytes
) -> None:
    with (
        scripted([ok(b"for-a")]) as up,
        running_proxy(procs, tmp_path) as (url, control, _),
    ):
        control.gate("open", up.port, state="ready")
        control.stats(lambda s: s["mode"] == "open")
        answer = raw(port_of(url), request_bytes)
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert up.requests == []


def test_a_server_answer_longer_than_it_said_reaches_no_other_client(
    procs: list[Proc], tmp_path: Path
) -> None:
    answered, stray_sent = threading.Event(), threading.Event()

    def long_answer(conn: socket.socket) -> None:
        conn.sendall(ok(b"HELLO")[:-5] + b"HELLO")
        answered.wait(10)  # (its client has its answer: the connection sits in the pool)
        conn.sendall(ok(b"SMUGGLED"))  # a stray answer on the same connection
        stray_sent.set()

    with (
        scripted([long_answer, ok(b"second")]) as up,
        running_proxy(procs, tmp_path) as (url, control, _),
    ):
        control.gate("open", up.port, state="ready")
        control.stats(lambda s: s["mode"] == "open")
        assert raw(port_of(url), GET).endswith(b"HELLO")
        answered.set()
        assert stray_sent.wait(10)
        assert raw(port_of(url), GET).endswith(b"second")


def test_informational_answers_are_skipped_for_the_final_one(
    procs: list[Proc], tmp_path: Path
) -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
    with (
        scripted([early + ok(b"final-a"), ok(b"final-b")]) as up,
        running_proxy(procs, tmp_path) as (url, control, _),
    ):
        control.gate("open", up.port, state="ready")
        control.stats(lambda s: s["mode"] == "open")
        assert raw(port_of(url), GET).endswith(b"final-a")
        assert raw(port_of(url), GET).endswith(b"final-b")


@pytest.mark.parametrize(
    "garbage",
    [b"garbage\r\n\r\n", b"HTTP/1. 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nx: a\nb\r\n\r\n"],
    ids=["no-status-line", "bad-version", "bare-lf"],
)
def test_a_server_answering_garbage_gets_502_once_and_is_not_taken_for_dead(
    procs: list[Proc], tmp_path: Path, garbage: bytes
) -> None:
    with (
        scripted([garbage, ok(b"fine")]) as up,
        running_proxy(procs, tmp_path) as (url, control, _),
    ):
        control.gate("open", up.port, state="ready")
        control.stats(lambda s: s["mode"] == "open")
        answer = raw(port_of(url), b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
        assert answer.startswith(b"HTTP/1.1 502 "), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "bad_gateway"
        assert len(up.requests) == 1  # not sent again
        assert raw(port_of(url), GET).endswith(b"fine")
        figures = control.stats(lambda s: s["failed"] == 1)
        assert not figures["down"] and figures["retried"] == 0


def test_a_client_that_leaves_a_slow_answer_ends_its_request_at_the_server(
    procs: list[Proc], tmp_path: Path
) -> None:
    never = threading.Event()
    with (
        scripted([lambda conn: never.wait(30)]) as up,
        running_proxy(procs, tmp_path) as (url, control, _),
    ):
        control.gate("open", up.port, state="ready")
        control.stats(lambda s: s["mode"] == "open")
        sock = socket.create_connection(("127.0.0.1", port_of(url)))
        sock.sendall(GET)
        control.stats(lambda s: s["in_flight"] == 1)
        sock.close()
        figures = control.stats(lambda s: s["active"] == 0)
        assert figures["client_gone"] == 1
        never.set()
        wait_until(lambda: up.closed >= 1, 10, "its connection to the server to close")


def test_bodies_over_the_bound_get_413_and_expect_100_continue_is_answered(
    procs: list[Proc], tmp_path: Path
) -> None:
    with (
        scripted([ok(b"took-it")]) as up,
        running_proxy(procs, tmp_path, "--max-held-bytes", "1000") as (url, control, _),
    ):
        control.gate("open", up.port, state="ready")
        control.stats(lambda s: s["mode"] == "open")
        big = raw(port_of(url), b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n")
        assert big.startswith(b"HTTP/1.1 413 ")
        with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as sock:
            sock.sendall(
                b"POST /a HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 4\r\n\r\n"
            )
            assert sock.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            sock.sendall(b"body")
            answer = b""
            while not answer.endswith(b"took-it"):
                answer += sock.recv(4096)
        assert b"expect" not in up.requests[0].lower()


def test_an_event_stream_without_boundaries_is_cut_and_others_are_served(
    procs: list[Proc], tmp_path: Path
) -> None:
    def endless(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        )
        with_no_boundary = b"data: " + b"x" * 65536
        for _ in range(40):
            conn.sendall(with_no_boundary)

    with (
        scripted([endless, ok(b"next")]) as up,
        running_proxy(procs, tmp_path) as (url, control, _),
    ):
        control.gate("open", up.port, state="ready")
        control.stats(lambda s: s["mode"] == "open")
        answer = raw(port_of(url), GET)
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"error"' in answer
        assert answer.rstrip().endswith(b"0")  # (its last chunk: the stream ends well formed)
        assert raw(port_of(url), GET).endswith(b"next")


def test_bad_gate_words_change_nothing(procs: list[Proc], tmp_path: Path) -> None:
    with (
        scripted([ok(b"x")]) as up,
        running_proxy(procs, tmp_path) as (url, control, _),
    ):
        for word in (
            {"mode": "open", "upstream": ["127.0.0.1", up.port], "retry_after_s": float("nan")},
            {"mode": "open", "upstream": ["127.0.0.1", 99999]},
            {"mode": "open", "upstream": "12"},
            {"mode": "open", "upstream": [1]},
            {"mode": "hold", "retry_after_s": float("inf")},
        ):
            control.sock.sendall(json.dumps({"gate": word}).encode() + b"\n")
            assert "error" in json.loads(control.file.readline()), word
        control.sock.sendall(b'{"settings": {"hold_timeout_s": NaN}}\n')
        assert "error" in json.loads(control.file.readline())
        figures = control.stats(lambda s: True)
        assert figures["mode"] == "hold" and figures["upstream"] is None
        assert figures["limits"]["hold_timeout_s"] == 600.0
        control.gate("open", up.port, state="ready")
        assert raw(port_of(url), GET).endswith(b"x")


def test_a_request_a_healthy_server_keeps_dropping_gets_502_after_three_tries(
    procs: list[Proc], tmp_path: Path
) -> None:
    def drop(conn: socket.socket) -> None:
        conn.shutdown(socket.SHUT_RDWR)

    with (
        scripted([drop, drop, drop, ok(b"never")]) as up,
        running_proxy(procs, tmp_path) as (url, control, _),
    ):
        control.gate("open", up.port, state="ready")
        control.stats(lambda s: s["mode"] == "open")
        answer = raw(port_of(url), GET)
        assert answer.startswith(b"HTTP/1.1 502 ") and b"dropped it 3 times" in answer
        assert len(up.requests) == 3
        figures = control.stats(lambda s: s["failed"] == 1)
        assert figures["retried"] == 1


def test_a_cut_chat_stream_of_tool_calls_ends_with_an_error_event_not_a_wrong_continuation(
    procs: list[Proc], tmp_path: Path
) -> None:
    call = {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"a'}}]}
    chunk_ = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": call}],
    }

    def cut(conn: socket.socket) -> None:  # a chunked stream that dies after one event
        event = b"data: " + json.dumps(chunk_).encode() + b"\n\n"
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(event), event)
        )
        conn.shutdown(socket.SHUT_RDWR)

    with (
        scripted([cut]) as up,
        running_proxy(procs, tmp_path, "--continue-streams") as (url, control, _),
    ):
        control.gate("open", up.port, state="ready", model="m")
        control.stats(lambda s: s["mode"] == "open")
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True}).encode()
        answer = raw(
            port_of(url),
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body),
        )
        assert b"tool calls and reasoning are not continued" in answer
        assert b"data: [DONE]" in answer and answer.endswith(b"0\r\n\r\n")
        assert control.stats(lambda s: s["cut"] == 1)["continued"] == 0
