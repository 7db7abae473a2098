"""The ring of a launch's last lines, and the readers that follow it: caps, gaps, wake-ups."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuwarden.daemon.launchlog import LaunchLog
from gpuwarden.daemon.logring import LogCursor, LogFeed, Ring


def test_ring_caps_entries_and_bytes() -> None:
    ring = Ring(max_lines=10, max_bytes=100)
    for i in range(50):
        ring.add(f"line {i:03d}", 0.0)
    assert len(ring) == 10 and ring.tail(1)[0].text == "line 049"
    ring.add("x" * 20000, 0.0)
    assert len(ring.tail(1)[0].text) < 9000
    assert ring.nbytes <= 100 or len(ring) == 1


def test_ring_after_reads_in_order_and_counts_what_it_let_go() -> None:
    ring = Ring(max_lines=10, max_bytes=10**6)
    for start in range(0, 25, 5):  # five chunks of five lines: l0 is seq 1
        ring.extend([f"l{i}" for i in range(start, start + 5)], 0.0)
    assert ring.after(0, 100) == (15, [f"l{i}" for i in range(15, 25)])
    assert ring.after(17, 3) == (0, ["l17", "l18", "l19"])  # across a chunk's edge
    assert ring.after(25, 100) == (0, [])
    ring.extend([f"l{i}" for i in range(25, 40)], 0.0)  # one chunk longer than the ring
    assert ring.after(25, 100) == (5, [f"l{i}" for i in range(30, 40)])  # seqs 26-30 gone


def test_cursor_reads_a_launch_to_its_end_before_following_the_next(tmp_path: Path) -> None:
    first = LaunchLog(tmp_path / "a.log", [], redact=lambda s: s.replace("sk-1", "***"))
    first.feed(b"old 1\n")
    current = [first]
    cursor = LogCursor(lambda: current[-1], history=1)
    first.feed(b"old 2 sk-1\n")
    second = LaunchLog(tmp_path / "b.log", [])
    current.append(second)
    second.feed(b"new 1\n")
    assert cursor.read(10) == (0, ["old 1", "old 2 ***"])  # redacted as it is sent
    assert cursor.read(10) == (0, ["new 1"])
    assert cursor.read(10) == (0, [])


async def test_feed_wakes_a_waiter_on_the_next_chunk_only() -> None:
    feed = LogFeed()
    feed.notify()  # nobody waits: nothing is kept for later
    waiter = asyncio.ensure_future(feed.wait())
    await asyncio.sleep(0)  # one turn of the loop: the waiter starts waiting
    assert not waiter.done()
    feed.notify(["a line"])
    await asyncio.wait_for(waiter, 5)
    with feed.reading():
        assert feed.readers == 1
    assert feed.readers == 0
