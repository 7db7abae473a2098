"""Bounded state: events.jsonl keeps its newest lines (no line lost to a concurrent append),
saved dumps their newest files, and `GET /dump` saves nothing."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from gpuwarden.daemon.store import EventLog

from .support.configs import standin_config
from .support.daemon import start_daemon
from .support.procs import Proc


def seqs(path: Path) -> list[int]:
    return [json.loads(line)["seq"] for line in path.read_text().splitlines()]


def test_events_jsonl_is_cut_to_its_newest_lines_without_losing_a_concurrent_append(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, retain=20_000)
    for i in range(22_000):  # exactly the slack: not yet
        log.append({"event": "filler", "i": i, "pad": "x" * 60})
    assert not log.needs_prune()
    log.append({"event": "filler", "i": 22_000})
    assert log.needs_prune() and not log.needs_prune()  # one prune at a time
    result: list[int] = []
    pruner = threading.Thread(target=lambda: result.append(log.prune()))
    pruner.start()
    during = 0
    while pruner.is_alive():  # appends race the rewrite for as long as it runs
        log.append({"event": "during", "n": during})
        during += 1
    pruner.join()
    log.append({"event": "after"})
    got = seqs(path)
    # The newest lines, contiguous up to the last one written: nothing lost, nothing doubled.
    assert got == list(range(got[0], log.seq + 1)), (got[:3], got[-3:])
    assert got[-1] == 22_001 + during + 1
    assert len(got) >= 20_000 and result == [got[0] - 1]  # seqs 1.. before the window went
    assert log.lines == len(got)
    log.close()
    # A later life counts the file it finds.
    again = EventLog(path, retain=20_000)
    assert again.lines == len(got)
    again.close()


def test_the_daemon_prunes_events_and_dumps_and_get_dump_saves_nothing(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"a": standin_config()},
        default="a",
        retention={"events": 10, "dumps": 2},
    )
    d.wait_state("ready")
    dumps = tmp_path / "state" / "dumps"
    assert d.http.get("/dump").status_code == 200
    assert "last_exit" in d.http.get("/dump", headers={"Accept": "application/json"}).json()
    assert not dumps.exists() or not list(dumps.iterdir())  # computed, never saved
    assert d.http.get("/dumps").json()["dumps"] == []
    saved = [d.http.post("/chat", json={"text": "dump logs"}).json()["saved"] for _ in range(3)]
    assert d.http.get("/dumps").json()["dumps"] == sorted(saved[1:])
    assert sorted(p.name for p in dumps.iterdir()) == sorted(
        f"{name}.{ext}" for name in saved[1:] for ext in ("txt", "json")
    )
    for _ in range(2):  # each restart writes several events
        mark = d.mark()
        assert (
            d.http.post("/restart", params={"wait": "true", "probation": "false"}).status_code
            == 200
        )
        d.wait_state("ready", after=mark)
    pruned = d.wait_event("server.events_pruned")
    assert pruned["lines"] > 0 and pruned["kept"] >= 10
    lines = (tmp_path / "state" / "events.jsonl").read_text().splitlines()
    assert len(lines) <= 10 + 1 + 5, len(lines)  # the newest 10, and what came since
    numbers = [json.loads(line)["seq"] for line in lines]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
