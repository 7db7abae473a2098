"""The control plane's outside edge over real sockets: Host and Origin, auth before the body,
bounded bodies, slow and idle connections, the connection cap, and a log that a flood of one
error cannot fill."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from gpuwarden.daemon.settings import Settings

from .support.configs import standin_config, two_configs
from .support.daemon import Daemon, start_daemon
from .support.http import (
    AUTH,
    TOKEN,
    addr,
    connect,
    descriptors_short,
    read_response,
    request_head,
    send_chunks_until_answered,
    with_token,
)
from .support.procs import Proc, wait_until


def closed_by_server(sock: socket.socket) -> bytes:
    """Read until the daemon closes the connection (the socket's timeout bounds the wait);
    returns what came before the end."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError as exc:
        raise AssertionError(f"the daemon kept the connection open; got {data!r}") from exc
    return data


def error_of(body: bytes) -> str:
    parsed = json.loads(body)
    assert set(parsed) >= {"error", "detail"}, parsed
    return str(parsed["error"])


# 7. Browsers on the host


def test_a_foreign_host_is_refused_but_probes_answer(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        two_configs(),
        allowed_hosts=["gpu-box.internal", "*.example.org"],
    )
    port = addr(d)[1]
    for path in ("/status", "/dump", "/logs", "/docs", "/openapi.json", "/events"):
        res = d.http.get(path, headers={"Host": f"evil.example:{port}"})
        assert res.status_code == 403, path
        assert res.json()["error"] == "forbidden" and "allowed_hosts" in res.json()["detail"]
    assert d.http.post("/stop", headers={"Host": "attacker.test"}).status_code == 403
    # DNS rebinding names the attacker's host; probes name the pod's address: both pass.
    assert d.http.get("/healthz", headers={"Host": "10.1.2.3:8600"}).status_code == 200
    assert d.http.get("/readyz", headers={"Host": "10.1.2.3:8600"}).status_code == 503
    for host in (
        f"localhost:{port}",
        "LOCALHOST",
        "127.0.0.2",
        f"[::1]:{port}",
        f"127.0.0.1:{port}",  # the listen address
        "gpu-box.internal:8600",
        "a.example.org",
    ):
        assert d.http.get("/status", headers={"Host": host}).status_code == 200, host
    for host in ("example.org.attacker.test", "gpu-box.internal.attacker.test", "localhost.evil"):
        assert d.http.get("/status", headers={"Host": host}).status_code == 403, host


def test_cross_site_state_changes_are_refused(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs(), default="good")
    d.wait_state("ready")
    port = addr(d)[1]
    pid = d.status()["pid"]
    for headers in (
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Origin": f"http://localhost:{port + 1}"},  # another port is another origin
        {"Origin": f"http://127.0.0.1.evil.example:{port}"},
        {"Sec-Fetch-Site": "cross-site"},
    ):
        for method, path in (("POST", "/stop"), ("POST", "/restart"), ("POST", "/start")):
            res = d.http.request(method, path, headers=headers)
            assert res.status_code == 403, (headers, path)
            assert error_of(res.content) == "forbidden"
    assert (
        d.http.delete("/sweeps/sweep-20260101T000000", headers={"Origin": "null"}).status_code
        == 403
    )
    st = d.status()
    assert st["state"] == "ready" and st["pid"] == pid and st["intent"]["running"] is True
    # Reading is not refused for an Origin (the browser keeps the answer from the page).
    assert d.http.get("/status", headers={"Origin": "http://evil.example"}).status_code == 200
    # The daemon's own pages post with its own origin.
    res = d.http.post("/stop", headers={"Origin": f"http://127.0.0.1:{port}"})
    assert res.status_code == 202
    d.wait_state("stopped")


def test_docs_and_openapi_need_the_token_but_probes_do_not(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs(), token_file=with_token(tmp_path))
    for path in ("/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"):
        res = d.http.get(path)
        assert res.status_code == 401, path
        assert res.json()["error"] == "unauthorized"
        assert res.headers["www-authenticate"] == "Bearer"
    assert d.http.get("/openapi.json", headers=AUTH).json()["components"]["securitySchemes"]
    assert d.http.get("/docs", headers=AUTH).status_code == 200
    assert d.http.get("/healthz").status_code == 200
    assert d.http.get("/readyz").status_code == 503


def test_readyz_is_200_only_while_ready(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs())
    res = d.http.get("/readyz")
    assert res.status_code == 503
    assert res.json() == {
        "error": "not_ready",
        "detail": "the server is stopped",
        "state": "stopped",
    }
    mark = d.mark()
    assert d.http.post("/start", params={"config": "good"}).status_code == 202
    d.wait_state("starting", after=mark)
    assert d.http.get("/readyz").status_code in (503, 200)  # starting, or ready already
    d.wait_state("ready", after=mark)
    res = d.http.get("/readyz")
    assert res.status_code == 200 and res.json()["state"] == "ready"
    assert d.http.post("/stop").status_code == 202
    d.wait_state("stopped", after=mark)
    assert d.http.get("/readyz").status_code == 503


def test_allowed_hosts_reject_what_is_not_a_host_name() -> None:
    assert Settings(allowed_hosts=["GPU-Box.Internal.", "[fe80::1]", "*"]).allowed_hosts == [
        "gpu-box.internal",
        "fe80::1",
        "*",
    ]
    for bad in ("http://gpu-box", "gpu-box:8600", "", "a.*.org", "user@host"):
        with pytest.raises(ValueError, match="allowed_hosts"):
            Settings(allowed_hosts=[bad])


def test_listening_beyond_loopback_without_a_token_warns(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {}, listen="0.0.0.0:0")
    warning = d.wait_event("api.unauthenticated", timeout=10)
    assert warning["level"] == "warning" and warning["host"] == "0.0.0.0"
    assert "token_file" in warning["detail"]


# 8. Bodies and connections are bounded, and auth comes first


def test_auth_is_checked_before_the_body_is_read(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {}, token_file=with_token(tmp_path))
    for path in ("/chat", "/sweeps"):
        # 1 GiB announced, not a byte of it sent: the answer cannot wait for the body.
        with connect(d) as sock:
            sock.sendall(
                request_head(
                    "POST", path, d, Content_Length=str(2**30), Content_Type="application/json"
                )
            )
            status, headers, body = read_response(sock)
            assert status == 401 and error_of(body) == "unauthorized", path
            assert headers["connection"] == "close"
            closed_by_server(sock)
        with connect(d) as sock:  # chunked: no length announced at all
            sock.sendall(
                request_head("POST", path, d, Transfer_Encoding="chunked")
                + b"4000\r\n"
                + b"x" * 0x4000
            )
            status, _, body = read_response(sock)
            assert status == 401, path
    with connect(d) as sock:  # with the token, an announced length past the limit: 413 at once
        sock.sendall(
            request_head(
                "POST",
                "/sweeps",
                d,
                Content_Length=str(2**30),
                **{"Authorization": f"Bearer {TOKEN}"},
            )
        )
        status, _, body = read_response(sock)
        assert status == 413 and error_of(body) == "body_too_large"


def test_a_chunked_body_past_the_limit_gets_413(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    limit = 64 * 1024
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {},
        token_file=with_token(tmp_path),
        chat={"verification_token": "slack-verify"},
        http={"max_body_bytes": limit},
    )
    # /sweeps with the token; /chat without one (it may carry a verification token in its
    # body, so it gets its body, but bounded like any other).
    for path, headers in (("/sweeps", {"Authorization": f"Bearer {TOKEN}"}), ("/chat", {})):
        with connect(d) as sock:
            sock.sendall(
                request_head(
                    "POST",
                    path,
                    d,
                    Transfer_Encoding="chunked",
                    Content_Type="application/json",
                    **headers,
                )
            )
            status, body = send_chunks_until_answered(sock, limit)
            assert status == 413 and error_of(body) == "body_too_large", path
    # A body under the limit still works, and /chat's form token still authenticates.
    form = {"text": "hello", "token": "slack-verify", "user_name": "ops"}
    res = d.http.post("/chat", data=form)
    assert res.status_code == 200, res.text
    assert d.http.post("/chat", data={**form, "token": "wrong"}).status_code == 401
    assert d.proc.popen.poll() is None


def served_once(d: Daemon) -> bool:
    with connect(d) as sock:
        sock.sendall(request_head("GET", "/healthz", d))
        return read_response(sock)[0] == 200


def flood(d: Daemon, n: int) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for _ in range(n):
        stack.enter_context(connect(d))
    return stack


def test_a_flood_of_one_loop_error_is_logged_once_and_counted(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    # The cap above the descriptor limit, so that accept() itself runs out.
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {},
        http={"max_connections": 1000, "header_timeout_s": 60},
        log_repeat_window_s=2.5,
    )
    mark = d.mark()
    with descriptors_short(d, spare=8), flood(d, 40):
        summary = d.wait_event("log.repeated", after=mark, timeout=20)
    assert "out of system resource" in summary["kind"] and summary["count"] >= 1
    full = [
        line
        for _, line in d.proc.lines[mark : summary["_index"]]
        if "out of system resource" in line
    ]
    assert len(full) == 1, [line[:200] for line in full]
    wait_until(lambda: served_once(d), 10, "the daemon to answer again")


def test_slow_headers_are_cut_off(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {}, http={"header_timeout_s": 0.3})
    with connect(d) as sock:  # connects and says nothing
        status, _, body = read_response(sock)
        assert status == 408 and error_of(body) == "timeout"
        closed_by_server(sock)
    with connect(d) as sock:  # half the headers
        sock.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert b" 408 " in closed_by_server(sock)
    with connect(d) as sock:  # a byte at a time: the deadline is for the whole head
        closed = False
        for byte in b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"y" * 200:
            try:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)  # the drip itself is the test's subject
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed or closed_by_server(sock) is not None
    assert d.http.get("/healthz").status_code == 200


def test_a_slow_body_is_cut_off(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {}, http={"body_timeout_s": 0.3})
    with connect(d) as sock:
        sock.sendall(
            request_head("POST", "/chat", d, Content_Length="100", Content_Type="application/json")
            + b'{"text": '
        )
        assert closed_by_server(sock) == b""
    record = d.wait_event("api.connection_timed_out", phase="body")
    assert record["client"].startswith("127.0.0.1:")


def test_an_idle_keep_alive_connection_is_closed(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {}, http={"keep_alive_s": 0.3})
    with connect(d, timeout=3) as sock:  # uvicorn's own keep-alive is 5 s
        sock.sendall(request_head("GET", "/healthz", d))
        status, _, _ = read_response(sock)
        assert status == 200
        sock.sendall(request_head("GET", "/healthz", d))  # kept alive between requests
        status, _, _ = read_response(sock)
        assert status == 200
        assert closed_by_server(sock) == b""


def test_streams_and_long_waits_outlive_every_timeout(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    configs = two_configs(slow=standin_config(scale=0.2))
    short = {"header_timeout_s": 0.2, "body_timeout_s": 0.2, "keep_alive_s": 0.2}
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="good", http=short)
    d.wait_state("ready")
    with httpx.stream("GET", f"{d.url}/logs/stream", timeout=60) as stream:
        lines = stream.iter_lines()
        mark = d.mark()
        # The swap's loading takes longer than every timeout above; the answer still comes.
        res = d.http.post(
            "/restart", params={"config": "slow", "wait": "true", "probation": "false"}
        )
        assert res.status_code == 200 and res.json()["outcome"] == "ready"
        launch = d.wait_event("server.launch", after=mark, config="slow")
        for raw in lines:  # the stream outlived it and carries the new launch's lines
            if raw.startswith("data: ") and "fired up and ready" in raw:
                break
    assert launch["launch_id"]


def test_connections_beyond_the_cap_are_refused_at_once(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """With every connection's request held by the app (streams), there is none to evict: a
    newcomer gets 503 before it sends a thing."""
    d = start_daemon(procs, tmp_path, fake_gpu, {}, http={"max_connections": 4, "keep_alive_s": 60})
    with contextlib.ExitStack() as held:
        for _ in range(4):  # each a /logs/stream the app is answering
            sock = held.enter_context(connect(d))
            sock.sendall(request_head("GET", "/logs/stream", d))
            assert read_response(sock)[0] == 200
        with connect(d) as extra:
            status, headers, body = read_response(extra)  # before it sent a thing
            assert status == 503 and error_of(body) == "busy"
            assert headers["connection"] == "close"
            closed_by_server(extra)
        d.wait_event("api.connection_refused", max_connections=4)
    # The held ones are closed: room again.
    wait_until(lambda: served_once(d), 10, "a connection to be served again")


def test_at_the_cap_the_oldest_waiting_connection_makes_room(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Idle connections (served and kept alive, or silent since they connected) give way to a
    newcomer, the oldest first; one whose request the app holds never does."""
    d = start_daemon(procs, tmp_path, fake_gpu, {}, http={"max_connections": 4, "keep_alive_s": 60})
    with contextlib.ExitStack() as held:
        stream = held.enter_context(connect(d))
        stream.sendall(request_head("GET", "/logs/stream", d))
        assert read_response(stream)[0] == 200
        kept = held.enter_context(connect(d))  # served once, then idle (keep-alive)
        kept.sendall(request_head("GET", "/healthz", d))
        assert read_response(kept)[0] == 200
        silent = [held.enter_context(connect(d)) for _ in range(2)]  # never say a thing
        # The cap is reached: each newcomer is served, and the oldest waiting one is closed.
        assert served_once(d)
        assert closed_by_server(kept) == b""  # idle: closed as a keep-alive expiry would
        silent.append(held.enter_context(connect(d)))  # the cap again
        assert served_once(d)
        status, _, body = read_response(silent[0])  # it had the turn: told why
        assert status == 503 and error_of(body) == "busy"
        d.wait_event("api.connection_evicted", phase="idle")  # (the next within a minute: counted)
        stream.settimeout(0.5)  # the stream is still open and still the daemon's to answer
        with contextlib.suppress(TimeoutError):
            assert stream.recv(65536) != b""


def test_a_rotated_token_file_takes_effect_without_a_restart(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {}, token_file=with_token(tmp_path))
    pid = d.proc.popen.pid
    assert d.http.get("/status", headers=AUTH).status_code == 200
    new = {"Authorization": "Bearer rotated-token-2"}
    assert d.http.get("/status", headers=new).status_code == 401
    # Rotated the usual way: a new file renamed over the old one.
    (tmp_path / "token.new").write_text("rotated-token-2\n")
    os.replace(tmp_path / "token.new", tmp_path / "token")
    assert d.http.get("/status", headers=new).status_code == 200
    assert d.http.get("/status", headers=AUTH).status_code == 401
    assert d.http.post("/chat", json={"text": "status"}, headers=new).status_code == 200
    assert d.http.post("/chat", json={"text": "status"}, headers=AUTH).status_code == 401
    # A botched rotation (an empty file) keeps the token in force, with one warning.
    mark = d.mark()
    (tmp_path / "token.new").write_text("")
    os.replace(tmp_path / "token.new", tmp_path / "token")
    for _ in range(3):
        assert d.http.get("/status", headers=new).status_code == 200
    warning = d.wait_event("api.token_unreadable", after=mark)
    assert "previous token stays in force" in warning["detail"]
    assert sum('"api.token_unreadable"' in line for _, line in d.proc.lines[mark:]) == 1
    assert d.proc.popen.pid == pid and d.proc.popen.poll() is None


def test_chat_takes_the_bearer_scheme_in_any_case(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {}, token_file=with_token(tmp_path))
    for scheme in ("Bearer", "bearer", "BEARER"):
        headers = {"Authorization": f"{scheme} {TOKEN}"}
        assert d.http.get("/status", headers=headers).status_code == 200, scheme
        res = d.http.post("/chat", json={"text": "status"}, headers=headers)
        assert res.status_code == 200, (scheme, res.text)
    res = d.http.post("/chat", json={"text": "status"}, headers={"Authorization": "bearer wrong"})
    assert res.status_code == 401
