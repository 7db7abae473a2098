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
    counted_by: str = "words"  # "usage": the stream's own token count
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
    arrivals: list[tuple[float, int]] = []  # (time, words) of each chunk with text
    usage: int | None = None
    try:
        async with client.stream("POST", url, json=body, timeout=spec.timeout_s) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                    usage = int(chunk["usage"]["completion_tokens"])
                text = "".join(
                    (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or []
                )
                if text:
                    arrivals.append((time.perf_counter(), max(1, len(text.split()))))
        _count(res, arrivals, usage)
        res.ok = True
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.ended = time.perf_counter()
    return res


def _count(res: RequestResult, arrivals: list[tuple[float, int]], usage: int | None) -> None:
    """Tokens, time to first token and inter-token latencies of one stream. The tokens are the
    server's own count (`usage`, asked for with `stream_options.include_usage`), spread evenly
    over the chunks that carried text; words stand in only for a server that sends no usage."""
    if not arrivals:
        res.tokens = usage or 0
        res.counted_by = "usage" if usage is not None else "words"
        return
    res.ttft_s = arrivals[0][0] - res.started
    if usage is not None:
        res.tokens, res.counted_by = usage, "usage"
        per_chunk = [usage / len(arrivals)] * len(arrivals)
    else:
        per_chunk = [float(n) for _, n in arrivals]
        res.tokens, res.counted_by = sum(n for _, n in arrivals), "words"
    for (prev, _), (now, _), n in zip(arrivals, arrivals[1:], per_chunk[1:], strict=False):
        if n > 0:
            k = max(1, round(n))
            res.itl_s.extend([(now - prev) / n] * k)


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
    by = {r.counted_by for r in ok}
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": tokens,
        # "usage" when every stream gave its token count; "words" (or "mixed") when a server
        # sent none and whitespace-separated words were counted instead.
        "tokens_counted_by": by.pop() if len(by) == 1 else ("mixed" if by else None),
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
