"""A small async load generator for an OpenAI-compatible server (streaming chat completions).

Every request asks for a fixed-length answer (`max_tokens` with `ignore_eos`, as SGLang's own
benchmark does) and for the stream's token count (`stream_options.include_usage`). A request's
tokens are the server's count: its `usage`, or `max_tokens` when the server says it stopped
there (`finish_reason: length`); never words. Per request: time to first token, inter-token
latency (time between the first and the last token over tokens - 1) and its decode rate (the
inverse). The run reports each figure's spread across requests (mean, min, p50, p90, p99, max);
warm-up requests are sent first and not counted. Concurrency 1 by default, so figures compare
with single-stream measurements.

What a server sends is read within bounds: a stream line (one SSE field) of at most
`MAX_LINE_BYTES`, a whole answer of at most `MAX_BODY_BYTES`; a longer one, a chunk that is not
a JSON object of the expected shape, or an error chunk fails that request with the reason (the
rest is never read into memory).

httpx is imported where a load runs, never when the daemon starts.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

# One line of a stream: SGLang's chunks are a few hundred bytes; a line that passes this
# without its newline is not an answer being streamed.
MAX_LINE_BYTES = 1 << 20
# A whole answer that is not streamed (`/get_server_info`): a few KiB from SGLang.
MAX_BODY_BYTES = 8 << 20


class AnswerError(Exception):
    """The server's answer cannot be read as one (too long, malformed): the message says why."""


PROMPTS = (
    "Explain speculative decoding in two paragraphs.",
    "Write a short story about a GPU that never sleeps.",
    "List five ways to reduce the latency of a language model server.",
    "Summarise the history of the transformer architecture.",
    "Describe how tensor parallelism splits a matrix multiplication.",
)


@dataclass
class LoadSpec:
    # 32 measured requests put 32 samples under each percentile (over 4, a p90 is one
    # request's figure and one slow request moves the median), after 2 warm-up requests that
    # pay for first-use costs (CUDA graphs replayed cold, caches, the first connection).
    requests: int = 32
    warmup: int = 2
    concurrency: int = 1
    max_tokens: int = 128
    ignore_eos: bool = True
    prompts: tuple[str, ...] = PROMPTS
    timeout_s: float = 300.0
    backend: str = "openai"  # or "sglang-bench": SGLang's own benchmark (sglangbench.py)
    input_len: int = 128  # sglang-bench: the random-ids prompt length, in tokens

    def describe(self) -> str:
        eos = "fixed length (ignore_eos)" if self.ignore_eos else "up to"
        return (
            f"{self.backend}: {self.warmup} warm-up + {self.requests} requests x "
            f"{self.max_tokens} output tokens ({eos}), concurrency {self.concurrency}"
        )


@dataclass
class RequestResult:
    ok: bool
    tokens: int | None = None
    counted_by: str | None = None  # "usage" | "length" (finish_reason at max_tokens) | None
    ttft_s: float | None = None
    itl_s: float | None = None  # (last token - first token) / (tokens - 1)
    started: float = 0.0
    ended: float = 0.0
    error: str | None = None

    @property
    def tok_s(self) -> float | None:
        return 1.0 / self.itl_s if self.itl_s else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation (numpy's default, SGLang's too)."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": statistics.fmean(values) if values else None,
        "min": min(values) if values else None,
        "p50": percentile(values, 0.5),
        "p90": percentile(values, 0.9),
        "p99": percentile(values, 0.99),
        "max": max(values) if values else None,
    }


def request_body(model: str, prompt: str, spec: LoadSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return body


async def lines(r: httpx.Response, limit: int = MAX_LINE_BYTES) -> AsyncIterator[str]:
    """The response's lines, each of at most `limit` bytes: a longer one raises AnswerError
    as soon as it passes the limit, without reading the rest."""
    buf = bytearray()
    async for data in r.aiter_bytes():
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if len(buf) + end - start > limit:
                raise AnswerError(f"a line of the stream is longer than {limit} bytes")
            buf += data[start:end]
            yield buf.decode("utf-8", "replace").removesuffix("\r")
            buf.clear()
            start = end + 1
        if len(buf) + len(data) - start > limit:
            raise AnswerError(f"a line of the stream is longer than {limit} bytes")
        buf += data[start:]
    if buf:
        yield buf.decode("utf-8", "replace")


def _excerpt(text: str) -> str:
    return repr(text[:80]) + ("..." if len(text) > 80 else "")


def read_chunk(payload: str) -> tuple[int | None, str | None, bool]:
    """One stream chunk (the JSON after `data:`): (its usage count, its finish reason, whether
    it carried text). AnswerError when it is not a chunk: not JSON, not an object, a field of
    the wrong type, or SGLang's error object."""
    try:
        chunk = json.loads(payload)
    except (ValueError, RecursionError):  # (nesting deeper than the parser goes)
        raise AnswerError(f"a stream chunk is not JSON: {_excerpt(payload)}") from None
    if not isinstance(chunk, dict):
        raise AnswerError(f"a stream chunk is not a JSON object: {_excerpt(payload)}")
    if chunk.get("error") is not None:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise AnswerError(f"the server sent an error in the stream: {_excerpt(str(message))}")
    usage_field = chunk.get("usage")
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise AnswerError(f"a stream chunk's choices are not objects: {_excerpt(payload)}")
    if usage_field is not None and not isinstance(usage_field, dict):
        raise AnswerError(f"a stream chunk's usage is not an object: {_excerpt(payload)}")
    usage = (usage_field or {}).get("completion_tokens")
    if usage is not None and (not isinstance(usage, int) or isinstance(usage, bool)):
        raise AnswerError(f"a stream chunk's token count is not a number: {_excerpt(payload)}")
    finish: str | None = None
    text = False
    for choice in choices:
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise AnswerError(f"a stream chunk's delta is not an object: {_excerpt(payload)}")
        finish = choice.get("finish_reason") or finish
        text = text or bool(delta.get("content"))
    return usage, (str(finish) if finish is not None else None), text


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, spec: LoadSpec
) -> RequestResult:
    import httpx  # noqa: PLC0415 - only a load needs it

    res = RequestResult(ok=False, started=time.perf_counter())
    arrivals: list[float] = []  # the time of each chunk that carried text
    usage: int | None = None
    finish: str | None = None
    try:
        body = request_body(model, prompt, spec)
        async with client.stream("POST", url, json=body, timeout=spec.timeout_s) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                return res
            async for line in lines(r):
                if not line.startswith("data:"):
                    continue
                payload = line[5:].removeprefix(" ")
                if payload == "[DONE]":
                    continue
                counted, finished, text = read_chunk(payload)
                usage = counted if counted is not None else usage
                finish = finished or finish
                if text:
                    arrivals.append(time.perf_counter())
        count(res, arrivals, usage, finish, spec.max_tokens)
        res.ok = True
    except (httpx.HTTPError, AnswerError) as exc:
        res.error = str(exc) if isinstance(exc, AnswerError) else f"{type(exc).__name__}: {exc}"
    res.ended = time.perf_counter()
    return res


async def get_json(
    client: httpx.AsyncClient, url: str, limit: int = MAX_BODY_BYTES, timeout_s: float = 10.0
) -> Any:
    """A GET's JSON answer, read up to `limit` bytes (AnswerError past it, or if not JSON)."""
    body = bytearray()
    async with client.stream("GET", url, timeout=timeout_s) as r:
        async for data in r.aiter_bytes():
            body += data
            if len(body) > limit:
                raise AnswerError(f"{url}: the answer is longer than {limit} bytes")
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # (nesting deeper than the parser goes)
        raise AnswerError(f"{url}: the answer is not JSON") from None


def count(
    res: RequestResult,
    arrivals: list[float],
    usage: int | None,
    finish: str | None,
    max_tokens: int,
) -> None:
    """A stream's tokens, time to first token and inter-token latency. The tokens are the
    server's: `usage` (asked for with `stream_options.include_usage`), else `max_tokens` when
    the server stopped there (`finish_reason: length`); with neither, the count is unknown and
    the request gives no latency (text is never counted: a word is not a token)."""
    if usage is not None:
        res.tokens, res.counted_by = usage, "usage"
    elif finish == "length":
        res.tokens, res.counted_by = max_tokens, "length"
    if arrivals:
        res.ttft_s = arrivals[0] - res.started
    if res.tokens is not None and res.tokens > 1 and len(arrivals) > 1:
        res.itl_s = (arrivals[-1] - arrivals[0]) / (res.tokens - 1)


def summarise(results: list[RequestResult], wall: float, spec: LoadSpec) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    counted = [r for r in ok if r.tokens is not None]
    tokens = sum(r.tokens or 0 for r in counted)
    by = {r.counted_by for r in ok}
    ttft = spread([r.ttft_s for r in ok if r.ttft_s is not None])
    itl = spread([r.itl_s for r in ok if r.itl_s is not None])
    rate = spread([r.tok_s for r in ok if r.tok_s is not None])
    out: dict[str, Any] = {
        "backend": "openai",
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": tokens if counted else None,
        # "usage" when every stream gave its count, "length" when the server said it stopped
        # at max_tokens; "mixed" for both; null when a server gave neither (tok/s then unknown).
        "tokens_counted_by": by.pop() if len(by) == 1 else ("mixed" if by else None),
        "wall_s": wall,
        # One stream's decode rate, the median over requests (the figure a user quotes).
        "tok_s": rate["p50"],
        # Every counted output token over the measured window (SGLang's output_throughput).
        "total_tok_s": tokens / wall if counted and len(counted) == len(ok) and wall > 0 else None,
        "concurrency": spec.concurrency,
        "max_tokens": spec.max_tokens,
        "ignore_eos": spec.ignore_eos,
    }
    for name, figures, unit in (("ttft", ttft, "_s"), ("itl", itl, "_s"), ("tok_s", rate, "")):
        for key, value in figures.items():
            out[f"{name}_{key}{unit}"] = value
    return out


async def run_load(
    base_url: str,
    spec: LoadSpec,
    model: str = "default",
    headers: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """`headers` go with every request (the server's API key): never recorded."""
    import httpx  # noqa: PLC0415 - only a load needs it

    url = base_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=max(1, spec.concurrency) + 1)
    async with httpx.AsyncClient(trust_env=False, limits=limits, headers=headers) as client:
        sem = asyncio.Semaphore(max(1, spec.concurrency))

        async def go(i: int) -> RequestResult:
            async with sem:
                return await _one(client, url, model, spec.prompts[i % len(spec.prompts)], spec)

        await asyncio.gather(*(go(i) for i in range(spec.warmup)))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(i) for i in range(spec.requests)))
        wall = time.perf_counter() - t0
    return summarise(list(results), wall, spec)
