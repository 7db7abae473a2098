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
        answers: list[int] = []
        pid = d.status()["pid"]
        asked = threading.Event()

        def ask() -> None:  # arrives while the server is down
            asked.wait(60)
            with httpx.Client(timeout=STARTUP_S, trust_env=False) as c:
                plain = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}
                answers.append(c.post(proxy + "/generate", json=plain).status_code)

        asker = threading.Thread(target=ask)
        asker.start()

        def crash() -> None:
            os.kill(pid, signal.SIGKILL)
            asked.set()

        spliced = streamed(http, proxy, body, after=crash)
        asker.join(STARTUP_S)
    assert answers == [200]
    assert spliced[-1]["text"] == whole[-1]["text"]  # byte-identical
    assert spliced[-1]["output_ids"] == whole[-1]["output_ids"]
    assert spliced[-1]["meta_info"]["completion_tokens"] == 400
    figures = d.status()["proxy"]
    assert figures["continued"] == 1 and figures["cut"] == 0, figures
    assert d.status()["pid"] != pid  # it was restarted under the stream
