"""Continuing a stream cut by a dead server on the next one (`continue_streams`): the
request waits for the next server (as a held request, for the same model only), the stream's
continuation is sent there (`followed.py` says what it is), and its events are spliced into
the client's stream, so the client sees one stream.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import TYPE_CHECKING, Any

from .followed import Followed, merged
from .openai import OPENAI, FollowedOpenAI
from .wire import (
    LAST_CHUNK,
    BadMessage,
    Closed,
    Events,
    Head,
    Request,
    chunk,
    framing,
    parse_head,
    send,
    split_events,
    status_of,
    whole,
)

if TYPE_CHECKING:
    from .followed import Base
    from .gate import Gate
    from .pool import Pool, Upstream

MAX_RESUMES = 3  # a stream continued this often and cut again ends with an error event
MAX_ANSWER = 64 << 20  # bytes of a tokenizer route's answer, at most
MAX_ASKS = 20  # next servers that could not be asked for a continuation, at most
UNREACHED = (OSError, Closed, BadMessage, asyncio.IncompleteReadError)


class CannotResume(Exception):
    """The stream cannot go on: it ends with an error event (the reason is its message)."""


def follow(request: Request, model: str | None) -> Followed | FollowedOpenAI | None:
    """A stream request of `/generate` or the OpenAI completions is followed; nothing else."""
    path = request.target.split(b"?")[0]
    if request.method != b"POST" or path not in (b"/generate", *OPENAI):
        return None
    try:
        body = json.loads(request.body)
    except ValueError:
        return None
    if not isinstance(body, dict) or not body.get("stream") or body.get("n", 1) != 1:
        return None
    if path in OPENAI:
        return FollowedOpenAI(body, model, chat=path == b"/v1/chat/completions")
    if "text" not in body and "input_ids" not in body:
        return None
    if isinstance(body.get("text"), list):
        return None  # (a batch: not one stream to continue)
    return Followed(body, model)


class Resumer:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def resume(
        self, followed: Followed | FollowedOpenAI, pool: Pool, writer: asyncio.StreamWriter
    ) -> None:
        """Continue `followed` on the next server, writing its events to `writer` (chunked).
        Raises CannotResume (the caller ends the stream with an error event)."""
        asks = 0
        while True:
            if followed.broken or followed.resumes >= MAX_RESUMES:
                raise CannotResume(followed.broken or f"cut {MAX_RESUMES} times")
            try:
                address = await self.gate.admit(time.monotonic(), len(followed.text), None)
            except Exception as exc:  # Rejected: no server comes back
                raise CannotResume(str(exc)) from None
            if self.gate.model != followed.model:
                raise CannotResume(
                    f"the next server serves {self.gate.model}, not {followed.model}"
                )
            try:
                body, base = await followed.continuation(functools.partial(_call, pool, address))
            except UNREACHED as exc:  # (its server died too, or is not up yet: the next one)
                self.gate.refused(address)
                asks += 1
                if asks >= MAX_ASKS:
                    raise CannotResume(f"the next server could not be asked: {exc}") from None
                continue
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise CannotResume(f"the next server's answer: {exc}") from None
            if body is None:  # nothing was left to generate
                await send(writer, _ending(followed))
                return
            followed.resumes += 1
            self.gate.counters.continued += 1
            self.gate.counters.last_resume = {
                "from_token": len(base[0]),  # generated again from here (0-based)
                "client_had": followed.tokens_sent,
                "at": time.time(),
            }
            try:
                await self._splice(followed, pool, address, (body, base), writer)
                return
            except UNREACHED:
                self.gate.refused(address)  # cut again: once more, from where it is now

    async def _splice(
        self,
        followed: Followed | FollowedOpenAI,
        pool: Pool,
        address: tuple[str, int],
        continuation: tuple[dict[str, Any], Base],
        writer: asyncio.StreamWriter,
    ) -> None:
        body, base = continuation
        conn, _ = await pool.get(address)
        try:
            head = await _post(conn, b"/generate", body)
            if status_of(head) != 200:
                raise CannotResume(f"the next server answered {status_of(head)}")
            framed = framing(head)
            events = Events()
            state: tuple[list[int], str, bool | None] = ([], "", None)
            while True:
                for event in split_events(events.feed(framed.feed(conn.inb.buf))):
                    if event == b"[DONE]":
                        conn.close()
                        await send(writer, _ending(followed))
                        return
                    state = merged(*state, json.loads(event))
                    out = followed.rewrite(base, state, json.loads(event))
                    if out is not None:
                        await send(writer, chunk(b"data: " + out + b"\n\n"))
                if framed.done or not await conn.inb.fill():
                    raise ConnectionResetError("the server closed the connection mid-stream")
        except (ValueError, TypeError, KeyError) as exc:
            conn.close()
            raise CannotResume(f"the next server's stream: {exc}") from None
        except BaseException:
            conn.close()
            raise


async def _call(pool: Pool, address: tuple[str, int], path: str, payload: dict[str, Any]) -> Any:
    """One small JSON request to the server (its tokenizer's routes)."""
    conn, _ = await pool.get(address)
    try:
        head = await _post(conn, path.encode(), payload)
        if status_of(head) != 200:
            raise ValueError(f"{path} answered {status_of(head)}")
        answer = json.loads(await whole(conn.inb, framing(head), MAX_ANSWER))
    except BaseException:
        conn.close()
        raise
    pool.put(conn)
    return answer


async def _post(conn: Upstream, path: bytes, payload: dict[str, Any]) -> Head:
    """POST `payload` as JSON on `conn`: the server's final answer head (1xx skipped)."""
    data = json.dumps(payload).encode()
    conn.writer.write(
        b"POST %s HTTP/1.1\r\nhost: gpuwarden\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (path, len(data), data)
    )
    while True:
        head_bytes = await conn.inb.head()
        if head_bytes is None:
            raise ConnectionResetError("the server closed the connection before answering")
        head = parse_head(head_bytes)
        if status_of(head) >= 200:
            return head


def _ending(followed: Followed | FollowedOpenAI) -> bytes:
    """What ends the client's stream: the follower's last events (usage), then [DONE]."""
    events = b"".join(b"data: " + e + b"\n\n" for e in followed.closing())
    return chunk(events + b"data: [DONE]\n\n") + LAST_CHUNK
