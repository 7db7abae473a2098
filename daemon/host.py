"""The host: the one seam every side effect of the machine leaves through, a facade over parts
of one concern each: the launch (`launching.py`), the sweep after an exit (`exitsweep.py`),
probes (`probing.py`), the GPUs (`gpuwatch.py`), the retry (`retrying.py`), records and the
state file (`records.py`), the compile caches (`compilecache.py`), a swap's pre-warm
(`prewarm.py`), the weight cache's sidecar (`sidecar.py`), the front proxy (`frontproxy.py`),
and the tasks they all run in
(`tasks.py`).

The machine calls these methods while it decides; each returns at once. What takes time runs
in a part's task, which posts its outcome to the inbox as a message; an outcome known without
waiting (nothing to sweep, GPUs free at the first look, no backoff and an unchanged config) is
posted at once, in the same form, so a relaunch takes no task's turns of the loop on its way
to the exec. A launch's tasks live and die with it (`end_tasks`); every task's failure is
posted (`TaskFailed`); one that overruns its deadline makes supervision count as stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import psutil

from . import boot, serverparser
from .clock import Clock
from .compilecache import CompileCaches
from .configs import ConfigStore
from .exitsweep import SWEEP_DEADLINE_S, ExitSweep
from .frontproxy import FrontProxy
from .gpu import GpuBackend
from .gpuwatch import GpuWatch, SampleTarget
from .health import Prober
from .launching import Launching
from .messages import BootBegan, EventNoted, Message, PreviousServerStopped
from .prewarm import Prewarmer
from .probing import Probes
from .records import Records
from .retrying import Retry
from .server import shimstart
from .server.shimclient import ShimClient, ShimError
from .settings import Settings
from .sidecar import Sidecar
from .store import EventLog, StateStore
from .tasks import Tasks

AFTER_START_S = 5.0  # how long a launch is ready before its start's records are read

SHIM_RETRY_MAX_S = 30.0
SHIM_EXIT_WAIT_S = 2.0  # the shim's answer to "exit" at a shutdown without live_restore
SHIM_FALLBACK = "servers are started by the daemon itself: they do not outlive it"
SHIM_LOST = (
    "its servers' output and exits had no other way to the daemon: they are ended and started "
    "again under a new shim, sought at once"
)

if TYPE_CHECKING:
    from pathlib import Path

    from .effects import ServerHandle, ServerLog
    from .gpustate import KnownOurs
    from .model import Launch, PreviousServer, PrewarmProgress
    from .preflight import Preflight

SETTLED_KEPT = 32  # outcomes of settled swaps kept for `restart --wait` callers


class Host:
    def __init__(
        self,
        settings: Settings,
        *,
        gpu: GpuBackend,
        prober: Prober,
        store: StateStore,
        events: EventLog,
        configs: ConfigStore,
        preflight: Preflight,
        clock: Clock,
        post: Callable[[Message], None],
        sample_target: Callable[[], SampleTarget],
    ) -> None:
        self.tasks = tasks = Tasks(clock, post)  # every task of the host, scoped and reported
        self.real = tasks.real
        self.settings, self.configs, self.preflight, self.post = settings, configs, preflight, post
        self.records = Records(
            events=events,
            store=store,
            log_dir=settings.log_dir,
            log_retention=settings.log_retention,
            tasks=tasks,
            post=post,
        )
        self.launching = Launching(
            log_dir=settings.log_dir,
            log_max_bytes=settings.log_retention.max_bytes,
            clock=clock,
            tasks=tasks,
            post=post,
            after_exec=self.records.flush,  # what the relaunch held back, now that it runs
            shim=self._shim,
        )
        self.gpus = GpuWatch(
            settings=settings.gpu,
            gpu=gpu,
            tasks=tasks,
            post=post,
            sample_target=sample_target,
            sweep_deadline_s=SWEEP_DEADLINE_S,
        )
        self.caches = CompileCaches(settings.compile_cache, self.gpus.gpu_model)
        self.sidecar = Sidecar(
            log_dir=settings.log_dir,
            state_dir=settings.state_dir,
            tasks=tasks,
            post=post,
            gpus=self.gpus,
            interpreter=serverparser.interpreter_of,
        )
        self.launching.extra_env = self.caches.env_for
        self.exit_sweep = ExitSweep(gpus=self.gpus, tasks=tasks, post=post)
        self.probes = Probes(prober=prober, clock=clock, tasks=tasks, post=post)
        self.retry = Retry(configs=configs, clock=clock, tasks=tasks, post=post)
        self.prewarmer = Prewarmer(settings.prewarm, tasks, post)
        self.proxy = (
            None
            if settings.proxy is None
            else FrontProxy(
                settings.proxy,
                state_dir=settings.state_dir,
                log_dir=settings.log_dir,
                tasks=tasks,
                post=post,
            )
        )
        self.line_listeners = self.launching.line_listeners  # raw: redact to serve
        self.event_listeners = self.records.listeners
        self._settled: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.shim: ShimClient | None = None  # with live_restore: the servers' parent
        self._restarting: asyncio.Task[None] | None = None  # a lost shim's successor, starting
        self._retry: asyncio.Task[None] | None = None  # then sought again, backing off
        self._closing = False

    async def start_shim(self) -> None:
        """The shim of the state directory, found or started, before the boot (a previous
        life's servers run under it): every server runs under it. One that cannot be had is
        said, and servers are then started by the daemon itself (they do not outlive it)."""
        await self._connect_shim(again=False)
        if self.proxy is not None:  # (found running from the previous life, or started)
            await self.proxy.start()
        self.sidecar.restore(self.settings.live_restore)  # one the previous life left running

    async def _connect_shim(self, again: bool, delay_s: float = 0.0) -> None:
        """Connect to (or start) the shim; one lost is sought again and again, backing off to
        `SHIM_RETRY_MAX_S`, while launches meanwhile run under the daemon (as said)."""
        await asyncio.sleep(delay_s)
        folder = self.settings.state_dir / "shim"
        unit = os.environ.get(shimstart.EXTERNAL_ENV)
        try:
            if unit:  # its own unit runs it (and starts it again): never one of ours
                shim, started = await shimstart.connect_external(folder), None
            else:
                shim, started = await shimstart.connect_or_start(folder)
        except Exception as exc:  # OSError, ConnectionError: said, and the daemon runs them
            if delay_s < SHIM_RETRY_MAX_S:  # said while backing off, not every 30 s for ever
                self._event("shim_unavailable", error=str(exc), detail=SHIM_FALLBACK)
            if again and not self._closing:  # (a shim refused at the start is not sought again)
                # A launch waits for the first try only (`_shim`): not for these.
                later = min(max(2 * delay_s, 1.0), SHIM_RETRY_MAX_S)
                self._retry = self.tasks.task(self._connect_shim(True, later), name="shim")
            return
        self.shim = shim
        shim.lost.add_done_callback(self._shim_lost)
        started_now = started is not None
        self._event("shim_connected", pid=shim.shim_pid, started=started_now, again=again or None)

    def _shim_lost(self, lost: asyncio.Future[str]) -> None:
        """The shim's connection ended (it was killed, or it failed): said, and a new one is
        started at once. The servers it ran are ended by their exit sweeps (their output and
        exit had no other way to the daemon) and relaunched under the new one."""
        if self._closing:
            return
        self._event("shim_lost", error=lost.result(), detail=SHIM_LOST)
        self.shim = None
        self._restarting = self.tasks.task(self._connect_shim(again=True), name="shim")

    def _shim(self) -> ShimClient | asyncio.Future[Any] | None:
        shim, restarting = self.shim, self._restarting
        if shim is not None and not shim.lost.done():
            return shim
        return restarting if restarting is not None and not restarting.done() else None

    def _event(self, kind: str, **fields: Any) -> None:
        self.post(EventNoted(kind, fields))

    async def close(self) -> None:
        self._closing = True
        for task in (self._restarting, self._retry):
            if task is not None:
                task.cancel()
        if self.shim is not None:
            if not self.settings.live_restore and not os.environ.get(shimstart.EXTERNAL_ENV):
                # Its servers were stopped (the shutdown's stop): it ends with the daemon.
                with contextlib.suppress(ConnectionError, ShimError, TimeoutError):
                    await asyncio.wait_for(self.shim.request("exit"), SHIM_EXIT_WAIT_S)
            self.shim.close()  # with live_restore, the shim and its servers run on
        if self.proxy is not None:  # (with live_restore it runs on, holding, until the next life)
            await self.proxy.close(self.settings.live_restore)
        await self.records.close()
        self.prewarmer.cancel()  # its thread ends within a chunk: the daemon's exit waits for it
        self.prewarmer.release("the daemon stopped")
        await self.sidecar.close()
        self.tasks.cancel_all()
        await self.probes.close()

    # -- tasks and timers ------------------------------------------------------------------------

    def timer(self, seconds: float, msg: Message, launch: Launch | None = None) -> None:
        self.tasks.timer(seconds, msg, launch)

    def end_tasks(self, launch: Launch) -> None:
        self.tasks.end_tasks(launch)

    def overdue(self) -> str | None:
        return self.tasks.overdue()

    # -- records and the state file --------------------------------------------------------------

    def record(self, record: dict[str, Any]) -> None:
        self.records.record(record)

    def hold_records(self) -> None:
        self.records.hold()

    def flush_records(self) -> None:
        self.records.flush()

    def save(self, record: dict[str, Any]) -> None:
        self.records.save(record)

    def save_again(self) -> None:
        self.records.save_again()

    def prune_logs(self, protect: set[str], order: list[str]) -> None:
        self.records.prune_logs(protect, order)

    def swap_settled(self, swap_id: str, outcome: dict[str, Any]) -> None:
        self.prewarmer.release("the swap settled")  # the new server has read what it held
        fut = self.settled(swap_id)
        if not fut.done():
            fut.set_result(outcome)
        while len(self._settled) > SETTLED_KEPT:
            del self._settled[next(iter(self._settled))]

    def settled(self, swap_id: str) -> asyncio.Future[dict[str, Any]]:
        """A swap's outcome, once it has one."""
        fut = self._settled.get(swap_id)
        if fut is None:
            fut = self._settled[swap_id] = asyncio.get_running_loop().create_future()
        return fut

    def prewarm(self, swap_id: str, files: Sequence[Path], progress: PrewarmProgress) -> None:
        self.prewarmer.start(swap_id, files, progress)

    def cancel_prewarm(self) -> None:
        self.prewarmer.cancel()

    # -- the GPUs --------------------------------------------------------------------------------

    def wait_for_gpus(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        """Before the GPU wait, the versions of the server's interpreter its cache folder is
        named by, asked once (a task) and known at once from then on; and for a config with
        the weight cache (or while a sidecar runs) the sidecar it wants, ready."""
        argv, env = launch.config.argv, launch.config.process_env(self.launching.base_env)
        if self.caches.known(argv, env) and not self.sidecar.involved(launch):
            self.gpus.wait_for_gpus(launch, known_ours, unresolved)
            return

        async def learn_then_wait() -> None:
            await self.caches.learn(argv, env)
            # The weight cache's sidecar it wants runs (another is stopped) before the wait.
            if await self.sidecar.prepare(launch, env, known_ours, unresolved):
                self.gpus.wait_for_gpus(launch, known_ours, unresolved)

        # The GPU wait's own task until the wait begins (a stop or swap cancels it the same
        # way; a failure is the GPU wait's, which the machine recovers from).
        self.gpus.waiting(self.tasks.task(learn_then_wait(), gen=launch.gen, name="wait_for_gpus"))

    def stop_weight_cache(self, reason: str) -> None:
        self.sidecar.stop_soon(reason)

    def cancel_gpu_wait(self) -> None:
        self.gpus.cancel_gpu_wait()

    def refresh_gpus(self) -> None:
        self.gpus.refresh_gpus()

    def poll_gpus(self) -> None:
        self.gpus.poll_gpus()

    # -- the launch, its probes, its end ---------------------------------------------------------

    def spawn(self, launch: Launch) -> None:
        self.launching.spawn(launch)

    def adopt(self, launch: Launch) -> None:
        self.launching.adopt(launch)
        if launch.child is not None:  # the compile caches' folder it runs with is in use
            with contextlib.suppress(psutil.Error):
                self.caches.adopted(psutil.Process(launch.child.pid).environ())

    def abandon(self, server: ServerHandle, log: ServerLog) -> None:
        self.launching.abandon(server, log)

    def terminate(self, launch: Launch) -> None:
        self.launching.terminate(launch)

    def kill_group(self, launch: Launch) -> None:
        self.launching.kill_group(launch)

    def close_launch(self, launch: Launch, note: str) -> None:
        self.launching.close_launch(launch, note)

    def probe(self, launch: Launch, readiness: bool) -> None:
        self.probes.probe(launch, readiness)
        if not readiness:
            self.tasks.task(self._after_start(launch), launch=launch, name="read_startup")

    async def _after_start(self, launch: Launch) -> None:
        """Ready for `AFTER_START_S`: what is read of a start once it is over (SGLang's own
        account of it, then the compile caches' sizes, pruned), out of the way of a crash that
        follows at once (a crash loop's restarts lost about 1 ms to it)."""
        await self.probes.clock.sleep(AFTER_START_S)
        await self.probes.read_startup(launch)
        if self.caches.settings.enabled:
            await self.caches.scan_and_prune()

    def check_listener(self, launch: Launch, how: str) -> None:
        self.probes.check_listener(launch, how)

    def sweep(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        self.exit_sweep.sweep(launch, known_ours, unresolved)

    def retry_after(self, delay_s: float, gen: int, config: str | None) -> None:
        self.retry.retry_after(delay_s, gen, config)

    def cancel_retry(self) -> None:
        self.retry.cancel_retry()

    # -- the boot (boot.py's, in tasks of the host) ----------------------------------------------

    def stop_previous(self, previous: PreviousServer) -> None:
        self.tasks.task(self._stop_previous(previous))

    async def _stop_previous(self, previous: PreviousServer) -> None:
        killed = await boot.stop_previous(previous, self.settings.stop.grace_s)
        shim = self.shim
        if shim is not None and not shim.lost.done():  # one the shim ran: done with there too
            held = shim.servers.get(previous.launch_id)
            if held is not None:
                held.release(boot.STOPPED_AT_BOOT)
            else:
                shim.tell("release", launch_id=previous.launch_id, trailer=boot.STOPPED_AT_BOOT)
        self.post(PreviousServerStopped(previous, killed))

    async def survey(self, store: StateStore, boot_id: str) -> BootBegan:
        """What the previous life left (`boot.survey`), the shim (found or started first) asked
        what it runs."""
        await self.start_shim()
        return await boot.survey(
            store,
            boot_id,
            self.settings.state_dir,
            self.shim,
            self.configs,
            live_restore=self.settings.live_restore,
        )

    def boot_start(self, config: str, rollback: str | None) -> None:
        self.tasks.task(self._boot_start(config, rollback), deadline_s=boot.BOOT_DEADLINE_S)

    async def _boot_start(self, config: str, rollback: str | None) -> None:
        self.post(await boot.boot_start(self.configs, self.preflight, config, rollback))
