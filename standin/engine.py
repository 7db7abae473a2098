"""The engine client: SGLang's TokenizerManager, reduced to what can be observed.

`EngineClient` sends requests to rank 0's batch loop over its pipe and reads the loop's
answers on a thread, handing each request's new tokens to its queue on the event loop;
`ServerState` is what the routes and the signal handlers share (Starting, Up or UnHealthy,
draining, the last heartbeat and the loop's stats). The tokenizer and the greedy decode are a
toy's (`tokenize`, `next_ids`): each token follows from the context's last one, so a decode
resumed from its prompt and its first k tokens goes on exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven tired engineers tune speculative "
    "decoding on eight GPUs and count tokens per second until the drafter learns"
).split()


@dataclass
class ServerState:
    status: str = "Starting"  # Starting | Up | UnHealthy
    gracefully_exit: bool = False
    first_request_seen: bool = False
    last_heartbeat: float = field(default_factory=time.time)
    stats: dict[str, Any] = field(default_factory=dict)


class EngineClient:
    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, state: ServerState):
        self.conn = conn
        self.loop = loop
        self.state = state
        self.streams: dict[str, asyncio.Queue[tuple[int, bool]]] = {}
        self._send_lock = threading.Lock()
        threading.Thread(target=self._reader, name="engine-reader", daemon=True).start()

    def _reader(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return  # the scheduler is gone; 0.5.5 is not told (SGLANG.md §2)
            self.loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "out":
            self.state.last_heartbeat = time.time()
            for rid, n, finished in msg[1]:
                queue = self.streams.get(rid)
                if queue is not None:
                    queue.put_nowait((n, finished))
        elif msg[0] == "stats":
            self.state.stats.update(msg[1])

    def send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self.conn.send(msg)

    async def generate(self, prompt_tokens: int, max_new_tokens: int) -> AsyncGenerator[int, None]:
        """Yields the number of new tokens of each step until the request finishes."""
        rid = uuid.uuid4().hex
        queue: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        self.streams[rid] = queue
        finished = False
        self.send(("gen", rid, max(1, prompt_tokens), max(1, max_new_tokens)))
        try:
            while not finished:
                n, finished = await queue.get()
                yield n
        finally:
            self.streams.pop(rid, None)
            if not finished:
                self.send(("abort", rid))


def vocab_size(pieces: bool = False) -> int:
    """The stand-in's vocabulary: a token per word (with `pieces`, per half word)."""
    return len(WORDS) * (2 if pieces else 1)


def piece_of(token_id: int, pieces: bool = False) -> str:
    """A token's text: its word and a space, or with `pieces` half a word (the second half
    carries the space), so that words are not tokens."""
    if not pieces:
        return WORDS[token_id % len(WORDS)] + " "
    i = token_id % vocab_size(True)
    word = WORDS[i // 2]
    cut = max(1, len(word) // 2)
    return word[:cut] if i % 2 == 0 else word[cut:] + " "


def next_ids(context_last: int | None, start: int, count: int, pieces: bool = False) -> list[int]:
    """Tokens start..start+count of a greedy decode: each is the one after the context's last
    token (the sequence begins at token 0 after a prompt the vocabulary does not end), so a
    decode resumed from prompt + its first k tokens goes on with token k exactly."""
    size = vocab_size(pieces)
    first = 0 if context_last is None else (context_last + 1) % size
    return [(first + i) % size for i in range(start, start + count)]


def tokenize(text: str, pieces: bool = False) -> list[int]:
    """The stand-in's tokenizer: a known word is its token (or two, with `pieces`); an
    unknown one is the vocabulary's last token."""
    out = []
    for word in text.split():
        if word in WORDS:
            i = WORDS.index(word)
            out += [2 * i, 2 * i + 1] if pieces else [i]
        else:
            out.append(vocab_size(pieces) - 1)
    return out


def detokenize(ids: list[int], pieces: bool = False) -> str:
    return "".join(piece_of(int(i), pieces) for i in ids)
