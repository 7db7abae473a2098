"""The front proxy in front of the real SGLang 0.5.23: clients through a crash-restart see
latency, not errors; a /generate stream cut by the crash continues on the restarted server,
byte-identical to an uninterrupted run under greedy decoding."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import Proc, free_port, wait_until

from .conftest import STARTUP_S, DaemonFactory, sglang_config

pytestmark = pytest.mark.timeout(900)

GREEDY = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}


def streamed(http: httpx.Client, url: str, body: dict[str, Any], after: Any = None) -> list[Any]:
    events: list[Any] = []
    with http.stream("POST", url + "/generate", json=body) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if after is not None and len(events) == 10:
                after()
    return events


def test_a_crash_restart_of_sglang_through_the_proxy_continues_the_cut_stream_exactly(
    real_daemon: DaemonFactory, sglang_env: Path, procs: list[Proc], tmp_path: Path
) -> None:
    port, listen = free_port(), f"127.0.0.1:{free_port()}"
    configs = {"tiny": sglang_config(sglang_env, port)}
    d = real_daemon(
        configs,
        default="tiny",
        restart={"initial_delay_s": 0, "jitter": 0},
        proxy={"listen": listen, "continue_streams": True, "hold_timeout_s": STARTUP_S},
    )
    wait_until(lambda: d.status()["state"] == "ready", STARTUP_S, "the real server")
    proxy, direct = f"http://{listen}", f"http://127.0.0.1:{port}"
    body = {"text": "The quick brown fox", "stream": True, "sampling_params": GREEDY}
    with httpx.Client(timeout=STARTUP_S, trust_env=False) as http:
        whole = streamed(http, direct, body)
        assert len(whole[-1]["output_ids"]) == 400
        pid = d.status()["pid"]
        # Alone on the server, so that its batches are an uninterrupted run's (SGLang on this
        # CPU is not batch-invariant: another request beside it changes its greedy tokens).
        spliced = streamed(http, proxy, body, after=lambda: os.kill(pid, signal.SIGKILL))
    ids, text = spliced[-1]["output_ids"], spliced[-1]["text"]
    assert len(ids) == 400 and spliced[-1]["meta_info"]["completion_tokens"] == 400
    figures = d.status()["proxy"]
    assert figures["continued"] == 1 and figures["cut"] == 0, figures
    assert d.status()["pid"] != pid  # it was restarted under the stream
    # Token-exact: what the first server generated up to the resume, then what the next one
    # generates from prompt + those tokens, nothing duplicated, nothing missing.
    k = figures["last_resume"]["from_token"]
    assert 0 < k <= figures["last_resume"]["client_had"]
    assert ids[:k] == whole[-1]["output_ids"][:k]
    with httpx.Client(timeout=STARTUP_S, trust_env=False) as http:
        http.post(direct + "/flush_cache").raise_for_status()  # as after the crash: no cache
        prompt = http.post(direct + "/tokenize", json={"prompt": body["text"]}).json()["tokens"]
        params = {**GREEDY, "max_new_tokens": 400 - k}
        fresh = http.post(
            direct + "/generate", json={"input_ids": prompt + ids[:k], "sampling_params": params}
        ).json()
    assert ids[k:] == fresh["output_ids"]
    assert text.endswith(fresh["text"]) and whole[-1]["text"].startswith(
        text[: -len(fresh["text"])]
    )
    # Byte-identical to the uninterrupted run where this CPU's prefill of those tokens gives
    # the logits their decode gave (SGLang is not batch-invariant here: see the README).
    if fresh["output_ids"] == whole[-1]["output_ids"][k:]:
        assert text == whole[-1]["text"]

    # 32 clients asking while the server is down are held, and answered once it is back.
    wait_until(lambda: d.status()["state"] == "ready", STARTUP_S, "the real server")
    os.kill(d.status()["pid"], signal.SIGKILL)
    answers: list[int] = []

    def ask() -> None:
        with httpx.Client(timeout=STARTUP_S, trust_env=False) as c:
            plain = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}
            answers.append(c.post(proxy + "/generate", json=plain).status_code)

    askers = [threading.Thread(target=ask) for _ in range(32)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(STARTUP_S)
    assert answers == [200] * 32
    wait_until(lambda: d.status()["proxy"]["released"] >= 32, 10, "the proxy's figures")

    # An OpenAI chat stream cut the same way goes on (its text re-tokenized) or ends with an
    # error event; it never hangs. (The tiny model's random bytes rarely re-tokenize back.)
    before = d.status()["proxy"]
    pid = d.status()["pid"]
    chat = {
        "model": "default",
        "messages": [{"role": "user", "content": "Hello, how are you today?"}],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    data: list[str] = []
    with (
        httpx.Client(timeout=STARTUP_S, trust_env=False) as http,
        http.stream("POST", proxy + "/v1/chat/completions", json=chat) as s,
    ):
        for line in s.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
                if len(data) == 10:
                    os.kill(pid, signal.SIGKILL)
    assert data[-1] == "[DONE]"
    ended = before["cut"] + before["continued"] + 1
    wait_until(
        lambda: d.status()["proxy"]["cut"] + d.status()["proxy"]["continued"] == ended,
        10,
        "the proxy's figures",
    )
    after = d.status()["proxy"]
    print(
        f"the cut chat stream: {'continued' if after['continued'] > before['continued'] else 'ended with an error event'}"
    )
    if '"error"' in data[-2]:
        assert after["cut"] == before["cut"] + 1
    else:
        assert after["continued"] == before["continued"] + 1
        assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
