"""Continuing a `/generate` stream cut by a dead server on the next one (`continue_streams`).

SGLang's native `/generate` streams carry the token ids generated so far (`output_ids`) and take
`input_ids`. A stream the proxy passes on is followed (the ids and the text its client has);
when its server dies mid-stream the request waits for the next server (as a held request, for
the same model only), which is asked for the prompt's ids (`/tokenize`, unless the request
gave `input_ids`), and is sent prompt + generated ids with the remaining `max_new_tokens`. Its
stream is spliced in: each event is rewritten to continue the client's (the whole text and ids
so far, or the deltas where the server streams deltas; the counts; the first request's id), so
the client sees one stream: under greedy decoding, the one it would have got.

Text: SGLang's detokenizer holds back tokens whose text is not whole UTF-8 yet, and a resumed
request's text starts after its prompt, so text held back would be lost. The stream therefore
resumes after the last k tokens whose text the client has whole: the largest k for which the
text of ids[:k] (decoded after the prompt's last 5 ids, as SGLang's detokenizer starts) is a
prefix of what was sent. Tokens after k are generated again (the same, under greedy decoding);
only text the client lacks is passed on.

The OpenAI routes are not continued: SGLang 0.5.23 returns no token ids on a stream (it refuses
`return_token_ids` with `stream`), and re-tokenized text is not token-exact. Their cut streams
end with an error event.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from .wire import LAST_CHUNK, Body, Events, Request, chunk, parse_head, split_events, status_of

if TYPE_CHECKING:
    from .front import Pool
    from .gate import Gate

CONTEXT_IDS = 5  # SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET
MAX_BACK = 8  # tokens tried back from the last one for a whole-text boundary
MAX_RESUMES = 3  # a stream continued this often and cut again ends with an error event
DEFAULT_MAX_NEW = 128  # SGLang's max_new_tokens default
REPLACEMENT = "\ufffd"


class CannotResume(Exception):
    """The stream cannot go on: it ends with an error event (the reason is its message)."""


class Followed:
    """A `/generate` stream as its client has it."""

    def __init__(self, body: dict[str, Any], model: str | None) -> None:
        self.body, self.model = body, model
        self.ids: list[int] = []
        self.text = ""
        self.incremental: bool | None = None  # None: not known yet (one event seen)
        self.first_id: Any = None
        self.prompt_tokens: Any = None
        self.broken: str | None = None  # why it cannot be followed
        self.resumes = 0

    def saw(self, data: bytes) -> None:
        for event in split_events(data):
            if event == b"[DONE]" or self.broken:
                continue
            try:
                obj = json.loads(event)
                self.ids, self.text, self.incremental = merged(
                    self.ids, self.text, self.incremental, obj
                )
            except (ValueError, TypeError, KeyError) as exc:
                self.broken = f"an event without what a resume needs ({exc})"
                continue
            meta = obj.get("meta_info") or {}
            if self.first_id is None:
                self.first_id, self.prompt_tokens = meta.get("id"), meta.get("prompt_tokens")


def merged(
    ids: list[int], text: str, incremental: bool | None, obj: dict[str, Any]
) -> tuple[list[int], str, bool | None]:
    """The ids and text after one event: SGLang streams the whole output so far, or (with
    --incremental-streaming-output) the new part, told apart by `completion_tokens`."""
    out, piece = obj["output_ids"], obj.get("text") or ""
    if not isinstance(out, list) or not isinstance(piece, str):
        raise TypeError("output_ids or text of the wrong type")
    done = (obj.get("meta_info") or {}).get("completion_tokens")
    if incremental is None and ids and isinstance(done, int):
        incremental = len(out) != done
    if incremental:
        return ids + out, text + piece, True
    return list(out), piece, incremental if ids else None


def follow(request: Request, model: str | None) -> Followed | None:
    """A `/generate` stream request is followed; anything else is not."""
    if request.method != b"POST" or request.target.split(b"?")[0] != b"/generate":
        return None
    try:
        body = json.loads(request.body)
    except ValueError:
        return None
    if not isinstance(body, dict) or not body.get("stream"):
        return None
    if "text" not in body and "input_ids" not in body:
        return None
    if isinstance(body.get("text"), list) or body.get("n", 1) != 1:
        return None  # (a batch, or several samples: not one stream to continue)
    return Followed(body, model)


class Resumer:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def resume(self, followed: Followed, pool: Pool, writer: asyncio.StreamWriter) -> None:
        """Continue `followed` on the next server, writing its events to `writer` (chunked).
        Raises CannotResume (the caller ends the stream with an error event)."""
        while True:
            followed.resumes += 1
            if followed.broken or followed.resumes > MAX_RESUMES:
                raise CannotResume(followed.broken or f"cut {MAX_RESUMES} times")
            try:
                address = await self.gate.admit(time.monotonic(), len(followed.ids) * 8, None)
            except Exception as exc:  # Rejected: no server comes back
                raise CannotResume(str(exc)) from None
            if self.gate.model != followed.model:
                raise CannotResume(
                    f"the next server serves {self.gate.model}, not {followed.model}"
                )
            try:
                body, base = await self._continuation(followed, pool, address)
            except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                self.gate.refused(address)
                if isinstance(exc, OSError):
                    continue
                raise CannotResume(f"the next server could not be asked: {exc}") from None
            if body is None:  # nothing was left to generate
                writer.write(chunk(b"data: [DONE]\n\n") + LAST_CHUNK)
                return
            self.gate.counters.continued += 1
            self.gate.counters.last_resume = {
                "from_token": len(base[0]),  # generated again from here (0-based)
                "client_had": len(followed.ids),
                "at": time.time(),
            }
            try:
                await self._splice(followed, pool, address, (body, base), writer)
                return
            except OSError:
                self.gate.refused(address)  # cut again: once more, from where it is now

    async def _continuation(
        self, followed: Followed, pool: Pool, address: tuple[str, int]
    ) -> tuple[dict[str, Any] | None, tuple[list[int], str]]:
        """The request that goes on from `followed`, and the ids and text it starts after."""
        body = followed.body
        given = body.get("input_ids")
        if isinstance(given, list) and given and all(isinstance(i, int) for i in given):
            prompt = list(given)
        else:
            answer = await _call(pool, address, "/tokenize", {"prompt": body.get("text") or ""})
            prompt = [int(i) for i in answer["tokens"]]
        ctx, ids = prompt[-CONTEXT_IDS:], followed.ids
        ks = list(range(len(ids), max(-1, len(ids) - MAX_BACK - 1), -1))
        texts = (
            await _call(
                pool, address, "/detokenize", {"tokens": [ctx] + [ctx + ids[:k] for k in ks]}
            )
        )["text"]
        lead = texts[0]
        whole = [
            (k, text[len(lead) :])
            for k, text in zip(ks, texts[1:], strict=True)
            if text.startswith(lead) and not text.endswith(REPLACEMENT)
        ]
        found = next(((k, t) for k, t in whole if followed.text.startswith(t)), None)
        if found is None:
            raise ValueError("no boundary whose text the client has whole")
        k, sent = found
        params = dict(body.get("sampling_params") or {})
        left = int(params.get("max_new_tokens", DEFAULT_MAX_NEW)) - k
        if left <= 0:
            return None, (ids[:k], sent)
        params["max_new_tokens"] = left
        cont = {key: v for key, v in body.items() if key not in ("text", "input_ids")}
        cont.update(input_ids=prompt + ids[:k], sampling_params=params, stream=True)
        return cont, (ids[:k], sent)

    async def _splice(
        self,
        followed: Followed,
        pool: Pool,
        address: tuple[str, int],
        continuation: tuple[dict[str, Any], tuple[list[int], str]],
        writer: asyncio.StreamWriter,
    ) -> None:
        body, base = continuation
        conn, _ = await pool.get(address)
        data = json.dumps(body).encode()
        conn.writer.write(
            b"POST /generate HTTP/1.1\r\nhost: gpuwarden\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(data), data)
        )
        try:
            head_bytes = await conn.inb.head()
            if head_bytes is None:
                raise ConnectionResetError("the server closed the connection")
            head = parse_head(head_bytes)
            if status_of(head) != 200:
                raise CannotResume(f"the next server answered {status_of(head)}")
            framing = (
                Body("chunked", 0)
                if b"chunked" in head.tokens(b"transfer-encoding")
                else Body("close", 0)
            )
            events = Events()
            state: tuple[list[int], str, bool | None] = ([], "", None)
            while True:
                for event in split_events(events.feed(framing.feed(conn.inb.buf))):
                    if event == b"[DONE]":
                        writer.write(chunk(b"data: [DONE]\n\n") + LAST_CHUNK)
                        conn.close()
                        return
                    state = merged(*state, json.loads(event))
                    out = self._rewritten(followed, base, state, json.loads(event))
                    if out is not None:
                        writer.write(chunk(b"data: " + out + b"\n\n"))
                        await writer.drain()
                if framing.done or not await conn.inb.fill():
                    raise ConnectionResetError("the server closed the connection mid-stream")
        except (ValueError, TypeError, KeyError) as exc:
            conn.close()
            raise CannotResume(f"the next server's stream: {exc}") from None
        except BaseException:
            conn.close()
            raise

    def _rewritten(
        self,
        followed: Followed,
        base: tuple[list[int], str],
        state: tuple[list[int], str, bool | None],
        obj: dict[str, Any],
    ) -> bytes | None:
        """One event of the next server as the client's stream goes on (None: nothing new)."""
        ids, text = base[0] + state[0], base[1] + state[1]
        meta = dict(obj.get("meta_info") or {})
        finished = meta.get("finish_reason") is not None
        if len(ids) <= len(followed.ids) and not finished:
            return None  # (tokens the client has, generated again)
        if not text.startswith(followed.text) or ids[: len(followed.ids)] != followed.ids:
            raise ValueError("the next server's output does not go on from what was sent")
        new_ids, new_text = ids[len(followed.ids) :], text[len(followed.text) :]
        meta.update(
            id=followed.first_id, prompt_tokens=followed.prompt_tokens, completion_tokens=len(ids)
        )
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "length":
            meta["finish_reason"] = {**reason, "length": len(ids)}
        if followed.incremental:
            obj.update(text=new_text, output_ids=new_ids, meta_info=meta)
        else:
            obj.update(text=text, output_ids=ids, meta_info=meta)
        followed.ids, followed.text = ids, text
        return json.dumps(obj).encode()


async def _call(pool: Pool, address: tuple[str, int], path: str, payload: dict[str, Any]) -> Any:
    """One small JSON request to the server (its tokenizer's routes)."""
    conn, _ = await pool.get(address)
    try:
        data = json.dumps(payload).encode()
        conn.writer.write(
            b"POST %s HTTP/1.1\r\nhost: gpuwarden\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
        )
        head_bytes = await conn.inb.head()
        if head_bytes is None:
            raise ConnectionResetError("the server closed the connection")
        head = parse_head(head_bytes)
        if status_of(head) != 200:
            raise ValueError(f"{path} answered {status_of(head)}")
        length = head.get(b"content-length")
        if length is None or not length.isdigit():
            raise ValueError(f"{path} answered without a length")
        answer = json.loads(await conn.inb.exactly(int(length)))
    except BaseException:
        conn.close()
        raise
    pool.put(conn)
    return answer
