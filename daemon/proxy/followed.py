"""The streams the proxy follows so that a cut one can go on (`continue_streams`): what the
client has of each, the request that continues it, and the next server's events rewritten to
continue the client's. `resume.py` runs them.

A native `/generate` stream (`Followed`): SGLang streams its token ids (`output_ids`) and
takes `input_ids`, so the continuation is token-exact: prompt + the ids the client has. Text:
SGLang's detokenizer holds back tokens whose text is not whole UTF-8 yet, and a resumed
request's text starts after its prompt, so text held back would be lost; the stream therefore
resumes after the last k tokens whose text the client has whole (the text of ids[:k], decoded
after the prompt's last 5 ids as SGLang's detokenizer starts, is a prefix of what was sent).
Tokens after k are generated again (the same, under greedy decoding); only text the client
lacks is passed on.

An OpenAI stream (`openai.py`): SGLang 0.5.23 returns no token ids on a stream (it refuses
`return_token_ids` with `stream`), so the text the client has is re-tokenized with the model's
own tokenizer (the next server's `/tokenize`) and must decode back to itself; see there.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from .wire import split_events

CONTEXT_IDS = 5  # SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET
MAX_BACK = 8  # tokens tried back from the last one for a whole-text boundary
DEFAULT_MAX_NEW = 128  # SGLang's max_new_tokens default
REPLACEMENT = "\ufffd"

Call = Callable[[str, dict[str, Any]], Awaitable[Any]]  # a JSON request to the next server
Base = tuple[list[int], str]  # the ids and text a continuation starts after
State = tuple[list[int], str, bool | None]  # the continuation's ids and text so far
Continuation = tuple[dict[str, Any] | None, Base]


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

    @property
    def tokens_sent(self) -> int:
        return len(self.ids)

    def saw(self, data: bytes) -> None:
        for event in data_events(data):
            if self.broken:
                return
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

    async def continuation(self, call: Call) -> Continuation:
        """The request that goes on from here, and the ids and text it starts after."""
        body, followed = self.body, self
        given = body.get("input_ids")
        if isinstance(given, list) and given and all(isinstance(i, int) for i in given):
            prompt = list(given)
        else:
            answer = await call("/tokenize", {"prompt": body.get("text") or ""})
            prompt = [int(i) for i in answer["tokens"]]
        ctx, ids = prompt[-CONTEXT_IDS:], followed.ids
        ks = list(range(len(ids), max(-1, len(ids) - MAX_BACK - 1), -1))
        texts = (await call("/detokenize", {"tokens": [ctx] + [ctx + ids[:k] for k in ks]}))["text"]
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

    def rewrite(self, base: Base, state: State, obj: dict[str, Any]) -> bytes | None:
        """One event of the next server as the client's stream goes on (None: nothing new)."""
        followed = self
        ids, text = base[0] + state[0], base[1] + state[1]
        meta = dict(obj.get("meta_info") or {})
        finished = meta.get("finish_reason") is not None
        if len(ids) <= len(followed.ids) and not finished:
            return None  # (tokens the client has, generated again)
        if not text.startswith(followed.text) or ids[: len(followed.ids)] != followed.ids:
            raise ValueError("the next server's output does not go on from what was sent")
        new_ids, new_text = ids[len(followed.ids) :], text[len(followed.text) :]
        if followed.first_id is None:  # (cut before its first event: the next server's own)
            followed.first_id, followed.prompt_tokens = meta.get("id"), meta.get("prompt_tokens")
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

    def closing(self) -> list[bytes]:
        return []


def data_events(data: bytes) -> list[bytes]:
    """The data of the events in `data` but the stream's end (`[DONE]`)."""
    return [event for event in split_events(data) if event != b"[DONE]"]


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
