"""The stand-in's main process: SGLang's launch_server, observably.

Order of events (SGLANG.md §2, §4, §6): simulated heavy imports; argparse (exit 2 on a bad flag);
validation (a traceback and exit 1); the ``server_args=ServerArgs(...)`` line; schedulers and a
detokenizer started with multiprocessing spawn; wait for every scheduler's "ready"; only then
uvicorn binds the port; a warmup (``/get_model_info``, then an 8-token ``/generate``) after
which ``/health`` turns 200 and the ready line is printed.

Signals follow the chosen version: SIGTERM while loading kills at once (no handler); once
uvicorn serves, uvicorn's handler; from the first generate request a drain handler that ends
in ``kill_process_tree`` (-9, up to 0.5.12) or a clean exit 0 (0.5.23). SIGQUIT from a child is
the crash channel: ``Received sigquit ...`` and -9.

This module holds the main process's state (`StandinServer`), uvicorn's serving and `main`; the
process tree, the signal handlers, the warm-up and the HTTP routes have modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import os
import signal
import sys
import time
import warnings
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from . import cli
from .childconfig import ChildConfig
from .crash import launch_sigquit_handler, running_sigquit_handler
from .durations import DURATIONS
from .engine import EngineClient, ServerState
from .logline import log
from .serverargs import resolve, server_args_repr
from .tree import (
    kill_process_tree,
    launch_children,
    start_subprocess_watchdog,
    wait_schedulers_ready,
)
from .versions import PROFILES, Profile
from .warmup import warmup


def _uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's config reformatted the way SGLang's set_uvicorn_logging_configs does."""
    from uvicorn.config import LOGGING_CONFIG  # noqa: PLC0415 - heavy, main process only

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["formatters"]["default"]["fmt"] = "[%(asctime)s] %(levelprefix)s %(message)s"
    cfg["formatters"]["default"]["datefmt"] = "%Y-%m-%d %H:%M:%S"
    cfg["formatters"]["default"]["use_colors"] = False
    cfg["formatters"]["access"]["fmt"] = (
        '[%(asctime)s] %(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'
    )
    cfg["formatters"]["access"]["datefmt"] = "%Y-%m-%d %H:%M:%S"
    cfg["formatters"]["access"]["use_colors"] = False
    return cfg


class StandinServer:
    def __init__(self, args: Any, profile: Profile, cfg: ChildConfig) -> None:
        self.args = args
        self.profile = profile
        self.cfg = cfg
        self.scale = cfg.time_scale
        self.state = ServerState()
        self.children: list[tuple[str, BaseProcess, Connection]] = []
        self.ready_infos: list[dict[str, Any]] = []
        self.started_at = time.time()
        self.startup_time: dict[str, Any] | None = None  # 0.5.23's, once its ranks are ready
        self.engine: EngineClient | None = None
        self.uvicorn_server: Any = None
        self.background: set[asyncio.Task[None]] = set()
        self.exiting = False  # set once main itself tears the tree down
        self.model_name = args.served_model_name or args.model_path

    def seconds(self, name: str) -> float:
        return DURATIONS[name] * self.scale

    # -- HTTP ----------------------------------------------------------------------------------

    async def serve_http(self) -> None:
        import uvicorn  # noqa: PLC0415

        from .app import build_app  # noqa: PLC0415 - starlette is heavy, main process only

        loop = asyncio.get_running_loop()
        sched0 = next(conn for name, _, conn in self.children if name == "scheduler_0")
        self.engine = EngineClient(sched0, loop, self.state)
        config = uvicorn.Config(
            build_app(self),
            host=self.args.host,
            port=self.args.port,
            log_config=_uvicorn_log_config(),
            log_level=(self.args.log_level_http or self.args.log_level).lower(),
            timeout_keep_alive=5,
            timeout_graceful_shutdown=2,
            lifespan="off",
        )
        server = uvicorn.Server(config)
        self.uvicorn_server = server
        signal.signal(signal.SIGQUIT, functools.partial(running_sigquit_handler, self))

        # 0.5.23 starts its warm-up thread in the app's lifespan, before the bind.
        warm = loop.create_task(warmup(self)) if self.profile.warmup_before_bind else None

        async def after_start() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.005)
            if self.cfg.faults.ignore_sigterm:
                loop.add_signal_handler(signal.SIGTERM, lambda: None)
            if warm is None:
                await warmup(self)

        task = loop.create_task(after_start())
        try:
            await server.serve()
        except SystemExit:
            if warm is not None and not server.started:
                # The bind failed. The warm-up is joined first, as SGLang's lifespan does: off
                # another server's answers on the port it may print the ready line.
                with contextlib.suppress(Exception):
                    await warm
            raise
        finally:
            task.cancel()
            if warm is not None:
                warm.cancel()


def startup_time(server: StandinServer) -> dict[str, Any]:
    """0.5.23's account of its start, as its engine makes it: each phase's slowest rank, and
    the whole start as the front end saw it; logged, then served in `/server_info`."""
    infos = [i.get("startup_time") or {} for i in server.ready_infos]
    graphs: dict[str, float] = {}
    for info in infos:
        for key, value in (info.get("cuda_graph") or {}).items():
            graphs[key] = max(graphs.get(key, 0.0), float(value))
    out: dict[str, Any] = {
        key: max((float(i.get(key, 0.0)) for i in infos), default=0.0)
        for key in ("load_weight", "kv_cache_allocation", "scheduler_e2e")
    }
    out["cuda_graph"] = graphs
    out["tokenizer_e2e"] = time.time() - server.started_at
    log(
        "Engine startup timings (s): load_weight={:.2f}, kv_cache_allocation={:.2f}, "
        "scheduler_e2e={:.2f}, cuda_graph={{{}}}, tokenizer_e2e={:.2f}".format(
            out["load_weight"],
            out["kv_cache_allocation"],
            out["scheduler_e2e"],
            ", ".join(f"{k}={v:.2f}" for k, v in graphs.items()),
            out["tokenizer_e2e"],
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = cli.standin_preparser().parse_known_args(argv)
    profile = PROFILES[pre.standin_version]
    if pre.standin_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if profile.entrypoint_warning:
        warnings.warn(
            "'python -m sglang.launch_server' is still supported, but 'sglang serve' is the "
            "recommended entrypoint.",
            UserWarning,
            stacklevel=1,
        )
    time.sleep(DURATIONS["import"] * pre.standin_time_scale)
    args, profile = cli.parse(argv)
    cfg = resolve(args, profile)
    if args.disable_cuda_graph and profile.version == "0.5.23":
        log(
            "'--disable-cuda-graph' is deprecated and will be removed in a future release. "
            "Use '--cuda-graph-backend-{decode,prefill}=disabled' instead."
        )
    log(f"server_args={server_args_repr(args)}")
    server = StandinServer(args, profile, cfg)
    try:
        signal.signal(signal.SIGQUIT, launch_sigquit_handler)
        launch_children(server)
        wait_schedulers_ready(server)
        if profile.version == "0.5.23":
            server.startup_time = startup_time(server)
        if profile.subprocess_watchdog:
            start_subprocess_watchdog(server)
        try:
            asyncio.run(server.serve_http())
        except SystemExit as exc:
            # uvicorn exits 3 on a bind failure; the uvicorn of older SGLang versions exited 1.
            if exc.code == 3:
                raise SystemExit(profile.uvicorn_bind_failure_exit) from None
            raise
    finally:
        server.exiting = True
        kill_process_tree(os.getpid(), include_parent=False)
    return 0
