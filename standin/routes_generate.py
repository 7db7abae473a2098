"""The stand-in's generation routes: SGLang's ``/generate``, OpenAI's chat and completions.

Each request goes to rank 0's batch loop through the engine client and is answered whole or as
server-sent events (``stream``), with the usage counts SGLang reports (on a stream only when
``stream_options.include_usage`` asks, never with ``--standin-stream-usage never``). The text
is filler words (half-words with ``--standin-token-text pieces``); the token counts and the
pacing are what a supervisor or a benchmark observes. With ``--standin-eos-after N`` a request
ends at EOS after N tokens unless it says ``ignore_eos``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .drain import on_first_request
from .engine import detokenize, next_ids, piece_of, tokenize

if TYPE_CHECKING:
    from .server import StandinServer


async def read_json(request: Request) -> dict[str, Any] | Response:
    try:
        body = await request.json()
    except ValueError:
        return JSONResponse({"error": "invalid JSON body"}, status_code=400)
    if not isinstance(body, dict):
        return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
    return body


def sse(items: AsyncIterator[dict[str, Any]], malformed: str | None = None) -> StreamingResponse:
    """Server-sent events, as SGLang streams them; `malformed` (a fault): a first event that is
    not a chunk."""

    async def body() -> AsyncIterator[bytes]:
        if malformed is not None:
            yield b"data: " + malformed.encode() + b"\n\n"
        async for item in items:
            yield b"data: " + json.dumps(item).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def generate_routes(server: StandinServer) -> list[Route]:
    pieces = server.args.standin_token_text == "pieces"
    never_usage = server.args.standin_stream_usage == "never"
    malformed = server.args.standin_malformed_chunk

    def length(max_new: int, ignore_eos: Any) -> tuple[int, str]:
        """(tokens to generate, finish reason): EOS comes first unless ignored."""
        eos = server.args.standin_eos_after
        if eos is not None and not ignore_eos and eos < max_new:
            return max(1, eos), "stop"
        return max_new, "length"

    async def generate(request: Request) -> Response:
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        on_first_request(server)
        assert server.engine is not None
        params = body.get("sampling_params") or {}
        max_new, reason = length(
            int(params.get("max_new_tokens", 128)), params.get("ignore_eos", False)
        )
        given = body.get("input_ids")
        if isinstance(given, list) and all(isinstance(i, int) for i in given) and given:
            prompt_ids = list(given)
        else:
            prompt_ids = tokenize(str(body.get("text") or ""), pieces)
        prompt_tokens = max(1, len(prompt_ids))
        context_last = prompt_ids[-1] if prompt_ids else None
        rid = uuid.uuid4().hex

        async def run() -> AsyncIterator[dict[str, Any]]:
            done = 0
            text = ""
            ids: list[int] = []
            tic = time.monotonic()
            async for n in server.engine.generate(prompt_tokens, max_new):  # type: ignore[union-attr]
                new = next_ids(context_last, done, n, pieces)
                ids += new
                text += "".join(piece_of(i, pieces) for i in new)
                done += n
                yield {
                    "text": text,
                    "output_ids": list(ids),  # (cumulative, as SGLang's default stream)
                    "meta_info": {
                        "id": rid,
                        "finish_reason": (
                            {"type": reason, "length": done} if done >= max_new else None
                        ),
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": done,
                        "cached_tokens": 0,
                        "e2e_latency": time.monotonic() - tic,
                    },
                }

        if body.get("stream"):
            return sse(run(), malformed)
        last: dict[str, Any] = {}
        async for item in run():
            last = item
        return JSONResponse(last)

    async def chat_completions(request: Request) -> Response:
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return JSONResponse(
                {
                    "object": "error",
                    "message": "messages must be a non-empty list",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
                status_code=400,
            )
        on_first_request(server)
        prompt_tokens = sum(
            len(str(m.get("content", "")).split()) + 4 for m in messages if isinstance(m, dict)
        )
        max_new = int(body.get("max_completion_tokens") or body.get("max_tokens") or 128)
        ids = chat_ids(messages)
        last = ids[-1] if ids else None
        return await openai_response(body, prompt_tokens, max_new, chat=True, last=last)

    async def completions(request: Request) -> Response:
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        on_first_request(server)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            ids = list(prompt)
        else:
            ids = tokenize(str(prompt), pieces)
        max_new = int(body.get("max_tokens") or 16)
        last = ids[-1] if ids else None
        return await openai_response(body, max(1, len(ids)), max_new, chat=False, last=last)

    def chat_ids(messages: list[Any]) -> list[int]:
        """A chat's prompt as the stand-in's template renders it: its contents' words."""
        words = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        return tokenize(words, pieces)

    async def openai_response(
        body: dict[str, Any], prompt_tokens: int, max_new: int, chat: bool, last: int | None
    ) -> Response:
        assert server.engine is not None
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = body.get("model") or server.model_name
        obj = "chat.completion" if chat else "text_completion"
        usage_requested = bool((body.get("stream_options") or {}).get("include_usage"))
        usage_requested = usage_requested and not never_usage
        max_new, reason = length(max_new, body.get("ignore_eos", False))

        def usage(done: int) -> dict[str, int]:
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": done,
                "total_tokens": prompt_tokens + done,
            }

        if body.get("stream"):

            async def chunks() -> AsyncIterator[dict[str, Any]]:
                done = 0
                first = True
                async for n in server.engine.generate(prompt_tokens, max_new):  # type: ignore[union-attr]
                    piece = "".join(piece_of(i, pieces) for i in next_ids(last, done, n, pieces))
                    done += n
                    finish = reason if done >= max_new else None
                    if chat:
                        delta: dict[str, Any] = {"content": piece}
                        if first:
                            delta["role"] = "assistant"
                        choice: dict[str, Any] = {"index": 0, "delta": delta}
                    else:
                        choice = {"index": 0, "text": piece}
                    choice["finish_reason"] = finish
                    first = False
                    yield {
                        "id": cid,
                        "object": obj + (".chunk" if chat else ""),
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                if usage_requested:
                    yield {
                        "id": cid,
                        "object": obj + (".chunk" if chat else ""),
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage(done),
                    }

            return sse(chunks(), malformed)
        done = 0
        text = ""
        async for n in server.engine.generate(prompt_tokens, max_new):
            text += "".join(piece_of(i, pieces) for i in next_ids(last, done, n, pieces))
            done += n
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        choice["finish_reason"] = reason
        return JSONResponse(
            {
                "id": cid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage(done),
            }
        )

    async def tokenize_route(request: Request) -> Response:
        """SGLang's /tokenize: a prompt (or a list of them) to token ids."""
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        prompt = body.get("prompt")
        if isinstance(body.get("messages"), list):  # rendered as for a chat completion
            rendered = chat_ids(body["messages"])
            return JSONResponse({"tokens": rendered, "count": len(rendered), "max_model_len": 4096})
        if isinstance(prompt, list):
            tokens: Any = [tokenize(str(p), pieces) for p in prompt]
            count: Any = [len(t) for t in tokens]
        elif isinstance(prompt, str):
            tokens = tokenize(prompt, pieces)
            count = len(tokens)
        else:
            return JSONResponse({"error": "prompt must be a string or a list"}, status_code=400)
        return JSONResponse({"tokens": tokens, "count": count, "max_model_len": 4096})

    async def detokenize_route(request: Request) -> Response:
        """SGLang's /detokenize: token ids (or a list of lists) to text."""
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            return JSONResponse({"error": "tokens must be a list"}, status_code=400)
        if tokens and isinstance(tokens[0], list):
            return JSONResponse({"text": [detokenize(t, pieces) for t in tokens]})
        return JSONResponse({"text": detokenize(tokens, pieces)})

    return [
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/v1/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
        Route("/v1/detokenize", detokenize_route, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
