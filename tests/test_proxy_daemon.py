"""The front proxy under a real daemon (`proxy:` in the settings): clients through crash-restarts,
swaps and a rollback; a daemon SIGKILLed with live_restore; stop and failure answered at once;
the figures in /status and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwarden.standin.engine import piece_of

from .support.configs import standin_config, two_configs
from .support.daemon import Daemon, gpuwarden, serve, start_daemon
from .support.procs import Proc, free_port, wait_until
from .support.proxy import Control
from .support.shim import shims_ended

CLIENTS = 32
CRASHES = 20
SWAPS = 20


def proxied(**over: Any) -> dict[str, Any]:
    return {"listen": f"127.0.0.1:{free_port()}", "hold_timeout_s": 120, **over}


def expected(tokens: int) -> str:
    """The stand-in's greedy answer to "hi" (an unknown word): its vocabulary in order."""
    return "".join(piece_of(i) for i in range(tokens))


class Clients:
    """`CLIENTS` clients asking in a loop through the proxy, half of them streaming; every
    outcome counted, every answer checked."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outcomes: Counter[str] = Counter()
        self.problems: list[str] = []
        self.stop = asyncio.Event()

    async def one(self, c: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                if (i + n) % 2:
                    await self.plain(c)
                else:
                    await self.stream(c)
            except httpx.HTTPError as exc:  # a hung or refused request: never expected
                self.problems.append(f"client {i}: {type(exc).__name__}: {exc}")

    async def plain(self, c: httpx.AsyncClient) -> None:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 8}}
        res = await c.post(self.url + "/generate", json=body)
        if res.status_code != 200 or res.json()["text"] != expected(8):
            self.problems.append(f"plain: {res.status_code} {res.text[:200]}")
        self.outcomes["held" if "x-gpuwarden-held-s" in res.headers else "plain"] += 1

    async def stream(self, c: httpx.AsyncClient) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24}
        async with c.stream(
            "POST", self.url + "/v1/chat/completions", json={**body, "stream": True}
        ) as s:
            if s.status_code != 200:
                self.problems.append(f"stream: {s.status_code} {(await s.aread())[:200]!r}")
                return
            events = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            self.problems.append(f"a stream without its end: {events[-2:]}")
        elif len(events) > 1 and '"error"' in events[-2]:
            assert json.loads(events[-2])["error"]["code"] == 503
            self.outcomes["cut"] += 1
        else:
            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
            if text != expected(24) or len({c["id"] for c in chunks}) != 1:
                self.problems.append(f"a stream not the uninterrupted one: {text!r}")
            self.outcomes["stream"] += 1

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            await asyncio.gather(*(self.one(c, i) for i in range(CLIENTS)))


async def until_state(d: Daemon, state: str, after: int) -> None:
    await asyncio.to_thread(d.wait_state, state, 60, after)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("continue_streams", "crashes", "swaps"), [(False, CRASHES, SWAPS), (True, 6, 6)]
)
async def test_clients_see_latency_not_errors_through_crashes_swaps_and_a_rollback(
    procs: list[Proc],
    tmp_path: Path,
    fake_gpu: Path,
    continue_streams: bool,
    crashes: int,
    swaps: int,
) -> None:
    """Every request that arrives while the server is down is answered 200; every stream
    cut mid-way ends with an error event or (continue_streams) is the uninterrupted one."""
    configs = two_configs(oom=standin_config("--standin-crash-on-load=cuda_oom"))
    proxy = proxied(continue_streams=continue_streams)
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="good", proxy=proxy)
    d.wait_state("ready")
    clients = Clients("http://" + proxy["listen"])
    running = asyncio.create_task(clients.run())
    try:
        for i in range(crashes):
            mark = d.mark()
            pid = (await asyncio.to_thread(d.status))["pid"]
            os.kill(pid, signal.SIGKILL)
            await until_state(d, "ready", mark)
            if i % 5 == 0:  # (some requests and streams under way at the next crash)
                await asyncio.to_thread(
                    wait_until, lambda: d.status()["proxy"]["in_flight"] > 0, 30, "load"
                )
        configs_in_turn = ["other", "good"] * (swaps // 2)
        configs_in_turn[swaps // 2] = "oom"  # rolled back to the one that served
        for name in configs_in_turn:
            res = await asyncio.to_thread(
                d.http.post,
                "/restart",
                params={"config": name, "wait": "true", "probation": "false"},
                timeout=60,
            )
            assert res.status_code == 200, res.text
            assert res.json()["outcome"] == ("rolled_back" if name == "oom" else "ready")
    finally:
        clients.stop.set()
        await asyncio.wait_for(running, 90)
    assert not clients.problems, clients.problems[:5]
    assert clients.outcomes["held"] > 0 and clients.outcomes["stream"] > 0, clients.outcomes

    def settled() -> bool:  # (its figures come twice a second)
        figures = d.status()["proxy"]
        return figures["held"] == 0 and figures["cut"] == clients.outcomes["cut"]

    await asyncio.to_thread(wait_until, settled, 10, "the proxy's last figures")
    figures = (await asyncio.to_thread(d.status))["proxy"]
    assert figures["connected"] and figures["rejected"] == 0
    assert figures["released"] >= clients.outcomes["held"]
    if continue_streams:  # (a crash cuts streams; a swap drains them)
        assert figures["cut"] == 0 and figures["continued"] > 0, figures
    metrics = (await asyncio.to_thread(d.http.get, "/metrics")).text
    assert "gpuwarden_proxy_hold_seconds_bucket" in metrics
    assert f"gpuwarden_proxy_released_total {float(figures['released'])}" in metrics


@pytest.mark.timeout(120)
def test_a_daemon_sigkilled_with_live_restore_cuts_no_client(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    with shims_ended(tmp_path / "state", procs):  # (the servers outlive the daemons)
        _sigkilled(procs, tmp_path, fake_gpu)


def _sigkilled(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    proxy = proxied()
    url = "http://" + proxy["listen"]
    configs = {"k": standin_config()}
    d = start_daemon(
        procs, tmp_path, fake_gpu, configs, default="k", proxy=proxy, live_restore=True
    )
    d.wait_state("ready")
    st = d.status()
    first, pid = st["proxy"]["pid"], st["pid"]
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 300}}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/generate", json=body) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        d.proc.signal(signal.SIGKILL)  # the daemon dies mid-stream
        d.proc.popen.wait(10)
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"error"' not in events[-2]
        assert json.loads(events[-2])["meta_info"]["completion_tokens"] == 300
        # While the daemon is away the proxy still serves, and holds once its server is gone.
        assert c.post(url + "/generate", json={"text": "x"}).status_code == 200
    os.kill(pid, signal.SIGKILL)
    held: list[httpx.Response] = []

    async def ask() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            held.append(await c.post(url + "/generate", json={"text": "x"}))

    async def scenario() -> None:
        task = asyncio.create_task(ask())
        # Held: the server is gone and no daemon says so (asked on its control socket, which
        # no daemon holds now; the next one takes it back).
        control = await asyncio.to_thread(Control, tmp_path / "state" / "proxy" / "proxy.sock")
        await asyncio.to_thread(control.stats, lambda s: s["held"] == 1)
        control.close()
        assert not task.done()
        second = Daemon(serve(procs, tmp_path / "settings.yaml", fake_gpu), tmp_path)
        await asyncio.to_thread(second.wait_event, "server.proxy_adopted", 30)
        await asyncio.wait_for(task, 60)
        assert second.status()["proxy"]["pid"] == first

    asyncio.run(scenario())
    assert held[0].status_code == 200 and float(held[0].headers["x-gpuwarden-held-s"]) > 0


@pytest.mark.timeout(90)
def test_a_stop_and_a_failure_are_answered_at_once(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    proxy = proxied()
    url = "http://" + proxy["listen"]
    configs = two_configs(oom=standin_config("--standin-crash-on-load=cuda_oom"))
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        configs,
        default="good",
        proxy=proxy,
        restart={"max_failures": 2, "initial_delay_s": 0.05},
    )
    d.wait_state("ready")
    with httpx.Client(timeout=10) as c:  # (a held request would time out: hold_timeout_s 120)
        assert c.get(url + "/health").status_code == 200
        wait_until(lambda: d.status()["proxy"]["requests"] == 1, 10, "the proxy's figures")
        shown = gpuwarden(procs, "--url", d.url, "status", fake_gpu=fake_gpu)
        assert shown.popen.wait(30) == 0
        assert re.search(r"proxy +" + re.escape(proxy["listen"]) + " passing", shown.text())
        dump = d.http.get("/dump").text
        assert f"proxy: {proxy['listen']} open; 0 held, 0 in flight" in dump
        d.http.post("/stop")
        d.wait_state("stopped")
        wait_until(lambda: d.status()["proxy"]["mode"] == "reject", 10, "the proxy rejects")
        res = c.post(url + "/generate", json={"text": "x"})
        assert res.status_code == 503 and res.json()["error"]["state"] == "stopped"
    with contextlib.suppress(httpx.HTTPError):
        d.http.post("/start", params={"config": "oom"})
    d.wait_state("failed", timeout=60)
    wait_until(lambda: d.status()["proxy"]["state"] == "failed", 10, "the proxy says failed")
    with httpx.Client(timeout=10) as c:
        res = c.post(url + "/generate", json={"text": "x"})
        assert res.status_code == 503 and res.json()["error"]["state"] == "failed"


@pytest.mark.timeout(60)
def test_a_proxy_that_cannot_listen_is_said_and_the_server_still_runs(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        d = start_daemon(
            procs,
            tmp_path,
            fake_gpu,
            {"k": standin_config()},
            default="k",
            proxy={"listen": listen},
        )
        failed = d.wait_event("server.proxy_failed")
        assert failed["listen"] == listen and "cannot listen" in failed["error"]
        d.wait_state("ready")
        assert d.status()["proxy"]["connected"] is False
