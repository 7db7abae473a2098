"""A shim (`daemon/server/shim.py`) as a real process, for the tests that talk to it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
def shims_ended(state_dir: Path) -> Iterator[None]:
    """At the end, the shim of `state_dir` (started by a daemon, outliving it) is killed with
    every process group its servers lead, whatever the test left."""
    try:
        yield
    finally:
        folder = str(state_dir / "shim")
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if shim_module.__file__ in cmd and folder in cmd:
                for pid in _children(proc.pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(psutil.Error):
                    proc.kill()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
