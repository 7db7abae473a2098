"""SIGTERM's drain, from the first request on: SGLang's handler and its sigterm_watchdog.

The first generate request installs the drain handler over uvicorn's (TokenizerManager's
auto_create_handle_loop); on SIGTERM the server stops being healthy, and a watchdog on SGLang's
5 s period waits for the running requests to finish, then ends as the chosen version does:
``kill_process_tree`` (-9, up to 0.5.12) or a ShutdownReq to the schedulers and a clean exit.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING

from .logline import log
from .tree import kill_process_tree, shutdown_schedulers

if TYPE_CHECKING:
    from .server import StandinServer


def on_first_request(server: StandinServer) -> None:
    """TokenizerManager.auto_create_handle_loop(): the drain handler overrides uvicorn's."""
    if server.state.first_request_seen:
        return
    server.state.first_request_seen = True
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_sigterm, server)
    server.background.add(loop.create_task(sigterm_watchdog(server)))


def on_sigterm(server: StandinServer) -> None:
    if server.cfg.faults.ignore_sigterm:
        return
    log("SIGTERM received. signum=None frame=None. Draining requests and shutting down...")
    server.state.gracefully_exit = True


async def sigterm_watchdog(server: StandinServer) -> None:
    # SGLang's sigterm_watchdog polls on a 5 s period; the period is observable (the drain
    # starts up to one period after SIGTERM), so it is modelled, not replaced by an event.
    while not server.state.gracefully_exit:  # noqa: ASYNC110
        await asyncio.sleep(server.seconds("drain_step"))
    assert server.engine is not None
    while True:
        rids = list(server.engine.streams)
        if server.state.status == "UnHealthy":
            log("Signal SIGTERM received while health check failed. Force exiting.")
            kill_process_tree(os.getpid())
        log(
            f"Gracefully exiting... Remaining number of requests {len(rids)}. "
            f"Remaining requests remaining_rids={rids}."
        )
        if not rids:
            break
        await asyncio.sleep(server.seconds("drain_step"))
    if server.profile.sigterm_ends_in_sigkill:
        kill_process_tree(os.getpid(), include_parent=True)
    await shutdown_schedulers(server)
    server.uvicorn_server.should_exit = True
