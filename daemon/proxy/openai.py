"""An OpenAI stream (`/v1/chat/completions`, `/v1/completions`) followed so that a cut one can
go on (`continue_streams`).

SGLang 0.5.23 returns no token ids on an OpenAI stream (it refuses `return_token_ids` with
`stream`), so this follower re-tokenizes: the prompt as the server renders it for the request
(`/tokenize` with the messages, or the completion's prompt), and the text the client has with
the model's own tokenizer (`/tokenize`, no special tokens). That is token-exact only where the
tokenizer gives the generated text back as the ids the model generated, so the ids must at
least decode back to exactly their text (checked with `/detokenize`): the text sent, or it cut
at one of its last spaces (a word cut in two rarely tokenizes as it was generated), the rest
being generated again; where none does, the stream ends with an error event rather than go
on from something else. The continuation is a native
`/generate` of prompt + those ids with the request's sampling parameters and the tokens left,
and its events are rewritten as the stream's chunks (its id, created, model; `delta.content` or
`text`; the finish reason; the usage chunk where the request asked for one).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .followed import CONTEXT_IDS, Base, Call, Continuation, State, data_events

OPENAI = (b"/v1/chat/completions", b"/v1/completions")
# OpenAI's request fields that are SGLang's sampling parameters of the same name.
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "regex",
    "ebnf",
)
# What the chat template sees besides the messages.
TEMPLATE = ("tools", "tool_choice", "chat_template_kwargs", "reasoning_effort")
MAX_CUTS = 4  # of the text's last spaces, where a re-tokenized prefix may end
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions


class FollowedOpenAI:
    """An OpenAI stream as its client has it: the text so far and the first chunk's fields."""

    def __init__(self, body: dict[str, Any], model: str | None, *, chat: bool) -> None:
        self.body, self.model, self.chat = body, model, chat
        self.text = ""
        self.first: dict[str, Any] | None = None  # id, object, created, model of the stream
        # Logprobs and several choices have no native form the proxy rewrites.
        many = body.get("logprobs") or body.get("top_logprobs") or (body.get("best_of") or 1) != 1
        self.broken: str | None = "logprobs or best_of are not continued" if many else None
        self.resumes = 0
        self.tokens_sent = 0  # as re-tokenized at the last resume
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def saw(self, data: bytes) -> None:
        for event in data_events(data):
            if self.broken:
                return
            try:
                obj = json.loads(event)
                if "error" in obj:
                    self.broken = "the stream carried an error"
                    continue
                if self.first is None:
                    keys = ("id", "object", "created", "model", "system_fingerprint")
                    self.first = {k: obj[k] for k in keys if k in obj}
                for choice in obj.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("tool_calls") or delta.get("reasoning_content"):
                        self.broken = "tool calls and reasoning are not continued"
                    piece = delta.get("content") if self.chat else choice.get("text")
                    if piece:
                        self.text += str(piece)
            except (ValueError, TypeError, AttributeError) as exc:
                self.broken = f"an event the proxy cannot read ({exc})"

    async def continuation(self, call: Call) -> Continuation:
        body = self.body
        if self.chat:
            ask = {"messages": body["messages"], **{k: body[k] for k in TEMPLATE if k in body}}
            answer = await call("/tokenize", ask)
        elif isinstance(body.get("prompt"), str):
            answer = await call("/tokenize", {"prompt": body["prompt"]})
        elif isinstance(body.get("prompt"), list) and all(
            isinstance(i, int) for i in body["prompt"]
        ):
            answer = {"tokens": body["prompt"], "max_model_len": None}
        else:
            raise ValueError("a prompt that is not one string or one list of token ids")
        prompt = [int(i) for i in answer["tokens"]]
        ids, sent = await self._boundary(call, prompt[-CONTEXT_IDS:])
        self.tokens_sent, self.prompt_tokens = len(ids), len(prompt)
        wanted = body.get("max_completion_tokens") or body.get("max_tokens")
        if wanted is None:
            limit = answer.get("max_model_len")
            wanted = int(limit) - len(prompt) if self.chat and limit else COMPLETIONS_MAX_TOKENS
        left = int(wanted) - len(ids)
        if left <= 0:
            return None, (ids, sent)
        params = {k: body[k] for k in SAMPLING if body.get(k) is not None}
        params["max_new_tokens"] = left
        return {"input_ids": prompt + ids, "sampling_params": params, "stream": True}, (ids, sent)

    async def _boundary(self, call: Call, ctx: list[int]) -> tuple[list[int], str]:
        """The longest of the text sent, or of it cut at one of its last spaces, whose
        re-tokenized ids decode back to exactly it (after the prompt's last ids, as SGLang
        decodes): those ids, and that text. The rest is generated again."""
        text = self.text
        cuts = {len(text)}
        for at in [i for i, ch in enumerate(text) if ch.isspace()][-MAX_CUTS:]:
            cuts.update((at, at + 1))
        prefixes = [text[:n] for n in sorted(cuts, reverse=True) if n > 0]
        if not prefixes:
            return [], ""
        tokens = (await call("/tokenize", {"prompt": prefixes, "add_special_tokens": False}))[
            "tokens"
        ]
        decoded = (await call("/detokenize", {"tokens": [ctx] + [ctx + t for t in tokens]}))["text"]
        for prefix, ids, back in zip(prefixes, tokens, decoded[1:], strict=True):
            if back.startswith(decoded[0]) and back[len(decoded[0]) :] == prefix:
                return [int(i) for i in ids], prefix
        raise ValueError("no part of the text sent re-tokenizes to ids that decode back to it")

    def rewrite(self, base: Base, state: State, obj: dict[str, Any]) -> bytes | None:
        """A native event of the next server as the stream's next chunk (None: nothing new)."""
        text = base[1] + state[1]
        reason = (obj.get("meta_info") or {}).get("finish_reason")
        finish = None
        if isinstance(reason, dict):
            finish = "length" if reason.get("type") == "length" else "stop"
        if len(text) <= len(self.text) and self.text.startswith(text) and finish is None:
            return None  # (text the client has, generated again)
        if not text.startswith(self.text):
            raise ValueError("the next server's text does not go on from what was sent")
        delta = text[len(self.text) :]
        if not delta and finish is None:
            return None
        self.text = text
        self.completion_tokens = len(base[0]) + len(state[0])
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.first is None:  # (cut before its first chunk: this one is the stream's first)
            self.first = {
                "id": ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(time.time()),
                "model": self.body.get("model") or self.model,
            }
            if self.chat:
                choice["delta"] = {"role": "assistant", "content": delta}
        if self.chat:
            choice.setdefault("delta", {"content": delta})
        else:
            choice["text"] = delta
        return json.dumps({**(self.first or {}), "choices": [choice]}).encode()

    def closing(self) -> list[bytes]:
        """The usage chunk, where the request asked for one."""
        if not (self.body.get("stream_options") or {}).get("include_usage"):
            return []
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        return [json.dumps({**(self.first or {}), "choices": [], "usage": usage}).encode()]
