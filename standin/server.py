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
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import psutil

from . import cli
from .childconfig import ChildConfig
from .durations import DURATIONS
from .engine import EngineClient, ServerState
from .logline import log
from .procs import run_detokenizer, run_scheduler
from .serverargs import resolve, server_args_repr
from .versions import PROFILES, Profile

UVICORN_LOG_CONFIG: dict[str, Any] = {}


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
        self.engine: EngineClient | None = None
        self.uvicorn_server: Any = None
        self.background: set[asyncio.Task[None]] = set()
        self.exiting = False  # set once main itself tears the tree down
        self.model_name = args.served_model_name or args.model_path

    def seconds(self, name: str) -> float:
        return DURATIONS[name] * self.scale

    # -- process tree --------------------------------------------------------------------------

    def launch_children(self) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(self.cfg.tp_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=run_scheduler, args=(rank, self.cfg, child_conn), name=f"scheduler_{rank}"
            )
            proc.start()
            child_conn.close()
            self.children.append((f"scheduler_{rank}", proc, parent_conn))
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=run_detokenizer, args=(self.cfg, child_conn), name="detokenizer")
        proc.start()
        child_conn.close()
        self.children.append(("detokenizer", proc, parent_conn))

    def wait_schedulers_ready(self) -> None:
        for name, proc, conn in self.children:
            if not name.startswith("scheduler_"):
                continue
            rank = int(name.split("_")[1])
            try:
                self.ready_infos.append(conn.recv())
            except EOFError:
                proc.join(timeout=5)
                code = proc.exitcode
                if self.profile.at_least_0_5_12:
                    raise RuntimeError(
                        f"Rank {rank} scheduler died during initialization (exit code: {code}). "
                        "If exit code is -9 (SIGKILL), a common cause is the OS OOM killer. "
                        "Run `dmesg -T | grep -i oom` to check."
                    ) from None
                log(f"Rank {rank} scheduler is dead. Please check if there are relevant logs.")
                log(f"Exit code: {code}")
                sys.exit(1)

    def start_subprocess_watchdog(self) -> None:
        """0.5.12+: notice a child that died without telling (a C++ abort)."""

        def watch() -> None:
            while True:
                time.sleep(self.seconds("subprocess_watchdog"))
                for name, proc, _ in self.children:
                    if self.exiting or self.state.gracefully_exit:
                        return
                    if proc.exitcode is not None:
                        log(
                            f"Subprocess {name} (pid={proc.pid}) crashed with exit code "
                            f"{proc.exitcode}. Triggering SIGQUIT for cleanup..."
                        )
                        os.kill(os.getpid(), signal.SIGQUIT)
                        return

        threading.Thread(target=watch, name="subprocess-watchdog", daemon=True).start()

    # -- signals -------------------------------------------------------------------------------

    @staticmethod
    def launch_sigquit_handler(signum: int, frame: FrameType | None) -> None:
        log("Received sigquit from a child process. It usually means the child failed.")
        kill_process_tree(os.getpid())

    def running_sigquit_handler(self, signum: int, frame: FrameType | None) -> None:
        # SGLang's handler is called with no arguments: it prints None, None.
        log("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        self.exiting = True  # the subprocess watchdog stops first
        self.crash_diagnostics()
        kill_process_tree(os.getpid())

    def crash_diagnostics(self) -> None:
        """0.5.23's dump_requests_before_crash: with its defaults the dead server lingers,
        port open and requests hanging (this runs on the event loop's thread), 5 s, and 60 s
        more while a scheduler is alive (a dead detokenizer) waiting for CUDA coredumps."""
        if not self.profile.crash_diagnostics:
            return
        pyspy = _env_bool("SGLANG_PYSPY_DUMP_BEFORE_CRASH", True)
        coredump = _env_bool("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", True)
        if not (pyspy or coredump):
            return
        log("Sleeping 5 seconds before crash diagnostics to let GPU activity settle.")
        settle = self.seconds("crash_settle")
        # At least 1 s, even time-scaled: a scheduler that has just reported its exception is
        # on its way out, and SGLang's 5 s always sees it gone.
        deadline = time.monotonic() + max(settle, 1.0)
        time.sleep(settle)
        schedulers = [p for name, p, _ in self.children if name.startswith("scheduler")]
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

    def on_sigterm(self) -> None:
        if self.cfg.faults.ignore_sigterm:
            return
        log("SIGTERM received. signum=None frame=None. Draining requests and shutting down...")
        self.state.gracefully_exit = True

    async def sigterm_watchdog(self) -> None:
        # SGLang's sigterm_watchdog polls on a 5 s period; the period is observable (the drain
        # starts up to one period after SIGTERM), so it is modelled, not replaced by an event.
        while not self.state.gracefully_exit:  # noqa: ASYNC110
            await asyncio.sleep(self.seconds("drain_step"))
        assert self.engine is not None
        while True:
            rids = list(self.engine.streams)
            if self.state.status == "UnHealthy":
                log("Signal SIGTERM received while health check failed. Force exiting.")
                kill_process_tree(os.getpid())
            log(
                f"Gracefully exiting... Remaining number of requests {len(rids)}. "
                f"Remaining requests remaining_rids={rids}."
            )
            if not rids:
                break
            await asyncio.sleep(self.seconds("drain_step"))
        if self.profile.sigterm_ends_in_sigkill:
            kill_process_tree(os.getpid(), include_parent=True)
        await self.shutdown_schedulers()
        self.uvicorn_server.should_exit = True

    async def shutdown_schedulers(self) -> None:
        """0.5.23: ShutdownReq to the schedulers, wait <= 15 s, SIGKILL the rest."""
        for _, _, conn in self.children:
            with contextlib.suppress(OSError):
                conn.send(("shutdown",))
        deadline = time.monotonic() + self.seconds("scheduler_exit")
        # Child exits are not events on this loop (multiprocessing owns them): poll briefly.
        while time.monotonic() < deadline and any(p.is_alive() for _, p, _ in self.children):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        alive = [p.pid for _, p, _ in self.children if p.is_alive()]
        if alive:
            log(
                "Schedulers still alive 15s after ShutdownReq, killing them before they "
                f"released: {alive}"
            )
            for _, proc, _ in self.children:
                if proc.is_alive():
                    proc.kill()

    def on_first_request(self) -> None:
        """TokenizerManager.auto_create_handle_loop(): the drain handler overrides uvicorn's."""
        if self.state.first_request_seen:
            return
        self.state.first_request_seen = True
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.on_sigterm)
        self.background.add(loop.create_task(self.sigterm_watchdog()))

    # -- warmup --------------------------------------------------------------------------------

    async def warmup(self) -> None:
        import httpx  # noqa: PLC0415

        base = f"http://{self.args.host}:{self.args.port}"
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        if not self.args.skip_server_warmup:
            await asyncio.sleep(self.seconds("warmup_sleep"))
            try:
                # 0.5.12+ asks the new route (the old one logs a deprecation).
                info = "/model_info" if self.profile.deprecated_info_routes else "/get_model_info"
                async with httpx.AsyncClient(headers=headers, timeout=600, trust_env=False) as c:
                    for _ in range(120):
                        with contextlib.suppress(httpx.HTTPError):
                            if (await c.get(base + info, timeout=5)).status_code == 200:
                                break
                        await asyncio.sleep(self.seconds("warmup_sleep"))
                    res = await c.post(
                        base + "/generate",
                        json={
                            "text": "The capital city of France is",
                            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                        },
                    )
                    res.raise_for_status()
            except Exception:
                import traceback  # noqa: PLC0415

                log(f"Initialization failed. warmup error: {traceback.format_exc()}")
                kill_process_tree(os.getpid())
        self.state.status = "Up"
        log("The server is fired up and ready to roll!")
        for _, _, conn in self.children:
            with contextlib.suppress(OSError):
                conn.send(("ready",))
        threading.Thread(target=self.output_faults, name="output-faults", daemon=True).start()

    def output_faults(self) -> None:
        faults = self.cfg.faults
        out = sys.stderr.buffer
        stamp = time.strftime("%Y-%m-%d %H:%M:%S").encode()
        if faults.flood_lines:
            chunk: list[bytes] = []
            for i in range(faults.flood_lines):
                chunk.append(b"[%s] flood line %08d %s\n" % (stamp, i, b"x" * 40))
                if len(chunk) == 1000:
                    out.write(b"".join(chunk))
                    chunk.clear()
            out.write(b"".join(chunk))
            out.write(b"[%s] flood done: %d lines\n" % (stamp, faults.flood_lines))
        if faults.invalid_utf8:
            out.write(b"[%s] invalid bytes: \xff\xfe\xc3\x28 \x80 end\n" % stamp)
        if faults.long_line_bytes:
            out.write(b"[%s] long line: %s\n" % (stamp, b"L" * faults.long_line_bytes))
        out.flush()

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
        signal.signal(signal.SIGQUIT, self.running_sigquit_handler)

        # 0.5.23 starts its warm-up thread in the app's lifespan, before the bind.
        warm = loop.create_task(self.warmup()) if self.profile.warmup_before_bind else None

        async def after_start() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.005)
            if self.cfg.faults.ignore_sigterm:
                loop.add_signal_handler(signal.SIGTERM, lambda: None)
            if warm is None:
                await self.warmup()

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
        signal.signal(signal.SIGQUIT, StandinServer.launch_sigquit_handler)
        server.launch_children()
        server.wait_schedulers_ready()
        if profile.subprocess_watchdog:
            server.start_subprocess_watchdog()
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
