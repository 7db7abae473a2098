"""The shim's side of one client's connection: what is sent to it, what waits while its socket
takes nothing, and what is held back when it falls behind.

The shim never waits for a client. A frame the socket does not take now is queued (in order);
past `ROOM` queued, a server's output is no longer queued for it: the newest `TAIL_KEEP` bytes
of what is held back are kept (at least that, in whole chunks), and once the queue has drained
the client is told how many bytes it was not sent (the file has them), then sent those newest
ones. So a client that falls behind a flood loses its middle, never its end (a server's last
lines, its death line among them), and the notices and replies that came meanwhile keep their
place after the output before them (an exit is never heard before its last lines). Those are
never dropped: a client that lets them reach its room, or its queue twice that, goes.

Standard library only: the shim (`shim.py`) loads this file by its path.
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Callable
from typing import Any

ROOM = 8 * 1024 * 1024
TAIL_KEEP = 256 * 1024

Parts = tuple[bytes, ...]


class Client:
    def __init__(self, sock: socket.socket, reader: Any, note: Callable[[dict[str, Any]], bytes]):
        self.sock, self.reader, self.note = sock, reader, note
        self.out = bytearray()
        self.dropped: dict[str, int] = {}  # output not sent for want of room, by launch
        # What is held back, in order: output (its launch) and the notices between (None).
        self.tail: collections.deque[tuple[str | None, Parts, int]] = collections.deque()
        self.tail_bytes = 0  # the output's
        self.held_other = 0  # the notices' and replies'
        self.writing = False  # watched for its socket to take more (the shim's to set)

    def send(self, parts: Parts, output_of: str | None = None) -> bool | None:
        """Send `parts` now or queue them. True: something waits for the socket (watch it
        for writing); None: the client is to go (its socket failed, or it is far behind)."""
        size = sum(len(p) for p in parts)
        if output_of is not None and (self.dropped or len(self.out) + size > ROOM):
            self._hold(output_of, parts, size)  # (once holding back, until the queue drains)
            return bool(self.out)
        if self.dropped:  # a notice or a reply keeps its place after the output held back
            self.held_other += size
            self.tail.append((None, parts, size))
            return None if self.held_other > ROOM else bool(self.out)
        if len(self.out) + size > 2 * ROOM:  # nor replies: it goes
            return None
        if self.out:  # behind already: in order, after what waits
            for part in parts:
                self.out += part
            return True
        try:  # nothing waits: sent as it is, gathered (the output is not copied again)
            sent = self.sock.sendmsg(parts)
        except BlockingIOError:
            sent = 0
        except OSError:
            return None
        if sent == size:
            return False
        for part in parts:  # the rest waits for the socket
            if sent >= len(part):
                sent -= len(part)
                continue
            self.out += memoryview(part)[sent:]
            sent = 0
        return True

    def flush(self) -> bool | None:
        """The socket can take more: send what waits. As `send` answers."""
        try:
            sent = self.sock.send(self.out)
        except BlockingIOError:
            sent = 0
        except OSError:
            return None
        del self.out[:sent]
        if not self.out and self.dropped:  # drained: what was held back, said, then its end
            kept: dict[str | None, int] = {}
            for launch_id, _, size in self.tail:
                kept[launch_id] = kept.get(launch_id, 0) + size
            for launch_id, count in self.dropped.items():
                lost = count - kept.get(launch_id, 0)
                if lost:
                    said = {"event": "dropped", "launch_id": launch_id, "bytes": lost}
                    self.out += self.note(said)
            for _, parts, _ in self.tail:
                for part in parts:
                    self.out += part
            self.dropped, self.tail = {}, collections.deque()
            self.tail_bytes = self.held_other = 0
        return bool(self.out)

    def _hold(self, launch_id: str, parts: Parts, size: int) -> None:
        self.dropped[launch_id] = self.dropped.get(launch_id, 0) + size
        self.tail.append((launch_id, parts, size))
        self.tail_bytes += size
        while True:  # the oldest output goes while the newest TAIL_KEEP bytes stay (notices stay)
            i = next(i for i, held in enumerate(self.tail) if held[0] is not None)
            if self.tail_bytes - self.tail[i][2] < TAIL_KEEP:
                break  # (so the newest chunk is kept, however large)
            self.tail_bytes -= self.tail[i][2]
            del self.tail[i]
