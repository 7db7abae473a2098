"""``gpuwarden serve``: the daemon in the foreground (systemd runs this).

The supervisor and uvicorn share one event loop. uvicorn's own signal capture is turned off:
the daemon keeps SIGTERM/SIGINT, so shutdown stops the server first, then the control plane.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import resource
import signal
import socket
import sys
from collections.abc import Callable, Generator

import uvicorn

from gpuwarden.daemon import logsetup
from gpuwarden.daemon.gpu import make_backend
from gpuwarden.daemon.notify import Webhooks
from gpuwarden.daemon.server import reaper
from gpuwarden.daemon.settings import Settings, SettingsError, load_settings
from gpuwarden.daemon.supervisor import Supervisor
from gpuwarden.daemon.systemd import Notifier
from gpuwarden.standin import fakegpu

from .app import create_app
from .connections import guarded_h11
from .guard import is_loopback

log = logsetup.get_logger("gpuwarden")


class _Server(uvicorn.Server):
    """uvicorn's server, with the daemon owning the signals and a quieter idle loop."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit = asyncio.Event()  # binds to the running loop on first use (3.10+)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the daemon owns the signals

    async def main_loop(self) -> None:
        """uvicorn ticks ten times a second to refresh its Date header and to poll
        `should_exit`; that tick was most of an idle daemon's CPU. Here it ticks once a second
        (the header's resolution anyway) and `exit()` ends the wait at once."""
        while not await self.on_tick(0):  # counter 0: the Date header is refreshed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit.wait(), 1.0)

    def exit(self) -> None:
        self.should_exit = True
        self._exit.set()


def use_pidfd_watcher(loop: asyncio.AbstractEventLoop) -> None:
    """Python 3.11 watches children with a thread per child; a pidfd on the loop reports an
    exit without the thread hop (3.12 does this by default)."""
    if sys.version_info >= (3, 12) or not hasattr(asyncio, "PidfdChildWatcher"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):
        return  # kernel older than 5.3
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(loop)
    asyncio.set_child_watcher(watcher)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without it a keep-alive client waits ~40 ms per
    # request on Nagle and delayed ACKs (the response goes out in two writes).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def release_startup_memory() -> None:
    """Before supervision begins: the imports' garbage (pydantic and FastAPI build their
    schemas then) is collected, what is left is moved out of the collector's way for the
    daemon's life (a full collection no longer walks a startup's worth of objects; nothing of a
    launch is among it, as none exists yet), and glibc gives the freed heap back to the system.
    About 1 MiB of the idle daemon's resident memory."""
    gc.collect()
    gc.freeze()
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        ctypes.CDLL("libc.so.6").malloc_trim(0)


async def serve(settings: Settings, on_listening: Callable[[str, int], None] | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT. `on_listening(host, port)` is called with the bound
    address once the control plane answers (port 0 in the settings becomes the real one)."""
    host, port = settings.listen_host_port
    try:
        sock = bind(host, port)
    except OSError as exc:
        print(f"gpuwarden: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 1
    bound_host, bound_port = sock.getsockname()[:2]
    raise_fd_limit()
    subreaper = reaper.become_subreaper()
    try:
        gpu = make_backend(settings.gpu.backend, fakegpu.dir_from_env())
    except Exception as exc:
        print(f"gpuwarden: GPU backend {settings.gpu.backend!r}: {exc}", file=sys.stderr)
        sock.close()
        return 1
    supervisor = Supervisor(settings, gpu)
    app = create_app(supervisor, settings)
    loop = asyncio.get_running_loop()
    repeats = logsetup.Repeats(loop, settings.log_repeat_window_s)
    loop.set_exception_handler(logsetup.loop_exception_handler(repeats))
    server = _Server(
        uvicorn.Config(
            app,
            http=guarded_h11(settings.http, repeats),
            # Also how many connections one wake-up accepts, each a descriptor before the cap
            # can refuse it: uvicorn's 2048 could take a whole descriptor limit at once.
            backlog=128,
            ws="none",  # no websocket routes: an upgrade would take a connection off its timers
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
    )
    use_pidfd_watcher(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reload_asked: list[bool] = []  # SIGHUP: stop as for SIGTERM, then execute ourselves again

    def reload() -> None:
        reload_asked.append(True)
        stop.set()

    loop.add_signal_handler(signal.SIGHUP, reload)
    loop.add_signal_handler(signal.SIGCHLD, reaper.OrphanReaper(loop))
    # A full disk or a file-size limit must not kill the daemon: with SIGXFSZ ignored, an
    # oversized write fails with EFBIG, which the log and state writers report and survive.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    webhooks = Webhooks(supervisor, settings.chat.webhooks)
    webhooks.start()
    # Before the supervisor runs: what it creates (launches and their logs) is never frozen.
    release_startup_memory()
    sup_task = loop.create_task(supervisor.run())
    api_task = loop.create_task(server.serve(sockets=[sock]))
    log.info(
        "daemon.starting",
        settings_state_dir=str(settings.state_dir),
        gpu_backend=gpu.name,
        subreaper=subreaper,
    )
    # uvicorn exposes `started` as a flag, not an event.
    while not server.started and not api_task.done():  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    if api_task.done():
        return 1
    log.info(
        "api.listening", host=bound_host, port=bound_port, url=f"http://{bound_host}:{bound_port}"
    )
    if on_listening is not None:
        on_listening(bound_host, bound_port)
    if app.state.token is None and not is_loopback(bound_host):
        log.warning(
            "api.unauthenticated",
            host=bound_host,
            detail="listening beyond loopback without token_file: whoever reaches this port "
            "can stop, start and swap the server",
        )
    # systemd: ready once the control plane listens (the server may still be loading: /status
    # says so); STATUS follows the server; WATCHDOG=1 comes from this loop, so a stuck loop is
    # restarted by systemd.
    notifier = Notifier()
    notifier.ready(_status_line(supervisor))
    extra = [loop.create_task(_notify_loop(notifier, supervisor))] if notifier.enabled else []
    stop_wait = loop.create_task(stop.wait())
    done, _ = await asyncio.wait({stop_wait, sup_task}, return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if sup_task in done:
        log.error("daemon.supervisor_ended", error=repr(sup_task.exception()))
        rc = 1
    elif reload_asked:
        log.info("daemon.reloading", detail=RELOADING)
        notifier.reloading()
    else:
        kept = "it runs on (live_restore)" if settings.live_restore else "stopping the server"
        log.info("daemon.stopping", detail=f"{kept}; the saved intent is kept")
        notifier.stopping()
    if sup_task not in done:
        # Bounded: a supervisor that cannot finish its stop must not keep SIGTERM from ending
        # the daemon. Past the bound the server's group is killed here, and the exit is 1.
        bound = settings.stop.grace_s + SHUTDOWN_SLACK_S
        try:
            await asyncio.wait_for(supervisor.shutdown(), bound)
            await asyncio.wait_for(sup_task, SHUTDOWN_SLACK_S)
        except TimeoutError:
            log.error("daemon.shutdown_stuck", detail=f"not stopped within {bound:g} s")
            supervisor.kill_server_now()
            sup_task.cancel()
            rc = 1
    stop_wait.cancel()
    for task in extra:
        task.cancel()
    server.exit()
    with contextlib.suppress(Exception):
        await api_task
    await webhooks.close()
    gpu.close()
    supervisor.events.close()
    log.info("daemon.stopped", rc=rc)
    return RELOAD if reload_asked and rc == 0 else rc


def _status_line(supervisor: Supervisor) -> str:
    st = supervisor.status()
    pid = f" pid {st['pid']}" if st.get("pid") else ""
    return f"server {st['state']}: config {st.get('config') or '-'}{pid}"


async def _notify_loop(notifier: Notifier, supervisor: Supervisor) -> None:
    period = min(1.0, notifier.watchdog_s / 2) if notifier.watchdog_s else 1.0
    last = ""
    while True:
        # The watchdog is fed only while supervision works: a loop that runs while the owner
        # is wedged (or a helper task is overdue) is not a daemon worth keeping.
        stuck = supervisor.stuck()
        if notifier.watchdog_s and stuck is None:
            notifier.watchdog()
        line = _status_line(supervisor) if stuck is None else f"stuck: {stuck}"
        if stuck is not None and not last.startswith("stuck"):
            log.error("daemon.stuck", detail=stuck)
        if line != last:
            notifier.status(line)
            last = line
        await asyncio.sleep(period)


SHUTDOWN_SLACK_S = 30.0
RELOAD = -1  # `serve`'s answer to SIGHUP: the caller executes the daemon again, same pid
RELOADING = (
    "SIGHUP: the daemon executes itself again (an upgrade takes effect); with live_restore "
    "the server runs on and is adopted, without it it is stopped and started again"
)


def raise_fd_limit() -> None:
    """The soft descriptor limit up to the hard one: a shell's default of 1024 is gone with a
    thousand idle connections, and then nothing (a sweep, a log, a probe) can open a file."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def run(args: argparse.Namespace) -> int:
    logsetup.configure()
    try:
        settings = load_settings(args.settings, listen=args.listen)
    except SettingsError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return 1
    rc = asyncio.run(serve(settings))
    if rc == RELOAD:  # the same pid (systemd's main), the program as installed now
        logging.shutdown()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (ignored across the exec, until handled)
        os.execv(sys.executable, sys.orig_argv)
    return rc
