"""A swap's page-cache pre-warm: the next config's weight files read into the page cache while
the old server still serves, so the new server's weight phase reads memory, not the disk.

Which files: `weightfiles.py`.

How (`read`, run in a thread at `SCHED_IDLE`, so it takes no CPU the serving server wants):
chunk by chunk, skipping what `mincore` says is in the page cache already; the kernel reads each
chunk in (`POSIX_FADV_WILLNEED`, no copy through the daemon) and `mlock` holds it there until
the swap settles (where locking is not allowed: plain reads, not held); at most
`max_read_mib_s`; never more than leaves `keep_free_ram_fraction` of RAM available (MemAvailable
as read when it begins), and given up at once when MemAvailable falls under that (other
processes need the memory: pressure), also while it holds. A cancel (a stop, the swap going on
without it) ends it within a chunk. Standard library and `ctypes` only; Linux.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .messages import EventNoted, PrewarmEnded

if TYPE_CHECKING:
    from .messages import Message
    from .model import PrewarmProgress
    from .settings import PrewarmSettings
    from .tasks import Tasks

MiB = 1024 * 1024
CHUNK = 8 * MiB
HOLD_CHECK_S = 1.0  # how often memory is looked at while pages are held


# -- the host's memory and page cache -----------------------------------------------------------


def meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    values: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values["MemAvailable"]


class _Libc:
    """`mmap`, `mincore`, `mlock` and `munmap` through ctypes."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        size, ptr, c_int = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
        self.mmap = libc.mmap
        self.mmap.restype = ptr
        self.mmap.argtypes = [ptr, size, c_int, c_int, c_int, ctypes.c_long]
        self.mincore = libc.mincore
        self.mincore.argtypes = [ptr, size, ctypes.c_char_p]
        self.mlock = libc.mlock
        self.mlock.argtypes = [ptr, size]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ptr, size]


_libc: _Libc | None = None


def _lib() -> _Libc | None:
    global _libc
    try:
        _libc = _libc or _Libc()
    except (OSError, AttributeError):
        return None
    return _libc


class FileMap:
    """A file mapped read-only: which of its chunks are in the page cache (`mincore`), and
    holding chunks there (`mlock`) until it is closed. Unmappable: nothing is known or held."""

    def __init__(self, fd: int, size: int) -> None:
        self.size, self.addr, self.page = size, None, mmap.PAGESIZE
        self.lib = lib = _lib()
        if lib is None or size == 0:
            return
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr not in (None, ctypes.c_void_p(-1).value):
            self.addr = addr

    def resident(self, offset: int, length: int) -> bool:
        """All of [offset, offset + length) is in the page cache."""
        if self.addr is None or self.lib is None:
            return False
        vec = ctypes.create_string_buffer((length + self.page - 1) // self.page)
        if self.lib.mincore(self.addr + offset, length, vec) != 0:
            return False
        return all(b & 1 for b in vec.raw)

    def hold(self, offset: int, length: int) -> bool:
        """Keep [offset, offset + length) in the page cache (False: not allowed, or no room)."""
        if self.addr is None or self.lib is None:
            return False
        return bool(self.lib.mlock(self.addr + offset, length) == 0)

    def close(self) -> None:
        """Unmapped (what it held is let go)."""
        if self.addr is not None and self.lib is not None:
            self.lib.munmap(self.addr, self.size)
            self.addr = None


class Held:
    """What a pre-warm holds in the page cache until the swap settles (the files' mappings,
    locked): the kernel cannot reclaim it before the new server has read it."""

    def __init__(self) -> None:
        self._maps: list[FileMap] = []
        self._lock = threading.Lock()
        self.bytes = 0

    def keep(self, mapping: FileMap, length: int) -> None:
        with self._lock:
            if mapping not in self._maps:
                self._maps.append(mapping)
            self.bytes += length

    def release(self) -> int:
        """Let all of it go; the bytes it held."""
        with self._lock:
            maps, self._maps = self._maps, []
            held, self.bytes = self.bytes, 0
        for mapping in maps:
            mapping.close()
        return held


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache (`POSIX_FADV_DONTNEED`; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- the read -------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


class _Reader:
    """One pre-warm's read, in its thread (see the module's docstring)."""

    def __init__(
        self,
        progress: PrewarmProgress,
        settings: PrewarmSettings,
        cancel: threading.Event,
        memory: Callable[[], tuple[int, int]],
        held: Held | None,
    ) -> None:
        self.progress, self.settings, self.cancel, self.memory = progress, settings, cancel, memory
        self.held = held  # None: nothing is held (read only)
        self.buf = bytearray(CHUNK)
        self.began = time.monotonic()
        total, self.available = memory()
        self.reserve = int(settings.keep_free_ram_fraction * total)
        self.budget = self.available - self.reserve
        self.used = 0  # of the budget

    def pressure(self, available: int) -> str:
        return (
            f"memory pressure: {_gib(available)} available, {_gib(self.reserve)} "
            f"({self.settings.keep_free_ram_fraction:.0%} of RAM) is kept free"
        )

    def run(self, files: Sequence[Path]) -> tuple[str, str]:
        p = self.progress
        sizes: list[tuple[Path, int]] = []
        for path in files:
            try:
                sizes.append((path, path.stat().st_size))
            except OSError as exc:
                return "failed", f"{path}: {exc.strerror or exc}"
        p.files, p.total_bytes = len(sizes), sum(n for _, n in sizes)
        if self.budget <= 0:
            return "abandoned", self.pressure(self.available)
        for path, size in sizes:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                return "failed", f"{path}: {exc.strerror or exc}"
            try:
                # No readahead on this descriptor: what is read is what the throttle counts.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                ended = self._file(fd, size)
            except OSError as exc:
                ended = "failed", f"{path}: {exc.strerror or exc}"
            finally:
                os.close(fd)
            if ended is not None:
                return ended
        return "done", (
            f"read {_gib(p.read_bytes)} in {time.monotonic() - self.began:.1f} s; "
            f"{_gib(p.cached_bytes)} was in the page cache already"
        )

    def _file(self, fd: int, size: int) -> tuple[str, str] | None:
        p = self.progress
        mapping = FileMap(fd, size)
        held = False
        try:
            offset = 0
            while offset < size:
                if self.cancel.is_set():
                    return "cancelled", "the swap went on without it"
                length = min(CHUNK, size - offset)
                cached = mapping.resident(offset, length)
                # What it adds to the page cache, or takes from what the kernel may reclaim.
                charge = length if not cached or self.held is not None else 0
                if self.used + charge > self.budget:
                    return "abandoned", (
                        f"read {_gib(p.read_bytes)} of {_gib(p.total_bytes)}: the rest would "
                        f"leave less than {self.settings.keep_free_ram_fraction:.0%} of RAM "
                        f"free ({_gib(self.available)} was available)"
                    )
                _, available = self.memory()
                if available < self.reserve:
                    return "abandoned", self.pressure(available)
                pinned = False
                if self.held is not None:
                    if not cached:  # the kernel reads it in: no copy through this process
                        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                    pinned = mapping.hold(offset, length)  # waits for it, and keeps it
                if pinned and self.held is not None:
                    self.held.keep(mapping, length)
                    held = True
                    p.held_bytes += length
                elif not cached and os.preadv(fd, [memoryview(self.buf)[:length]], offset) <= 0:
                    break  # the file shrank meanwhile
                self.used += charge
                if cached:
                    p.cached_bytes += length
                else:
                    p.read_bytes += length
                    due = self.began + p.read_bytes / (self.settings.max_read_mib_s * MiB)
                    if self.cancel.wait(max(0.0, due - time.monotonic())):
                        return "cancelled", "the swap went on without it"
                offset += length
            return None
        finally:
            if not held:
                mapping.close()


def read(
    files: Sequence[Path],
    progress: PrewarmProgress,
    settings: PrewarmSettings,
    cancel: threading.Event,
    *,
    memory: Callable[[], tuple[int, int]] = meminfo,
    held: Held | None = None,
) -> tuple[str, str]:
    """Read `files` into the page cache (in this thread), throttled and bounded as the module
    says, holding what it read there in `held` if given; (outcome, detail), also left in
    `progress`."""
    with _in_the_background():
        outcome, detail = _Reader(progress, settings, cancel, memory, held).run(files)
    progress.state, progress.detail, progress.ended = outcome, detail, time.monotonic()
    return outcome, detail


@contextlib.contextmanager
def _in_the_background() -> Iterator[None]:
    """This thread runs only when no other wants its CPU (`SCHED_IDLE`), so the serving
    server's latency does not move; as it was again after (the thread is a pool's)."""
    tid = threading.get_native_id()
    try:
        before = os.sched_getscheduler(tid), os.sched_getparam(tid)
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, *before)


class Prewarmer:
    """The host's part that runs a swap's pre-warm: one at a time, in a thread (its reads
    block), posting `PrewarmEnded` unless it was cancelled. What it read is held in the page
    cache until the swap settles (`release`), or memory runs short meanwhile."""

    def __init__(
        self,
        settings: PrewarmSettings,
        tasks: Tasks,
        post: Callable[[Message], None],
        memory: Callable[[], tuple[int, int]] = meminfo,
    ) -> None:
        self.settings, self.tasks, self.post, self.memory = settings, tasks, post, memory
        self._cancel: threading.Event | None = None
        self.held = Held()

    def start(self, swap_id: str, files: Sequence[Path], progress: PrewarmProgress) -> None:
        self.cancel()
        cancel = self._cancel = threading.Event()

        async def prewarm() -> None:
            progress.started = time.monotonic()
            outcome, detail = await asyncio.to_thread(
                functools.partial(read, memory=self.memory, held=self.held),
                files,
                progress,
                self.settings,
                cancel,
            )
            if cancel.is_set():
                return
            self.post(PrewarmEnded(swap_id, outcome, detail))
            if outcome == "abandoned" and detail.startswith("memory pressure"):
                self.release("memory pressure")
            else:
                await self._watch(cancel)

        self.tasks.task(prewarm(), name="prewarm")

    async def _watch(self, cancel: threading.Event) -> None:
        """While it holds pages: let them go if memory runs short."""
        total, _ = self.memory()
        reserve = self.settings.keep_free_ram_fraction * total
        while self.held.bytes and not cancel.is_set():
            await asyncio.sleep(HOLD_CHECK_S)
            if self.memory()[1] < reserve:
                self.release("memory pressure")

    def release(self, why: str) -> None:
        held = self.held.release()
        if held:
            self.post(EventNoted("prewarm_released", {"held_bytes": held, "reason": why}))

    def cancel(self) -> None:
        """Stop the read under way (it ends within a chunk; nothing is posted)."""
        if self._cancel is not None:
            self._cancel.set()
            self._cancel = None
