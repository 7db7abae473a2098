"""The host's records part: the machine's records written in order (events.jsonl, listeners)
when the turn ends or, held for a relaunch, soon after; a failed events.jsonl write told to
the machine; state.json written off the loop, the newest behind a write under way; launch logs
kept to their retention."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from gpuwarden.daemon.messages import EventNoted, Message, StateSaved, WriteHealthChanged
from gpuwarden.daemon.records import Records
from gpuwarden.daemon.settings import Retention
from gpuwarden.daemon.store import EventLog, StateStore

from .support.host import posted, tasks_posting, until


def records(root: Path, messages: list[Message], **retention: int) -> Records:
    return Records(
        events=EventLog(root / "state" / "events.jsonl"),
        store=StateStore(root / "state"),
        log_dir=root / "logs",
        log_retention=Retention(**retention),
        tasks=tasks_posting(messages),
        post=messages.append,
    )


def on_file(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_records_are_written_in_order_when_the_turn_ends(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = records(tmp_path, messages)
    heard: list[dict[str, Any]] = []
    part.listeners.append(heard.append)
    for n in range(3):
        part.record({"event": "note", "n": n})
    assert heard == []  # kept until the owner's turn ends
    part.flush()
    assert [r["n"] for r in heard] == [0, 1, 2]
    written = on_file(tmp_path / "state" / "events.jsonl")
    assert [(e["seq"], e["n"]) for e in written] == [(1, 0), (2, 1), (3, 2)]
    await part.close()


async def test_held_records_go_out_on_their_own_when_no_exec_comes(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = records(tmp_path, messages)
    heard: list[dict[str, Any]] = []
    part.listeners.append(heard.append)
    part.record({"event": "held"})
    part.hold()
    assert heard == []
    await until(lambda: bool(heard))  # at most HOLD_RECORDS_S later
    assert [r["event"] for r in heard] == ["held"]
    await part.close()


async def test_a_failed_events_write_is_told_and_so_is_its_end(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("a regular file where the state folder goes")
    messages: list[Message] = []
    part = records(tmp_path, messages)
    part.record({"event": "lost"})
    part.flush()
    failed = await posted(messages, WriteHealthChanged, target="events")
    assert failed.error is not None and "events.jsonl" in failed.error
    (tmp_path / "state").unlink()
    part.record({"event": "kept"})
    part.flush()
    await posted(messages, WriteHealthChanged, target="events", error=None)
    written = on_file(tmp_path / "state" / "events.jsonl")
    assert [e["event"] for e in written] == ["events_gap", "kept"]
    assert written[0]["lost"] == 1
    await part.close()


async def test_state_is_saved_off_the_loop_and_the_newest_behind_a_write_is_kept(
    tmp_path: Path,
) -> None:
    messages: list[Message] = []
    part = records(tmp_path, messages)
    gate, started = threading.Event(), threading.Event()
    real = part.store.save

    def slow(data: dict[str, Any]) -> str | None:
        started.set()
        gate.wait(10)
        return real(data)

    part.store.save = slow  # type: ignore[method-assign]
    part.save({"n": 1})
    await asyncio.to_thread(started.wait, 10)
    part.save({"n": 2})  # behind the write under way: replaced by the next
    part.save({"n": 3})
    gate.set()
    await until(lambda: len([m for m in messages if isinstance(m, StateSaved)]) == 2)
    assert [m.error for m in messages if isinstance(m, StateSaved)] == [None, None]
    assert json.loads((tmp_path / "state" / "state.json").read_text())["n"] == 3
    await part.close()


async def test_a_state_file_that_cannot_be_written_says_why(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("a regular file where the state folder goes")
    messages: list[Message] = []
    part = records(tmp_path, messages)
    part.save({"n": 1})
    saved = await posted(messages, StateSaved)
    assert saved.error is not None
    await part.close()


async def test_launch_logs_past_their_retention_are_pruned_and_told(tmp_path: Path) -> None:
    messages: list[Message] = []
    part = records(tmp_path, messages, launches=2)
    folder = tmp_path / "logs" / "c"
    folder.mkdir(parents=True)
    order = [f"launch-{n}" for n in range(4)]
    for launch_id in order:
        (folder / f"{launch_id}.log").write_text("a line\n")
    part.prune_logs({"launch-0"}, order)  # the protected one stays, oldest or not
    pruned = await posted(messages, EventNoted, kind="logs_pruned")
    assert pruned.fields == {"files": 2}
    assert sorted(p.stem for p in folder.glob("*.log")) == ["launch-0", "launch-3"]
    await part.close()
