"""A small async load generator for an OpenAI-compatible server (streaming chat completions).

Client-side figures per run: output tok/s (completion tokens over the measured window), time to
first token and inter-token latency (mean, p50, p99), requests ok/failed. Warm-up requests are
excluded. Concurrency 1 by default, so figures compare with single-stream measurements.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = (
    "Explain speculative decoding in two paragraphs.",
    "Write a short story about a GPU that never sleeps.",
    "List five ways to reduce the latency of a language model server.",
    "Summarise the history of the transformer architecture.",
    "Describe how tensor parallelism splits a matrix multiplication.",
)


@dataclass
class LoadSpec:
    requests: int = 4
    warmup: int = 1
    concurrency: int = 1
    max_tokens: int = 128
    prompts: tuple[str, ...] = PROMPTS
    timeout_s: float = 300.0

    @classmethod
    def with_prompt_file(cls, path: Path | None, **kw: Any) -> LoadSpec:
        spec = cls(**kw)
        if path is not None:
            prompts = []
            for line in path.read_text().splitlines():
                if line.strip():
                    item = json.loads(line)
                    prompts.append(item["prompt"] if isinstance(item, dict) else str(item))
            spec.prompts = tuple(prompts) or PROMPTS
        return spec


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    error: str | None = None


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, spec: LoadSpec
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(ok=False, started=time.perf_counter())
    last = None
    counted = 0
    try:
        async with client.stream("POST", url, json=body, timeout=spec.timeout_s) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.tokens = int(chunk["usage"].get("completion_tokens") or counted)
                text = "".join(
                    (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or []
                )
                if not text:
                    continue
                now = time.perf_counter()
                n = max(1, len(text.split()))
                counted += n
                if last is None:
                    res.ttft_s = now - res.started
                else:
                    res.itl_s.extend([(now - last) / n] * n)
                last = now
        res.tokens = res.tokens or counted
        res.ok = True
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.ended = time.perf_counter()
    return res


async def run_load(base_url: str, spec: LoadSpec, model: str = "default") -> dict[str, Any]:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    async with httpx.AsyncClient(trust_env=False) as client:
        for i in range(spec.warmup):
            await _one(client, url, model, spec.prompts[i % len(spec.prompts)], spec)
        sem = asyncio.Semaphore(max(1, spec.concurrency))

        async def go(i: int) -> RequestResult:
            async with sem:
                return await _one(client, url, model, spec.prompts[i % len(spec.prompts)], spec)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(i) for i in range(spec.requests)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    # Per request: tokens after the first over the time after the first (the decode rate).
    streams = [
        (r.tokens - 1) / (r.ended - r.started - r.ttft_s)
        for r in ok
        if r.ttft_s is not None and r.tokens > 1 and r.ended - r.started - r.ttft_s > 0
    ]
    itl = [x for r in ok for x in r.itl_s]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": tokens,
        "wall_s": wall,
        "tok_s": statistics.median(streams) if streams else None,
        "total_tok_s": tokens / wall if wall > 0 else None,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "itl_mean_s": statistics.fmean(itl) if itl else None,
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p99_s": _pct(itl, 0.99),
        "concurrency": spec.concurrency,
    }
