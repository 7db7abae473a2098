"""'server crashed' over real HTTP: the dump, its forms, redaction, and webhook notifications
against a real local receiver standing in for Slack."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from gpuwarden.daemon.chat import mark, matches_trigger
from gpuwarden.daemon.sglanglines import parse_line
from gpuwarden.standin import cli as standin_cli
from gpuwarden.standin.serverargs import server_args_repr

from .support.configs import standin_config
from .support.daemon import Daemon, start_daemon
from .support.http import Receiver
from .support.procs import Proc


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_triggers_ignore_case_and_punctuation() -> None:
    triggers = ["server crashed", "server is down"]
    assert matches_trigger("Server crashed!!", triggers) == "server crashed"
    assert matches_trigger("the server is down?", triggers) == "server is down"
    assert matches_trigger("my server crashedx", triggers) is None
    assert matches_trigger("how are you", triggers) is None


def test_the_server_args_line_is_not_marked_as_an_error() -> None:
    # The stand-in's own server_args line, with values that mention failures.
    args, _ = standin_cli.parse(
        ["--model-path", "/models/NCCL-error-Exception", "--served-model-name", "OOM-Traceback"]
    )
    line = f"[2025-06-26 07:25:31] server_args={server_args_repr(args)}"
    assert all(word in line for word in ("rror", "xception", "NCCL", "atchdog", "Traceback"))
    assert parse_line(line).findings == []
    assert mark(line) == f"  {line}"
    for failure in (
        "[2025-06-26 07:25:32 TP0] Scheduler hit an exception: Traceback (most recent call last):",
        "Traceback (most recent call last):",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "[2025-06-26 07:25:33] Received sigquit from a child process. It usually means the child "
        "failed.",
        "sglang serve: error: unrecognized arguments: --tp-szie 2",
    ):
        assert mark(failure).startswith("! "), failure
    assert mark('  File "/x/scheduler.py", line 3, in run').startswith("  ")


def crashed(procs: list[Proc], tmp_path: Path, fake_gpu: Path, **settings: Any) -> Daemon:
    secret = standin_config(
        "--standin-crash-on-load=cuda_oom",
        "--api-key=sk-chat-secret-123",
        env={"HF_TOKEN": "hf_chat_secret_456"},
    )
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"oom": secret},
        default="oom",
        restart={"initial_delay_s": 60},
        **settings,
    )
    d.wait_state("backoff", reason="cuda_oom")
    return d


def test_server_crashed_answers_with_the_reason_and_the_real_traceback(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = crashed(procs, tmp_path, fake_gpu)
    res = d.http.post("/chat", json={"text": "Server crashed!!", "user": "me"})
    assert res.status_code == 200
    body = res.json()
    text = body["text"]
    assert body["trigger"] == "server crashed"
    assert "state: backoff" in text
    assert "last exit: cuda_oom" in text
    assert "evidence: torch.OutOfMemoryError: CUDA out of memory" in text
    assert "! [" in text and "Scheduler hit an exception: Traceback" in text
    assert body["dump"]["last_exit"]["reason"] == "cuda_oom"
    assert (tmp_path / "state" / "dumps" / f"{body['saved']}.txt").exists()
    assert body["saved"] in d.http.get("/dumps").json()["dumps"]
    assert "cuda_oom" in d.http.get(f"/dumps/{body['saved']}").text
    # Secrets appear nowhere: chat, dump, status, config view, log view.
    for view in (
        text,
        d.http.get("/dump").text,
        json.dumps(d.http.get("/dump", headers={"Accept": "application/json"}).json()),
        json.dumps(d.status()),
        json.dumps(d.http.get("/configs/oom").json()),
        json.dumps(d.http.get("/logs", params={"lines": 500}).json()),
        (tmp_path / "state" / "dumps" / f"{body['saved']}.json").read_text(),
    ):
        assert "sk-chat-secret-123" not in view
        assert "hf_chat_secret_456" not in view
    assert "api_key='***'" in d.http.get("/logs", params={"lines": 500}).text


def test_slack_form_curl_d_and_help(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    (tmp_path / "token").write_text("bearer-tok\n")
    d = crashed(
        procs, tmp_path, fake_gpu, token_file="./token", chat={"verification_token": "slack-verify"}
    )
    slack = d.http.post(
        "/chat",
        data={
            "text": "server is down?",
            "user_name": "ann",
            "channel_name": "ops",
            "token": "slack-verify",
            "response_url": "http://127.0.0.1:9/x",
        },
    )
    assert slack.status_code == 200
    sb = slack.json()
    assert sb["response_type"] == "in_channel"
    assert sb["blocks"][0]["type"] == "section" and "cuda_oom" in sb["blocks"][0]["text"]["text"]
    assert (
        d.http.post("/chat", data={"text": "server crashed", "token": "wrong"}).status_code == 401
    )
    assert d.http.post("/chat", json={"text": "server crashed"}).status_code == 401
    auth = {"Authorization": "Bearer bearer-tok"}
    curl = subprocess.run(
        [
            "curl",
            "-s",
            "-X",
            "POST",
            f"{d.url}/chat",
            "-H",
            "Authorization: Bearer bearer-tok",
            "-d",
            '{"text":"server crashed"}',
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert json.loads(curl.stdout)["trigger"] == "server crashed"  # form-encoded JSON
    help_reply = d.http.post("/chat", json={"text": "hello there"}, headers=auth).json()
    assert help_reply["trigger"] is None and "server crashed" in help_reply["text"]
    bad = d.http.post(
        "/chat", content=b"{not json", headers={**auth, "Content-Type": "application/json"}
    )
    assert bad.status_code == 400


def test_no_log_because_the_log_dir_is_not_writable(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    (tmp_path / "afile").write_text("")
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"c": standin_config()},
        default="c",
        log_dir="./afile/logs",
        restart={"initial_delay_s": 60},
    )
    d.wait_state("backoff", reason="log_unwritable")
    text = d.http.post("/chat", json={"text": "server crashed"}).json()["text"]
    assert (
        "log: no log exists: the launch's log file could not be created, so the server was "
        "killed at its start" in text
    )
    assert "afile/logs" in text


def test_no_log_because_preflight_refused_the_launch(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs, tmp_path, fake_gpu, {"bad": standin_config("--tp-szie=2")}, default="bad"
    )
    d.wait_state("failed", reason="preflight_refused")
    text = d.http.post("/chat", json={"text": "server crashed"}).json()["text"]
    assert (
        "log: the launch never ran: preflight refused it: sglang serve: error: unrecognized arguments: --tp-szie 2"
        in text
    )


def test_a_crash_loop_sends_a_bounded_number_of_posts(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, receiver: Receiver
) -> None:
    cfg = standin_config("--standin-crash-on-load=cuda_oom")
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"oom": cfg},
        default="oom",
        restart={"initial_delay_s": 0, "max_failures": 10},
        chat={"webhooks": [receiver.url, {"url": receiver.url, "format": "generic"}]},
    )
    d.wait_state("failed", timeout=60)
    first = d.wait_event("server.notify_sent", notice="failed", timeout=30)
    after = first["_index"] + 1  # one per webhook: the other's too
    d.wait_event("server.notify_sent", notice="failed", timeout=30, after=after)
    kinds = [p.get("event") for p in receiver.posts if "event" in p]
    # 10 crashes: three announced (the third one makes the loop), then one summary.
    assert kinds == ["crash", "crash", "crash", "crash_loop", "failed"]
    slack = [p for p in receiver.posts if "event" not in p]
    assert len(slack) == 5 and all(p["text"].startswith("gpuwarden: ") for p in slack)
    assert "7 more crashes were not announced" in slack[-1]["text"]
    assert receiver.url not in json.dumps(d.http.get("/events", params={"limit": 200}).json())


def test_dump_when_nothing_ever_ran(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"c": standin_config()})
    text = httpx.get(f"{d.url}/dump").text
    assert "state: stopped" in text and "log: no launch has happened yet" in text


def slack_signed(secret: str, body: bytes, at: float) -> dict[str, str]:
    """Headers as Slack signs a request (its documented recipe, written out here)."""
    ts = str(int(at))
    digest = hmac.new(secret.encode(), f"v0:{ts}:".encode() + body, hashlib.sha256).hexdigest()
    return {
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": f"v0={digest}",
        "Content-Type": "application/x-www-form-urlencoded",
    }


def test_slack_signed_requests(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    (tmp_path / "token").write_text("bearer-tok\n")
    d = crashed(
        procs, tmp_path, fake_gpu, token_file="./token", chat={"signing_secret": "s3cr3t-sign"}
    )
    body = urlencode({"text": "server crashed", "user_name": "ann", "command": "/gpu"}).encode()
    now = time.time()

    def post(headers: dict[str, str], content: bytes = body) -> httpx.Response:
        return d.http.post("/chat", content=content, headers=headers)

    ok = post(slack_signed("s3cr3t-sign", body, now))
    assert ok.status_code == 200, ok.text
    reply = ok.json()
    assert reply["response_type"] == "in_channel" and "cuda_oom" in json.dumps(reply["blocks"])
    # A signature over another body, or with another secret: 401.
    tampered = body.replace(b"ann", b"eve")
    res = post(slack_signed("s3cr3t-sign", body, now), tampered)
    assert res.status_code == 401 and "does not match" in res.json()["detail"]
    assert post(slack_signed("other-secret", body, now)).status_code == 401
    headers = slack_signed("s3cr3t-sign", body, now)
    sig = headers["X-Slack-Signature"]
    other = "1" if sig.endswith("0") else "0"  # one hex digit changed, whatever it was
    res = post({**headers, "X-Slack-Signature": sig[:-1] + other})
    assert res.status_code == 401
    # A stale timestamp, correctly signed (a request captured 6 minutes ago, replayed), or one
    # from the future, or not a number: 401.
    for at in (now - 360, now + 360):
        res = post(slack_signed("s3cr3t-sign", body, at))
        assert res.status_code == 401 and "stale or replayed" in res.json()["detail"], at
    res = post({**slack_signed("s3cr3t-sign", body, now), "X-Slack-Request-Timestamp": "soon"})
    assert res.status_code == 401
    # No signature and no token: 401; the bearer still works beside the signature.
    plain = {"Content-Type": "application/x-www-form-urlencoded"}
    assert post(plain).status_code == 401
    assert post({**plain, "Authorization": "Bearer bearer-tok"}).status_code == 200
    assert post({**plain, "Authorization": "Bearer wrong"}).status_code == 401


def test_slack_signature_without_a_bearer_token(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """With only chat.signing_secret set, /chat needs a signature (the body is still read,
    bounded) and the legacy verification token still works beside it."""
    d = crashed(
        procs,
        tmp_path,
        fake_gpu,
        chat={"signing_secret": "only-sign", "verification_token": "legacy"},
    )
    body = urlencode({"text": "server crashed"}).encode()
    assert (
        d.http.post(
            "/chat", content=body, headers=slack_signed("only-sign", body, time.time())
        ).status_code
        == 200
    )
    plain = {"Content-Type": "application/x-www-form-urlencoded"}
    assert d.http.post("/chat", content=body, headers=plain).status_code == 401
    legacy = urlencode({"text": "server crashed", "token": "legacy"}).encode()
    assert d.http.post("/chat", content=legacy, headers=plain).status_code == 200
    assert d.http.post("/chat", json={"text": "server crashed"}).status_code == 401


def test_concurrent_triggers_each_save_a_dump_of_their_own(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Thirty 'server crashed' at once, mostly in the same second: thirty dumps, none
    overwritten (each name claimed with O_EXCL)."""
    d = crashed(procs, tmp_path, fake_gpu)

    def trigger(i: int) -> str:
        with httpx.Client(base_url=d.url, timeout=60, trust_env=False) as c:
            res = c.post("/chat", json={"text": f"server crashed {i}"})
            assert res.status_code == 200, res.text
            saved: str = res.json()["saved"]
            return saved

    with ThreadPoolExecutor(30) as pool:
        names = list(pool.map(trigger, range(30)))
    assert len(set(names)) == 30
    folder = tmp_path / "state" / "dumps"
    assert sorted(p.stem for p in folder.glob("*.txt")) == sorted(names)
    for i in range(30):  # each file holds the dump of the request that named it
        assert sum(f"server crashed {i}'" in (folder / f"{n}.txt").read_text() for n in names) == 1
