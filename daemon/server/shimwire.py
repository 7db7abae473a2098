"""The shim's wire: frames on a local stream socket between the shim (`shim.py`) and the
daemon. Standard library only and no package imports: the shim loads this file by its path.

A frame is a 5-byte header (payload length, big-endian u32; kind, u8) and its payload:

* `JSON` (0): one JSON object. A request names its `op` and a `req` number that its reply
  carries back; a notice names its `event` (`exit`, `closed`, `dropped`, and from 1.1 on
  `write`: the log's writes failing, `error`, or working again, null).
* `OUTPUT` (1): a launch's output as written to its log, whole lines: a u8 stream (1 stdout,
  2 stderr), a u16 length and the launch id, then the bytes.

`VERSION` is the protocol's: a daemon adopts servers from a shim of the same major version,
whichever release of gpuwarden started it (`hello` answers the shim's). A minor version adds
only what the other side may ignore (1.1: the `write` notice and a server's `write_error`).
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any

VERSION = (1, 1)
JSON, OUTPUT = 0, 1
HEADER = struct.Struct("!IB")
OUT_HEADER = struct.Struct("!BH")
MAX_FRAME = 16 * 1024 * 1024  # a request or notice larger than this is a broken peer


LAUNCH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def spawn_request(msg: dict[str, Any]) -> dict[str, Any]:
    """A `spawn` request's fields, checked before anything is made of them (ValueError)."""
    launch_id = msg.get("launch_id")
    if not isinstance(launch_id, str) or not LAUNCH_ID.fullmatch(launch_id):
        raise ValueError(f"launch_id must match {LAUNCH_ID.pattern}")
    argv, env, log = msg.get("argv"), msg.get("env") or {}, msg.get("log")
    if not isinstance(argv, list) or not argv or not all(_arg(a) for a in argv):
        raise ValueError("argv must be a non-empty list of strings without NUL")
    path = msg.get("path") or argv[0]
    if not isinstance(env, dict) or not all(
        _arg(k) and k and "=" not in k and _arg(v) for k, v in env.items()
    ):
        raise ValueError("env must map names (no '=', no NUL) to strings without NUL")
    if not _arg(log) or not log or not _arg(path):
        raise ValueError("log and path must be strings without NUL")
    max_bytes = msg.get("max_bytes")
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 1):
        raise ValueError("max_bytes must be a positive integer or null")
    head = msg.get("head") or ""
    if not isinstance(head, str):
        raise ValueError("head must be a string")
    token = str(msg.get("token") or "")
    return {
        "launch_id": launch_id,
        "token": token,
        "argv": argv,
        "env": env,
        "path": path,
        "log": log,
        "max_bytes": max_bytes,
        "head": head.encode(errors="replace"),
    }


def _arg(value: Any) -> bool:
    """A string exec and the filesystem take: no NUL, encodable as the OS encodes names."""
    if not isinstance(value, str) or "\0" in value:
        return False
    try:
        value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def json_frame(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(len(payload), JSON) + payload


def output_frame(launch_id: str, stream: int, data: bytes) -> bytes:
    return b"".join(output_parts(launch_id, stream, data))


def output_parts(launch_id: str, stream: int, data: bytes) -> tuple[bytes, bytes]:
    """An output frame as its prefix and its data, for a gathered send (no copy of the data)."""
    key = launch_id.encode()
    head = OUT_HEADER.pack(stream, len(key)) + key
    return HEADER.pack(len(head) + len(data), OUTPUT) + head, data


class Reader:
    """Frames out of a byte stream, as its bytes arrive (`feed` returns the whole ones)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, Any]]:
        """`(JSON, dict)` or `(OUTPUT, (launch_id, stream, bytes))` for each whole frame.
        Raises ValueError for a frame that is too large or does not decode, whatever its
        bytes."""
        try:
            return self._feed(data)
        except (ValueError, struct.error, RecursionError, UnicodeDecodeError) as exc:
            raise ValueError(f"a broken frame: {exc!r}") from None

    def _feed(self, data: bytes) -> list[tuple[int, Any]]:
        self._buf += data
        frames: list[tuple[int, Any]] = []
        while len(self._buf) >= HEADER.size:
            size, kind = HEADER.unpack_from(self._buf)
            if size > MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes")
            end = HEADER.size + size
            if len(self._buf) < end:
                break
            payload = bytes(self._buf[HEADER.size : end])
            del self._buf[:end]
            if kind == JSON:
                message = json.loads(payload)
                if not isinstance(message, dict):
                    raise ValueError("a JSON frame that is not an object")
                frames.append((JSON, message))
            elif kind == OUTPUT:
                stream, key_len = OUT_HEADER.unpack_from(payload)
                start = OUT_HEADER.size
                key = payload[start : start + key_len].decode()
                frames.append((OUTPUT, (key, stream, payload[start + key_len :])))
            else:
                raise ValueError(f"a frame of unknown kind {kind}")
        return frames
