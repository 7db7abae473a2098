"""Reading files that someone else may have replaced: regular files only, bounded.

Every file the daemon reads (configs, settings, ``state.json``, ``events.jsonl``, the token file,
launch logs) lives where an operator, an editor crash or an attacker can put anything in its
place. A FIFO blocks ``open()`` for ever (no writer); ``/dev/zero`` or ``/dev/urandom`` never ends;
an 18 MB config is not a config. So the open never blocks (``O_NONBLOCK``: a FIFO opens at once
and is then refused), anything but a regular file is refused, and reads stop at a limit. Refusals
are ``OSError``s with a readable ``strerror``, so callers report them like any unreadable file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import yaml

# What a file is, in words, for the refusal.
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


class RefusedFile(OSError):
    """A path that is not a regular file, or a file over its limit."""


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor on `path` if it is a regular file; never blocks on a FIFO."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, limit: int) -> bytes:
    """All of a regular file of at most `limit` bytes."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise RefusedFile(errno.EFBIG, f"too large ({size} bytes; the limit is {limit})")
        chunks: list[bytes] = []
        total = 0
        # The size can change under us (a file still being written): read to the limit, no more.
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise RefusedFile(errno.EFBIG, f"too large (over the limit of {limit} bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_regular_tail(path: Path, max_bytes: int) -> bytes:
    """The last `max_bytes` bytes (at most) of a regular file."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - max_bytes), os.SEEK_SET)
        chunks: list[bytes] = []
        total = 0
        while total < max_bytes and (chunk := os.read(fd, min(1 << 20, max_bytes - total))):
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_regular_text(path: Path, limit: int) -> str:
    """A regular file's text, strict UTF-8 (an undecodable file is an error, not mojibake)."""
    data = read_regular(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RefusedFile(
            errno.EILSEQ,
            f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
        ) from None


# -- YAML with limits -----------------------------------------------------------------------------

# A config is a few hundred lines. These bound what a hostile one costs before it is refused:
# nesting (PyYAML's constructor recurses: 20,000 levels raise RecursionError) and the node count
# with aliases expanded (a 391-byte "billion laughs" expands to gigabytes once anything walks it).
YAML_MAX_DEPTH = 64
YAML_MAX_NODES = 100_000


class YamlLimit(ValueError):
    """A YAML document beyond the limits; the message says which and where."""


def _events_loader() -> type[yaml.SafeLoader]:
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def check_yaml_limits(text: str) -> None:
    """Refuse documents nested deeper than YAML_MAX_DEPTH or expanding past YAML_MAX_NODES.

    Walks the parser's events (flat, no recursion, nothing built): each anchored node's expanded
    size is remembered, so an alias costs what it would expand to. Syntax errors are left for
    the real load to report with its line.
    """
    sizes: dict[str, int] = {}
    # One entry per open collection: its anchor and its expanded size so far.
    open_nodes: list[tuple[str | None, int]] = []
    total = 0

    def count(n: int) -> None:
        """`n` more nodes in the document, inside the innermost open collection."""
        nonlocal total
        total += n
        if total > YAML_MAX_NODES:
            raise YamlLimit(f"more than {YAML_MAX_NODES} nodes once aliases are expanded")
        if open_nodes:
            anchor, size = open_nodes[-1]
            open_nodes[-1] = (anchor, size + n)

    try:
        for event in yaml.parse(text, Loader=_events_loader()):
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_nodes) >= YAML_MAX_DEPTH:
                    line = event.start_mark.line + 1 if event.start_mark else "?"
                    raise YamlLimit(f"line {line}: nested deeper than {YAML_MAX_DEPTH} levels")
                count(1)
                open_nodes.append((event.anchor, 1))
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, size = open_nodes.pop()
                if anchor is not None:
                    sizes[anchor] = size
                if open_nodes:  # already counted in `total`; the parent's size grows by it
                    parent, psize = open_nodes[-1]
                    open_nodes[-1] = (parent, psize + size)
            elif isinstance(event, yaml.ScalarEvent):
                if event.anchor is not None:
                    sizes[event.anchor] = 1
                count(1)
            elif isinstance(event, yaml.AliasEvent):
                count(sizes.get(event.anchor or "", 1))
    except yaml.YAMLError:
        return  # the load reports it, with its line


def load_yaml(text: str) -> Any:
    """`yaml.safe_load` after the limits above."""
    check_yaml_limits(text)
    try:
        return yaml.safe_load(text)
    except RecursionError:  # a broken document nested deep enough to stop the event walk early
        raise YamlLimit(f"nested deeper than {YAML_MAX_DEPTH} levels") from None
