"""The front proxy on every token: time to first token and decode tok/s with 32 concurrent
streams on the stand-in, direct and through the proxy, in the same run (rounds interleaved,
the order turned each round); beside them the obvious alternative built from the daemon's own
libraries (a Starlette route forwarding with httpx, under uvicorn), to show why the proxy is
its own asyncio code. Then the release delay: requests held through a crash-restart under a
real daemon, from the daemon's `ready` record to each held answer's first byte.

    python bench/proxy.py [--rounds 6] [--streams 32] [--tokens 64] [--out bench/results]

The client is lean (raw asyncio, no HTTP library) so that its own cost stays out of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.core import PY, Daemon, free_port, measured_on, pct, ts, write_results
from gpuwarden.standin import fakegpu
from tests.support.configs import standin_config

CANDIDATE = """
import sys, httpx, uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
UP = sys.argv[1]
client = httpx.AsyncClient(base_url=UP, timeout=None, limits=httpx.Limits(max_connections=None))
async def forward(request: Request):
    req = client.build_request(request.method, request.url.path, content=await request.body(),
                               headers={"content-type": request.headers.get("content-type", "")})
    res = await client.send(req, stream=True)
    return StreamingResponse(res.aiter_raw(), status_code=res.status_code,
                             headers={"content-type": res.headers.get("content-type", "")},
                             background=None)
app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


async def one_stream(port: int, tokens: int) -> tuple[float, int, float]:
    """(time to first token, tokens, seconds) of one streamed /generate."""
    body = json.dumps(
        {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": tokens}}
    ).encode()
    began = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /generate HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )
    first = None
    events = 0
    buf = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        buf += data
        n = buf.count(b"data: {")
        if n and first is None:
            first = time.perf_counter() - began
        events += n
        buf = buf[buf.rfind(b"data: {") + 7 :] if n else buf[-16:]
        if b"[DONE]" in data:
            break
    writer.close()
    return first if first is not None else float("nan"), events, time.perf_counter() - began


async def burst(port: int, streams: int, tokens: int) -> tuple[list[float], float]:
    """`streams` concurrent streams: their TTFTs, and the decode tok/s of all together."""
    began = time.perf_counter()
    done = await asyncio.gather(*(one_stream(port, tokens) for _ in range(streams)))
    wall = time.perf_counter() - began
    return [d[0] for d in done], sum(d[1] for d in done) / wall


async def mixed(
    direct: int, proxy: int, streams: int, tokens: int, first: int
) -> tuple[list[float], list[float]]:
    """One burst of `streams` concurrent streams, alternately direct and through the proxy:
    the TTFTs of each."""
    ports = [proxy if (i + first) % 2 else direct for i in range(streams)]
    done = await asyncio.gather(*(one_stream(port, tokens) for port in ports))
    return (
        [d[0] for d, port in zip(done, ports, strict=True) if port == direct],
        [d[0] for d, port in zip(done, ports, strict=True) if port == proxy],
    )


def wait_http(port: int, path: str = "/health", timeout: float = 60) -> None:
    import httpx  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"nothing serves on {port}")


def start(argv: list[str], **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def steady(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, Any]]:
    server_port, proxy_port, candidate_port = free_port(), free_port(), free_port()
    procs = [
        start(
            [
                PY,
                "-m",
                "gpuwarden.standin",
                "--model-path",
                "m",
                "--port",
                str(server_port),
                "--standin-time-scale",
                "0.01",
            ],
            **{fakegpu.ENV_DIR: str(fakegpu.init_dir(tmp / "gpus", count=1))},
        ),
        start(
            [
                PY,
                "-m",
                "gpuwarden.daemon.proxy",
                "--listen",
                f"127.0.0.1:{proxy_port}",
                "--control",
                str(tmp / "proxy.sock"),
            ]
        ),
        start([PY, "-c", CANDIDATE, f"http://127.0.0.1:{server_port}", str(candidate_port)]),
    ]
    try:
        wait_http(server_port)
        control = _control(tmp / "proxy.sock", server_port)
        wait_http(proxy_port)
        wait_http(candidate_port)
        targets = {"direct": server_port, "proxy": proxy_port, "uvicorn+httpx": candidate_port}
        ttft: dict[str, list[float]] = {k: [] for k in targets}
        rates: dict[str, list[float]] = {k: [] for k in targets}
        for port in targets.values():  # warm-up
            asyncio.run(burst(port, args.streams, 8))
        order = list(targets)
        for r in range(args.rounds):
            for name in order[r % 3 :] + order[: r % 3]:
                firsts, rate = asyncio.run(burst(targets[name], args.streams, args.tokens))
                rates[name].append(rate)
                if name == "uvicorn+httpx":
                    ttft[name] += firsts
            # TTFT side by side: one burst, every other stream through the proxy, so both
            # land in the same batch steps of the server (whose step quantizes TTFT).
            for first in (0, 1):
                both = asyncio.run(mixed(server_port, proxy_port, args.streams, args.tokens, first))
                ttft["direct"] += both[0]
                ttft["proxy"] += both[1]
        # One stream at a time, alternately: the proxy's own added latency, no batch to share.
        alone: dict[str, list[float]] = {"direct": [], "proxy": []}
        for _ in range(args.rounds * 10):
            for name in ("direct", "proxy"):
                alone[name] += asyncio.run(burst(targets[name], 1, 4))[0]
        control.close()
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(20)
    out: dict[str, dict[str, Any]] = {
        "alone": {
            name: {"p50_ms": 1000 * pct(alone[name], 0.5), "p99_ms": 1000 * pct(alone[name], 0.99)}
            for name in alone
        }
    }
    for name in targets:
        out[name] = {
            "ttft_p50_ms": 1000 * pct(ttft[name], 0.5),
            "ttft_p99_ms": 1000 * pct(ttft[name], 0.99),
            "tok_s": sorted(rates[name])[len(rates[name]) // 2],
        }
    return out


def _control(path: Path, upstream: int) -> Any:
    import socket  # noqa: PLC0415

    deadline = time.monotonic() + 30
    while True:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(str(path))
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    word = {"gate": {"mode": "open", "upstream": ["127.0.0.1", upstream], "state": "ready"}}
    sock.sendall(json.dumps(word).encode() + b"\n")
    return sock


def release(args: argparse.Namespace, tmp: Path) -> list[float]:
    """Seconds from the daemon's `ready` record to each held request's first answer byte."""
    listen = f"127.0.0.1:{free_port()}"
    cfg = standin_config(scale=0.01, port=free_port())
    cfg["health"] = {"startup_timeout_s": 60, "interval_s": 0.05, "timeout_s": 2}
    d = Daemon(tmp / "daemon", {"c": cfg}, "c", proxy={"listen": listen})
    delays: list[float] = []
    try:
        d.wait_for(lambda rs: any(r.get("to") == "ready" for r in rs))
        wait_http(int(listen.rsplit(":", 1)[1]), "/health")
        for _ in range(args.rounds):
            mark = len(d.records())
            pid = d.http.get("/status").json()["pid"]
            os.kill(pid, signal.SIGKILL)
            d.wait_for(lambda rs, m=mark: any(r.get("to") == "stopping" for r in rs[m:]), 30)
            answered = asyncio.run(_held(int(listen.rsplit(":", 1)[1]), 16))
            recs = d.wait_for(lambda rs, m=mark: any(r.get("to") == "ready" for r in rs[m:]))
            ready_at = ts(next(r for r in recs[mark:] if r.get("to") == "ready"))
            delays += [t - ready_at for t in answered]
    finally:
        d.close()
    return delays


async def _held(port: int, n: int) -> list[float]:
    async def one() -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}'
        writer.write(
            b"POST /generate HTTP/1.1\r\nhost: b\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        await reader.readline()
        at = time.time()
        writer.close()
        return at

    return list(await asyncio.gather(*(one() for _ in range(n))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = steady(args, Path(tmp))
        delays = release(args, Path(tmp))
    alone = figures.pop("alone")
    direct = figures["direct"]
    lines = [
        "# The front proxy: overhead on every token, and the release of held requests",
        "",
        measured_on() + f"; {args.streams} concurrent streams of {args.tokens} tokens, "
        f"{args.rounds} rounds, on the stand-in (its decode paced as a small model's batch). "
        "TTFT of direct and proxy: from the same bursts, every other stream through the proxy "
        "(the server's batch step quantizes TTFT; separate bursts land on different steps); "
        "tok/s and the uvicorn+httpx row: from bursts of their own, in turn.",
        "",
        "| path | TTFT p50 | TTFT p99 | TTFT overhead p50 / p99 | decode tok/s | tok/s vs direct |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        over = (
            "-"
            if name == "direct"
            else f"{f['ttft_p50_ms'] - direct['ttft_p50_ms']:+.2f} / "
            f"{f['ttft_p99_ms'] - direct['ttft_p99_ms']:+.2f} ms"
        )
        lines.append(
            f"| {name} | {f['ttft_p50_ms']:.2f} ms | {f['ttft_p99_ms']:.2f} ms | {over} | "
            f"{f['tok_s']:.0f} | {100 * f['tok_s'] / direct['tok_s']:.1f} % |"
        )
    lines += [
        "",
        f"One stream at a time ({args.rounds * 10} each, alternately): TTFT direct p50 "
        f"{alone['direct']['p50_ms']:.2f} ms / p99 {alone['direct']['p99_ms']:.2f} ms, through "
        f"the proxy p50 {alone['proxy']['p50_ms']:.2f} ms / p99 {alone['proxy']['p99_ms']:.2f} ms "
        f"({alone['proxy']['p50_ms'] - alone['direct']['p50_ms']:+.2f} / "
        f"{alone['proxy']['p99_ms'] - alone['direct']['p99_ms']:+.2f} ms): the proxy's own cost "
        "per request, two more loopback hops and its parsing.",
        "",
        f"Release after `ready` ({len(delays)} held requests over {args.rounds} crash-restarts, "
        "the daemon's ready record to the held answer's first byte, which includes a 1-token "
        f"generation): p50 {1000 * pct(delays, 0.5):.1f} ms, p99 {1000 * pct(delays, 0.99):.1f} "
        f"ms, max {1000 * max(delays):.1f} ms (goal: within 250 ms).",
    ]
    write_results(args.out, "proxy.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
