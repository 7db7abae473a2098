"""SIGQUIT, the crash channel: a child's report ends the server, as in SGLang.

While loading, SIGQUIT logs ``Received sigquit ...`` and kills the tree (-9); once serving, the
handler logs SGLang's line, runs 0.5.23's crash diagnostics (the dead server lingers, port open,
while it "dumps" live schedulers with py-spy and waits for CUDA coredumps, as its defaults and
``SGLANG_*`` variables say) and then kills the tree.
"""

from __future__ import annotations

import os
import time
from types import FrameType
from typing import TYPE_CHECKING

from .logline import log
from .tree import kill_process_tree

if TYPE_CHECKING:
    from .server import StandinServer


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


def launch_sigquit_handler(signum: int, frame: FrameType | None) -> None:
    log("Received sigquit from a child process. It usually means the child failed.")
    kill_process_tree(os.getpid())


def running_sigquit_handler(server: StandinServer, signum: int, frame: FrameType | None) -> None:
    # SGLang's handler is called with no arguments: it prints None, None.
    log("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    server.exiting = True  # the subprocess watchdog stops first
    crash_diagnostics(server)
    kill_process_tree(os.getpid())


def crash_diagnostics(server: StandinServer) -> None:
    """0.5.23's dump_requests_before_crash: with its defaults the dead server lingers,
    port open and requests hanging (this runs on the event loop's thread), 5 s, and 60 s
    more while a scheduler is alive (a dead detokenizer) waiting for CUDA coredumps."""
    if not server.profile.crash_diagnostics:
        return
    pyspy = _env_bool("SGLANG_PYSPY_DUMP_BEFORE_CRASH", True)
    coredump = _env_bool("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", True)
    if not (pyspy or coredump):
        return
    log("Sleeping 5 seconds before crash diagnostics to let GPU activity settle.")
    settle = server.seconds("crash_settle")
    # At least 1 s, even time-scaled: a scheduler that has just reported its exception is
    # on its way out, and SGLang's 5 s always sees it gone.
    deadline = time.monotonic() + max(settle, 1.0)
    time.sleep(settle)
    schedulers = [p for name, p, _ in server.children if name.startswith("scheduler")]
    for proc in schedulers:
        proc.join(max(0.0, deadline - time.monotonic()))
    live = [p for p in schedulers if p.is_alive()]
    if not live:
        log("No live scheduler processes found; skipping py-spy and CUDA coredump.")
        return
    if pyspy:
        for proc in live:
            for flag in ("--native", ""):
                cmd = f"py-spy dump {flag} --pid {proc.pid}"  # two spaces without a flag
                log(f"Pyspy failed ({cmd}). Error: /bin/sh: 1: py-spy: not found\n")
            log(f"All pyspy dump attempts failed for PID {proc.pid}.")
    if coredump:
        log(
            "CUDA user-triggered coredump is not enabled. Set "
            "CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1 before CUDA initialization."
        )
        for proc in live:
            log(
                f"CUDA coredump pipe not found for PID {proc.pid}: "
                f"/tmp/corepipe.cuda.vm.{proc.pid}. Ensure "
                "CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1 was set before this process "
                "initialized CUDA."
            )
        wait = _env_float("SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS", 60.0)
        if wait > 0:
            log(f"Waiting {wait:.1f} seconds for CUDA coredumps before exiting.")
            time.sleep(wait)
