"""A shim (`daemon/server/shim.py`) as a real process, for the tests that talk to it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from gpuwarden.daemon.server import shim as shim_module


@contextlib.contextmanager
def running_shim(folder: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start a shim on `folder`, return once it listens; at the end, kill it and every
    process group its servers lead (read from its exit records and `/proc`, not from it)."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", shim_module.__file__, "--dir", str(folder)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().startswith(b"listening ")  # it listens from now on
        yield proc
    finally:
        for pid in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        proc.stdout.close()


@contextlib.contextmanager
def shims_ended(state_dir: Path, daemons: Sequence[Any] = ()) -> Iterator[None]:
    """At the end, the daemons in `daemons` (`Proc`s) are ended (they would start a lost shim
    again), then the shim of `state_dir` (outliving them) is killed with every process group
    its servers lead, whatever the test left."""
    try:
        yield
    finally:
        for proc in daemons:
            with contextlib.suppress(ProcessLookupError):
                proc.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(20)
        folder = str(state_dir / "shim")
        end_shims(lambda found: found == folder)


def end_shims(mine: Callable[[str], bool]) -> int:
    """Kill every shim whose folder (`--dir`) `mine` accepts, with every process group its
    servers lead; return how many there were."""
    ended = 0
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if not any(part.endswith("shim.py") for part in cmd) or "--dir" not in cmd[:-1]:
            continue
        if not mine(cmd[cmd.index("--dir") + 1]):
            continue
        ended += 1
        for pid in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return ended


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
