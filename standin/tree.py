"""The stand-in's process tree: the children it spawns, and how they are watched and ended.

`launch_children` starts one scheduler per TP rank and a detokenizer with multiprocessing spawn;
`wait_schedulers_ready` waits for each scheduler's ready report and fails as the chosen version
does when one died loading; the subprocess watchdog (0.5.12+) turns a child that died without
telling into a SIGQUIT; `shutdown_schedulers` is 0.5.23's ShutdownReq with its timeout, and
`kill_process_tree` SGLang's utility of that name.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import psutil

from .logline import log
from .procs import run_detokenizer, run_scheduler

if TYPE_CHECKING:
    from .server import StandinServer


def kill_process_tree(parent_pid: int, include_parent: bool = True) -> None:
    """SGLang's kill_process_tree: SIGKILL the children; killing itself ends in -9."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        itself = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return
    for child in itself.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    if include_parent:
        if parent_pid == os.getpid():
            sys.stderr.flush()
            itself.kill()
            sys.exit(0)
        with contextlib.suppress(psutil.NoSuchProcess):
            itself.kill()
            itself.send_signal(signal.SIGQUIT)


def launch_children(server: StandinServer) -> None:
    ctx = mp.get_context("spawn")
    for rank in range(server.cfg.tp_size):
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(
            target=run_scheduler, args=(rank, server.cfg, child_conn), name=f"scheduler_{rank}"
        )
        proc.start()
        child_conn.close()
        server.children.append((f"scheduler_{rank}", proc, parent_conn))
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=run_detokenizer, args=(server.cfg, child_conn), name="detokenizer")
    proc.start()
    child_conn.close()
    server.children.append(("detokenizer", proc, parent_conn))


def wait_schedulers_ready(server: StandinServer) -> None:
    for name, proc, conn in server.children:
        if not name.startswith("scheduler_"):
            continue
        rank = int(name.split("_")[1])
        try:
            server.ready_infos.append(conn.recv())
        except EOFError:
            proc.join(timeout=5)
            code = proc.exitcode
            if server.profile.at_least_0_5_12:
                raise RuntimeError(
                    f"Rank {rank} scheduler died during initialization (exit code: {code}). "
                    "If exit code is -9 (SIGKILL), a common cause is the OS OOM killer. "
                    "Run `dmesg -T | grep -i oom` to check."
                ) from None
            log(f"Rank {rank} scheduler is dead. Please check if there are relevant logs.")
            log(f"Exit code: {code}")
            sys.exit(1)


def start_subprocess_watchdog(server: StandinServer) -> None:
    """0.5.12+: notice a child that died without telling (a C++ abort)."""

    def watch() -> None:
        while True:
            time.sleep(server.seconds("subprocess_watchdog"))
            for name, proc, _ in server.children:
                if server.exiting or server.state.gracefully_exit:
                    return
                if proc.exitcode is not None:
                    log(
                        f"Subprocess {name} (pid={proc.pid}) crashed with exit code "
                        f"{proc.exitcode}. Triggering SIGQUIT for cleanup..."
                    )
                    os.kill(os.getpid(), signal.SIGQUIT)
                    return

    threading.Thread(target=watch, name="subprocess-watchdog", daemon=True).start()


async def shutdown_schedulers(server: StandinServer) -> None:
    """0.5.23: ShutdownReq to the schedulers, wait <= 15 s, SIGKILL the rest."""
    for _, _, conn in server.children:
        with contextlib.suppress(OSError):
            conn.send(("shutdown",))
    deadline = time.monotonic() + server.seconds("scheduler_exit")
    # Child exits are not events on this loop (multiprocessing owns them): poll briefly.
    while time.monotonic() < deadline and any(p.is_alive() for _, p, _ in server.children):  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    alive = [p.pid for _, p, _ in server.children if p.is_alive()]
    if alive:
        log(
            "Schedulers still alive 15s after ShutdownReq, killing them before they "
            f"released: {alive}"
        )
        for _, proc, _ in server.children:
            if proc.is_alive():
                proc.kill()
