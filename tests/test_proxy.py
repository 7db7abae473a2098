"""The front proxy as a process of its own (`daemon/proxy/`), driven through its control socket
as the daemon drives it, in front of the stand-in: pass-through, holding, 503s, a server that
dies under a request or a stream, clients that stall or leave."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwarden.daemon.messages import TaskFailed
from gpuwarden.daemon.proxy.control import Proxy, parse_args
from gpuwarden.daemon.proxy.gate import Gate, Limits, Rejected, reported
from gpuwarden.daemon.states import ServerState

from .support.machine import FAST, World
from .support.procs import Proc
from .support.proxy import Control, running_proxy

pytestmark = pytest.mark.timeout(60)

GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 6}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}


def ready(proc: Proc) -> Proc:
    proc.wait_for("fired up and ready")
    return proc


def events_of(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def texts(events: list[str]) -> list[str]:
    out = []
    for data in events:
        if data != "[DONE]":
            body = json.loads(data)
            out.append(body.get("text") or body["choices"][0]["delta"].get("content") or "")
    return out


def held_now(control: Control, n: int) -> None:
    control.stats(lambda s: s["held"] == n)


def test_a_ready_server_s_answers_pass_through_unchanged_streams_included(
    procs: list[Proc], tmp_path: Path, standin: Callable[..., Proc]
) -> None:
    server = ready(standin())
    direct = f"http://127.0.0.1:{server.port}"  # type: ignore[attr-defined]
    with running_proxy(procs, tmp_path) as (url, control, _):
        control.gate("open", server.port, state="ready")  # type: ignore[attr-defined]
        with httpx.Client(timeout=20) as c:
            for path in ("/v1/models", "/model_info", "/health"):
                a, b = c.get(direct + path), c.get(url + path)
                assert (a.status_code, a.content) == (b.status_code, b.content)
                assert "x-gpuwarden-held-s" not in b.headers
            answer = c.post(url + "/generate", json=GENERATE)
            assert (
                answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 6
            )
            for path, body in (("/generate", GENERATE), ("/v1/chat/completions", CHAT)):
                streamed = {**body, "stream": True}
                a = c.post(direct + path, json=streamed)
                b = c.post(url + path, json=streamed)
                assert b.headers["content-type"].startswith("text/event-stream")
                assert texts(events_of(a.text)) == texts(events_of(b.text))
                assert events_of(b.text)[-1] == "[DONE]"
            missing = c.get(url + "/no-such-route")
            assert missing.status_code == 404  # the server's own answer, passed on


def test_held_requests_go_through_once_the_gate_opens_with_the_time_held(
    procs: list[Proc], tmp_path: Path, standin: Callable[..., Proc]
) -> None:
    server = ready(standin())
    with running_proxy(procs, tmp_path) as (url, control, _):
        control.gate("hold", state="starting")
        answers: list[httpx.Response] = []

        def ask() -> None:
            with httpx.Client(timeout=30) as c:
                answers.append(c.post(url + "/generate", json=GENERATE))

        threads = [threading.Thread(target=ask) for _ in range(5)]
        for t in threads:
            t.start()
        held_now(control, 5)
        control.gate("open", server.port, state="ready")  # type: ignore[attr-defined]
        for t in threads:
            t.join(30)
        assert [a.status_code for a in answers] == [200] * 5
        assert all(float(a.headers["x-gpuwarden-held-s"]) > 0 for a in answers)
        figures = control.stats(lambda s: s["released"] == 5)
        assert figures["held"] == 0 and sum(figures["hold_seconds"]["counts"]) == 5


async def test_the_gate_releases_its_waiters_in_arrival_order() -> None:
    gate = Gate(Limits(), None)
    order: list[int] = []

    async def one(i: int) -> None:
        await gate.admit(time.monotonic(), 10, None)
        order.append(i)

    tasks = []
    for i in range(20):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0)  # (each arrives, and waits, before the next)
    assert len(gate.waiters) == 20 and gate.held_bytes == 200
    gate.set({"mode": "open", "upstream": ["127.0.0.1", 1], "state": "ready"})
    await asyncio.gather(*tasks)
    assert order == list(range(20)) and gate.held_bytes == 0


async def test_a_full_queue_and_a_rejecting_gate_answer_at_once() -> None:
    gate = Gate(Limits(hold_timeout_s=30, max_held=2, max_held_bytes=100), None)
    waiting = []
    for _ in range(2):
        waiting.append(asyncio.create_task(gate.admit(time.monotonic(), 10, None)))
        await asyncio.sleep(0)  # (one turn of the loop: it comes to wait)
    assert len(gate.waiters) == 2
    with pytest.raises(Rejected) as full:
        await gate.admit(time.monotonic(), 10, None)
    assert full.value.retry_after_s == 5 and "max_held" in full.value.message
    with pytest.raises(Rejected) as big:
        gate.limits.max_held = 10
        await gate.admit(time.monotonic(), 90, None)
    assert "max_held_bytes" in big.value.message
    gate.set({"mode": "reject", "state": "failed", "reason": "exited 1"})
    for task in waiting:  # the held ones too
        with pytest.raises(Rejected) as failed:
            await task
        assert failed.value.state == "failed" and failed.value.retry_after_s is None


def test_503s_name_the_state_with_retry_after_where_the_server_is_coming_back(
    procs: list[Proc], tmp_path: Path
) -> None:
    with running_proxy(procs, tmp_path, "--hold-timeout-s", "0.3") as (url, control, _):
        with httpx.Client(timeout=20) as c:
            control.gate("reject", state="stopped")
            control.stats(lambda s: s["mode"] == "reject")
            stopped = c.post(url + "/generate", json=GENERATE)
            assert stopped.status_code == 503 and "retry-after" not in stopped.headers
            assert stopped.json()["error"]["state"] == "stopped"
            control.gate("hold", state="starting", retry_after_s=42)
            control.stats(lambda s: s["mode"] == "hold")
            late = c.post(url + "/generate", json=GENERATE)
            assert late.status_code == 503 and late.headers["retry-after"] == "42"
            error = late.json()["error"]
            assert error["state"] == "starting" and "hold_timeout_s" in error["message"]
            assert float(late.headers["x-gpuwarden-held-s"]) >= 0.3
        assert control.stats(lambda s: s["rejected"] == 2)["held"] == 0


def test_a_stream_cut_by_a_dead_server_ends_with_an_error_event_and_a_clean_end(
    procs: list[Proc], tmp_path: Path, standin: Callable[..., Proc]
) -> None:
    server = ready(standin())
    with running_proxy(procs, tmp_path) as (url, control, _):
        control.gate("open", server.port, state="ready")  # type: ignore[attr-defined]
        body = {**GENERATE, "stream": True, "sampling_params": {"max_new_tokens": 2000}}
        with httpx.Client(timeout=20) as c, c.stream("POST", url + "/generate", json=body) as s:
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["text"]
            server.popen.send_signal(signal.SIGKILL)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == 503 and "mid-stream" in error["message"]
        assert control.stats(lambda s: s["cut"] == 1)["requests"] == 1


def test_a_request_whose_server_dies_before_answering_is_sent_to_the_next_one(
    procs: list[Proc], tmp_path: Path, standin: Callable[..., Proc]
) -> None:
    server = ready(standin(scale=0.05))
    port = server.port  # type: ignore[attr-defined]
    with running_proxy(procs, tmp_path) as (url, control, _):
        control.gate("open", port, state="ready")
        answers: list[httpx.Response] = []
        slow = {"text": "hi", "sampling_params": {"max_new_tokens": 400}}

        def ask() -> None:
            with httpx.Client(timeout=40) as c:
                answers.append(c.post(url + "/generate", json=slow))

        seen = len(server.lines)
        asker = threading.Thread(target=ask)
        asker.start()
        server.wait_for(r"Prefill batch", start=seen)  # it has the request, answers nothing yet
        server.popen.send_signal(signal.SIGKILL)
        server.popen.wait()
        control.stats(lambda s: s["down"] and s["retried"] == 1)  # held: it refuses now
        ready(standin(scale=0.01, port=port))  # the next server, on the same port
        asker.join(40)
        assert answers and answers[0].status_code == 200
        assert answers[0].json()["meta_info"]["completion_tokens"] == 400
        assert float(answers[0].headers["x-gpuwarden-held-s"]) > 0


def test_a_client_that_leaves_while_held_frees_its_place(procs: list[Proc], tmp_path: Path) -> None:
    with running_proxy(procs, tmp_path) as (url, control, _):
        control.gate("hold", state="backoff")
        host, port = url[7:].split(":")
        body = json.dumps(GENERATE).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        held_now(control, 1)
        sock.close()
        figures = control.stats(lambda s: s["held"] == 0)
        assert figures["client_gone"] == 1 and figures["held_bytes"] == 0


def test_a_stalled_client_slows_nobody_else(
    procs: list[Proc], tmp_path: Path, standin: Callable[..., Proc]
) -> None:
    server = ready(standin())
    with running_proxy(procs, tmp_path) as (url, control, proxy):
        control.gate("open", server.port, state="ready")  # type: ignore[attr-defined]
        host, port = url[7:].split(":")
        body = json.dumps({**GENERATE, "stream": True, "sampling_params": {"max_new_tokens": 5000}})
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((host, int(port)))
        stalled.sendall(
            b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body.encode())
        )
        try:  # it never reads: the others go on
            with httpx.Client(timeout=20) as c:
                for _ in range(20):
                    assert c.post(url + "/generate", json=GENERATE).status_code == 200
            rss = _rss_kib(proxy.pid)
            assert rss < 200_000, f"the proxy holds {rss} KiB"
        finally:
            stalled.close()


def test_bad_requests_get_400_and_bad_control_lines_an_error(
    procs: list[Proc], tmp_path: Path
) -> None:
    with running_proxy(procs, tmp_path) as (url, control, _):
        host, port = url[7:].split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"NOT HTTP\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 400 ")
        control.sock.sendall(b"{not json\n")
        assert "error" in json.loads(control.file.readline())
        control.send(gate={"mode": "sideways"})
        assert "mode must be one of" in json.loads(control.file.readline())["error"]
        assert control.stats(lambda s: True)["mode"] == "hold"  # the gate as it was


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def stream_events(
    c: httpx.Client, url: str, body: dict[str, Any], on_first: Any = None
) -> list[dict[str, Any]]:
    out = []
    with c.stream("POST", url + "/generate", json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                if on_first is not None and len(out) == 5:
                    on_first()
    return out


@pytest.mark.parametrize("tokens", ["words", "pieces"])
def test_a_cut_generate_stream_continues_on_the_next_server_token_exactly(
    procs: list[Proc], tmp_path: Path, standin: Callable[..., Proc], tokens: str
) -> None:
    flags = ("--standin-token-text", tokens)
    server = ready(standin(*flags))
    port = server.port  # type: ignore[attr-defined]
    body = {"text": "engineers tune", "stream": True, "sampling_params": {"max_new_tokens": 120}}
    with running_proxy(procs, tmp_path, "--continue-streams") as (url, control, _):
        control.gate("open", port, state="ready", model="m")
        with httpx.Client(timeout=30) as c:
            whole = stream_events(c, f"http://127.0.0.1:{port}", body)

            def crash_and_replace() -> None:
                server.popen.send_signal(signal.SIGKILL)
                server.popen.wait()
                threading.Thread(target=lambda: ready(standin(*flags, port=port))).start()

            spliced = stream_events(c, url, body, on_first=crash_and_replace)
        figures = control.stats(lambda s: s["continued"] == 1)
    assert figures["cut"] == 0
    assert spliced[-1]["text"] == whole[-1]["text"]  # byte-identical
    assert spliced[-1]["output_ids"] == whole[-1]["output_ids"]
    assert spliced[-1]["meta_info"]["completion_tokens"] == 120
    assert spliced[-1]["meta_info"]["id"] == spliced[0]["meta_info"]["id"]
    for before, after in itertools.pairwise(spliced):  # none duplicated or missing
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert len(after["output_ids"]) > len(before["output_ids"])
        assert after["text"].startswith(before["text"])


def test_a_cut_stream_of_another_model_ends_with_an_error_event(
    procs: list[Proc], tmp_path: Path, standin: Callable[..., Proc]
) -> None:
    server = ready(standin())
    port = server.port  # type: ignore[attr-defined]
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 2000}}
    with running_proxy(procs, tmp_path, "--continue-streams") as (url, control, _):
        control.gate("open", port, state="ready", model="a")
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/generate", json=body) as s:
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            server.popen.send_signal(signal.SIGKILL)
            control.stats(lambda f: f["down"])
            ready(standin(port=port))
            control.gate("open", port, state="ready", model="b")  # a swap to another model
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert (
            rest[-1] == "[DONE]" and "serves b, not a" in json.loads(rest[-2])["error"]["message"]
        )
        assert control.stats(lambda f: f["cut"] == 1)["continued"] == 0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_cut_openai_stream_continues_from_its_re_tokenized_text(
    procs: list[Proc], tmp_path: Path, standin: Callable[..., Proc], route: str
) -> None:
    server = ready(standin("--standin-token-text", "pieces"))
    port = server.port  # type: ignore[attr-defined]
    body: dict[str, Any] = {"model": "m", "max_tokens": 150, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "tune decoding"}]
    else:
        body["prompt"] = "tune decoding"

    def chunks(c: httpx.Client, url: str, on_fifth: Any = None) -> list[dict[str, Any]]:
        out, done = [], False
        with c.stream("POST", url + route, json=body) as s:
            for line in s.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    out.append(json.loads(line[6:]))
                    if on_fifth is not None and len(out) == 5:
                        on_fifth()
        assert done
        return out

    def content(cs: list[dict[str, Any]]) -> str:
        pieces = [
            (ch.get("delta") or {}).get("content") or ch.get("text") or ""
            for c in cs
            for ch in c["choices"]
        ]
        return "".join(pieces)

    with running_proxy(procs, tmp_path, "--continue-streams") as (url, control, _):
        control.gate("open", port, state="ready", model="m")
        with httpx.Client(timeout=30) as c:
            whole = chunks(c, f"http://127.0.0.1:{port}")

            def crash_and_replace() -> None:
                server.popen.send_signal(signal.SIGKILL)
                server.popen.wait()
                args = ("--standin-token-text", "pieces")
                threading.Thread(target=lambda: ready(standin(*args, port=port))).start()

            spliced = chunks(c, url, on_fifth=crash_and_replace)
        errors = [c["error"] for c in spliced if "error" in c]
        assert not errors
        figures = control.stats(lambda s: s["continued"] == 1)
    assert figures["cut"] == 0
    assert content(spliced) == content(whole)  # byte-identical
    assert {c["id"] for c in spliced} == {spliced[0]["id"]}  # one stream
    assert (
        spliced[-1]["usage"]["completion_tokens"] == whole[-1]["usage"]["completion_tokens"] == 150
    )
    finishes = [ch["finish_reason"] for c in spliced for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]


def test_a_failed_proxy_task_is_recorded_and_the_server_serves_on(tmp_path: Path) -> None:
    w = World(tmp_path, **FAST)
    w.up()
    w.send(TaskFailed("proxy", w.launch.gen, "OSError: boom"))
    assert w.m.state == ServerState.READY and w.host.called("terminate") == []
    assert [e["task"] for e in w.host.events("internal_error")] == ["proxy"]


async def test_a_failed_task_of_the_proxy_is_said_to_the_daemon(tmp_path: Path) -> None:
    proxy = Proxy(parse_args(["--listen", "127.0.0.1:9", "--control", str(tmp_path / "s")]))
    said: list[bytes] = []

    class Daemon:  # (the daemon's end of the control socket)
        def write(self, data: bytes) -> None:
            said.append(data)

    proxy.daemon = Daemon()  # type: ignore[assignment]
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(proxy.failed)
    try:

        async def boom() -> None:
            raise RuntimeError("x")

        task = reported(loop.create_task(boom(), name="boom"))
        with pytest.raises(RuntimeError):
            await task
        await asyncio.sleep(0)  # (its done callback runs on the next turn of the loop)
    finally:
        loop.set_exception_handler(None)
    assert [json.loads(line)["error"] for line in said] == [
        "the proxy's task boom failed: RuntimeError: x"
    ]
