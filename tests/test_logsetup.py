"""The daemon's own log: levels an operator can filter on, and journald's priorities."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from gpuwarden.daemon.logsetup import record_level

LOGGING = """
from gpuwarden.daemon import logsetup
logsetup.configure()
log = logsetup.get_logger("gpuwarden")
log.info("daemon.starting", n=1)
log.warning("server.state", to="backoff")
try:
    raise ValueError("boom")
except ValueError:
    log.exception("supervisor.error", message="X")
"""


def _run(tmp_path: Path, journal: bool) -> list[str]:
    out = tmp_path / "stderr.txt"
    with out.open("wb") as f:
        st = os.fstat(f.fileno())
        env = {**os.environ}
        env.pop("JOURNAL_STREAM", None)
        if journal:
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        subprocess.run([sys.executable, "-c", LOGGING], stderr=f, env=env, check=True, timeout=60)
    return out.read_text().splitlines()


def test_records_are_json_with_levels_and_journald_gets_priorities(tmp_path: Path) -> None:
    plain = _run(tmp_path, journal=False)
    first = json.loads(plain[0])
    assert first["event"] == "daemon.starting" and first["n"] == 1 and first["level"] == "info"
    error = json.loads(plain[2])
    assert error["level"] == "error" and "ValueError: boom" in error["exception"]
    journal = _run(tmp_path, journal=True)
    assert [line[:3] for line in journal] == ["<6>", "<4>", "<3>"]
    assert json.loads(journal[2][3:])["event"] == "supervisor.error"


def test_a_journal_stream_that_is_not_stderr_adds_no_prefix(tmp_path: Path) -> None:
    out = tmp_path / "stderr.txt"
    with out.open("wb") as f:
        env = {**os.environ, "JOURNAL_STREAM": "1:2"}  # another stream: stderr was redirected
        subprocess.run([sys.executable, "-c", LOGGING], stderr=f, env=env, check=True, timeout=60)
    assert out.read_text().startswith("{")


def test_levels_of_supervisor_records() -> None:
    assert record_level({"event": "exit", "reason": "cuda_oom"}) == logging.ERROR
    assert record_level({"event": "exit", "reason": "requested_stop"}) == logging.INFO
    assert record_level({"event": "state", "to": "failed"}) == logging.ERROR
    assert record_level({"event": "state", "to": "backoff"}) == logging.WARNING
    assert record_level({"event": "state", "to": "ready"}) == logging.INFO
    assert record_level({"event": "rollback"}) == logging.ERROR
    assert record_level({"event": "swap_settled", "outcome": "rolled_back"}) == logging.ERROR
    assert record_level({"event": "swap_settled", "outcome": "ready"}) == logging.INFO
    assert record_level({"event": "crash_loop"}) == logging.WARNING
    assert record_level({"event": "launch"}) == logging.INFO
