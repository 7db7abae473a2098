"""The supervisor: the actor that owns the server's lifecycle, and its public face.

One task (`run`) hands each inbox message to the machine (`machine.py`), which decides; what it
decides leaves through the host (`host.py`), whose tasks post their outcomes back. After each
message the state is saved (if it changed), readers get a new frozen snapshot, waiters wake.
Commands do their slow part (config read, preflight) before posting, after taking a ticket.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gpuwarden.daemon import logsetup

from . import errors, reading, recovery, saved, views
from . import messages as msgs
from .clock import Clock, SystemClock
from .configs import ConfigStore
from .errors import CommandError
from .gpu import GpuBackend
from .gpuwatch import SampleTarget
from .health import HttpProber, Prober
from .host import Host
from .machine import Machine
from .messages import Message, ShutdownRequested
from .preflight import Preflight, PreflightResult
from .probation import already_ready, restart_outcome, swap_outcome
from .redact import Redactor
from .server import reaper
from .settings import Settings
from .states import HOLD_RECORDS_STATES, RELAUNCH_STATES, ServerState
from .store import EventLog, StateStore
from .weightfiles import weight_files

log = logsetup.get_logger("gpuwarden.supervisor")

# The owner handles a message in milliseconds; one taking this long means supervision is stuck
# (the watchdog stops being fed). Config reads are bounded well below it.
OWNER_STALL_S = 60.0
# The longest a change waits to be saved during a relaunch (`RELAUNCH_STATES`): the exec's
# outcome normally comes first and is saved with it; a long backoff or stop, after this.
SAVE_DEFER_S = 0.25


class SweepRunner(Protocol):
    """What the supervisor asks of the sweeps' runner (`sweep.SweepManager`)."""

    def running_view(self) -> dict[str, Any] | None: ...
    async def cancel_for_stop(self) -> None: ...


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        gpu: GpuBackend,
        *,
        configs: ConfigStore | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        prober: Prober | None = None,
        store: StateStore | None = None,
        events: EventLog | None = None,
        preflight: Preflight | None = None,
    ) -> None:
        self.settings, self.gpu = settings, gpu
        self.configs = configs or ConfigStore(settings.configs_dir)
        self.clock: Clock = clock or SystemClock()
        self.store = store or StateStore(settings.state_dir)
        self.events = events or EventLog(
            settings.state_dir / "events.jsonl", retain=settings.retention.events
        )
        self.preflight = preflight or Preflight()
        # Each message with the future its sender awaits the answer on (None: nobody waits).
        self._inbox: asyncio.Queue[tuple[Message, asyncio.Future[Any] | None]] = asyncio.Queue()
        self.host = Host(
            settings,
            gpu=gpu,
            prober=prober or HttpProber(),
            store=self.store,
            events=self.events,
            configs=self.configs,
            preflight=self.preflight,
            clock=self.clock,
            post=self.post,
            sample_target=self._sample_target,
        )
        self.machine = Machine(settings, self.host, self.clock, rng or random.Random())
        self.line_listeners = self.host.line_listeners
        self.event_listeners = self.host.event_listeners
        self._snapshot: views.Snapshot | None = None
        self._changed = asyncio.Condition()
        self._boot_id = reaper.boot_id()
        self._ticket = 0
        self._booted = asyncio.Event()  # set: the previous life's record is in the machine
        self._shutdown_replies: list[asyncio.Future[Any]] = []
        self._handling_since: float | None = None  # when the owner took its message
        self._owner: asyncio.Task[Any] | None = None
        self._status: tuple[views.Snapshot, dict[str, Any]] | None = None  # status_fixed's
        self.sweeps: SweepRunner | None = None  # the sweeps' runner (`attach_sweeps`)
        self._save_timer: asyncio.TimerHandle | None = None
        self._asked: tuple[str | None, bool, str | None, str | None] | None = None  # last saved

    # -- the owner -------------------------------------------------------------------------------

    async def run(self) -> None:
        self._owner = asyncio.current_task()
        self.host.poll_gpus()
        began = await self.host.survey(self.store, self._boot_id)  # (its shim first)
        with contextlib.suppress(TypeError, ValueError):  # events.jsonl may be gone: go on
            self.events.seq = max(self.events.seq, int(began.record.get("events_seq") or 0))
        # The first message, before any command: those asked meanwhile wait in the inbox.
        self._dispatch(began, None)
        self._booted.set()
        await self._handled()
        try:
            while not self.machine.finished:
                msg, reply = await self._inbox.get()
                self._handling_since = self.host.real.monotonic()
                self._dispatch(msg, reply)
                await self._handled()
                self._handling_since = None
        finally:
            self._save(now=True)
            await self.host.close()

    def _dispatch(self, msg: Message, reply: asyncio.Future[Any] | None) -> None:
        try:
            result = self.machine.handle(msg)
        except CommandError as exc:
            if reply is not None and not reply.done():
                reply.set_exception(exc)
            return
        except Exception as exc:  # a bug must not take supervision down
            log.exception("supervisor.error", message=type(msg).__name__)
            if reply is not None and not reply.done():
                reply.set_exception(exc)
            else:
                with contextlib.suppress(Exception):
                    recovery.recover(self.machine, type(msg).__name__, exc)
            return
        if isinstance(msg, ShutdownRequested):
            if reply is not None:
                self._shutdown_replies.append(reply)
        elif reply is not None and not reply.done():
            reply.set_result(result)
        if self.machine.finished:
            for waiting in self._shutdown_replies:
                if not waiting.done():
                    waiting.set_result(None)

    async def _handled(self) -> None:
        # On the way from a server's end to the next exec (backoff with no delay, the GPU wait,
        # the exec) the records wait for the exec: the restart path writes nothing it can
        # write after it. Everywhere else they are written at the end of each turn.
        if self.machine.state in HOLD_RECORDS_STATES and not self.machine.finished:
            self.host.hold_records()
        else:
            self.host.flush_records()
        self._save()
        self._snapshot = None
        if self.host.proxy is not None:  # the front proxy holds, opens or rejects on this
            self.host.proxy.publish(self.machine, self.snapshot, self.clock.monotonic())
        async with self._changed:
            self._changed.notify_all()

    def _save(self, now: bool = False) -> None:
        m = self.machine
        if not m.dirty:
            return
        # What was asked (intent, swap, sweep) is saved at once; a relaunch's passing states wait.
        asked = (
            m.intent.config,
            m.intent.running,
            m.swaps.current.id if m.swaps.current is not None else None,
            m.intent.sweep,
        )
        if not now and m.state in RELAUNCH_STATES and not m.finished and asked == self._asked:
            if self._save_timer is None:
                self._save_timer = asyncio.get_running_loop().call_later(
                    SAVE_DEFER_S, self._deferred_save
                )
            return
        if self._save_timer is not None:
            self._save_timer.cancel()
            self._save_timer = None
        m.dirty = False
        self._asked = asked
        # The last event's seq too: a later life goes on from it should events.jsonl be gone.
        self.host.save({**saved.record(m, self._boot_id), "events_seq": self.events.seq})

    def _deferred_save(self) -> None:
        self._save_timer = None
        self._save(now=True)

    def post(self, msg: Message) -> None:
        self._inbox.put_nowait((msg, None))

    def post_event(self, kind: str, **fields: Any) -> None:  # (from outside the owner)
        self.post(msgs.EventNoted(kind, fields))

    # -- commands --------------------------------------------------------------------------------

    async def request(self, msg: Message) -> Any:
        """Post a message and wait for the machine's answer to it (a refusal raises)."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait((msg, reply))
        return await reply

    def _take_ticket(self, op: str, config: str | None = None) -> int:
        """A command's place among stops, taken and logged (`api.command`) as it arrives."""
        self._ticket += 1
        log.info("api.command", op=op, config=config, ticket=self._ticket)
        return self._ticket

    async def check(self, name: str) -> PreflightResult:
        """The preflight of a config, without touching what runs."""
        cfg, invalid = await reading.for_command(self.configs, name)
        if cfg is None:
            return invalid
        return await self.preflight.check(cfg, replacing_port=self.snapshot().replacing_port)

    async def start(self, config: str | None = None) -> Any:
        ticket = self._take_ticket("start", config)  # before any await: its place among stops
        name = config or self.snapshot().intent_config or self.settings.default_config
        cfg, invalid = await reading.for_command(self.configs, name)
        pre = invalid if cfg is None else await self.preflight.check(cfg)
        return await self.request(
            msgs.StartRequested(name, preflight=pre, resolved=cfg, ticket=ticket)
        )

    async def stop(self) -> Any:
        ticket = self._take_ticket("stop")
        if self.sweeps is not None:  # stop wins over a sweep: it ends, restoring nothing
            await self.sweeps.cancel_for_stop()
        return await self.request(msgs.StopRequested(ticket=ticket))

    async def restart(
        self,
        config: str | None = None,
        wait: bool = False,
        sweep_id: str | None = None,
        ensure: bool = False,
        probation: bool = False,
    ) -> Any:
        """Restart, or swap when `config` names another config. A swap is preflighted first:
        a refused one touches nothing. `ensure`: nothing to do if that config is ready.
        `probation` (with `wait`): a swap that came up is answered once its probation is over,
        so `ready` means it stayed up for probation_s (a crash in it answers the rollback)."""
        ticket = self._take_ticket("restart", config)
        snap = self.snapshot()
        cfg = await reading.resolve(
            self.configs, config or snap.intent_config or self.settings.default_config
        )
        pre = None
        if cfg.name != snap.current_config:
            pre = await self.preflight.check(cfg, replacing_port=snap.replacing_port)
            if not pre.ok:
                extra = {"problems": pre.problems, "warnings": pre.warnings}
                raise CommandError(errors.PREFLIGHT_REFUSED, "; ".join(pre.problems), extra)
        serving = snap.state in (ServerState.READY, ServerState.UNHEALTHY)
        # A swap away from a server that serves pre-warms its config's weight files.
        swapping = self.settings.prewarm.enabled and cfg.name != snap.current_config and serving
        env = cfg.process_env(self.host.launching.base_env)
        weights = await asyncio.to_thread(weight_files, cfg, env) if swapping else ()
        last_good = (
            None if serving else await reading.quietly(self.configs, snap.last_good_config, cfg)
        )
        reply = await self.request(
            msgs.RestartRequested(
                cfg.name,
                preflight=pre,
                sweep_id=sweep_id,
                resolved=cfg,
                ticket=ticket,
                last_good=last_good,
                ensure=ensure,
                weights=weights,
            )
        )
        if not wait:
            return reply
        outcome: dict[str, Any]
        if reply["swap_id"] is None:  # ensured: it was ready already
            outcome = already_ready(cfg.name)
        else:
            outcome = await self._settled(reply["swap_id"])
            if probation and outcome["outcome"] == "ready" and outcome["launch_ids"]:
                if cfg.name == snap.current_config:
                    outcome = await restart_outcome(
                        self.machine, self._until, self.clock, reply["swap_id"], outcome
                    )
                else:
                    outcome = await swap_outcome(
                        self.machine, self._until, self._settled, reply["swap_id"], outcome
                    )
        # The state now, not the one at acceptance (which was stopping or waiting_gpu).
        return {**reply, **outcome, "state": str(self.snapshot().state)}

    async def _settled(self, swap_id: str) -> dict[str, Any]:
        return await asyncio.shield(self.host.settled(swap_id))

    async def _until(self, predicate: Callable[[], bool]) -> None:
        """Wake on every handled message until `predicate()` holds."""
        async with self._changed:
            await self._changed.wait_for(predicate)

    async def shutdown(self) -> None:
        """Stop the server (the saved intent is kept) and end `run`."""
        await self.request(ShutdownRequested())

    def attach_sweeps(self, runner: SweepRunner) -> None:
        """The sweeps' runner: `/status` shows its sweep's progress, and a stop ends it."""
        self.sweeps = runner

    def sweep_began(self, sweep_id: str, restore_to: str | None = None) -> None:
        """A sweep runs: other swaps are refused until it ends; `restore_to` is the config it
        ends on."""
        self.post(msgs.SweepBegan(sweep_id, restore_to))

    def sweep_ended(self, sweep_id: str) -> None:
        self.post(msgs.SweepEnded(sweep_id))

    def kill_server_now(self) -> None:
        """The last resort of a shutdown that did not finish: SIGKILL to the server's group."""
        launch = self.machine.launch
        if launch is not None and launch.running:
            self.host.kill_group(launch)

    # -- readers ---------------------------------------------------------------------------------

    def snapshot(self) -> views.Snapshot:
        """The machine as of the last handled message (frozen; taken at most once per message)."""
        if self._snapshot is None:
            self._snapshot = views.take(self.machine)
        return self._snapshot

    def _sample_target(self) -> SampleTarget:
        """What the once-a-second GPU sample is of, as of the last handled message."""
        snap = self.snapshot()
        return SampleTarget(
            gen=snap.gen,
            pid=snap.pid,
            watching_ranks=snap.watching_ranks,
            unresolved_noted=snap.gpu_pids_unresolved,
            waiting=snap.state == ServerState.WAITING_GPU,
        )

    async def wait_for(self, predicate: Callable[[Supervisor], bool], timeout: float) -> None:
        """Wake on every handled message until `predicate(self)` holds."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    async def wait_for_state(self, *states: ServerState, timeout: float = 10.0) -> None:
        await self.wait_for(lambda s: s.machine.state in states, timeout)

    def stuck(self) -> str | None:
        """Why supervision is stuck, or None. The watchdog is fed only while this is None."""
        if self._owner is not None and self._owner.done():
            return "the supervisor's owner task has ended"
        took = self.host.real.monotonic() - (self._handling_since or self.host.real.monotonic())
        if took > OWNER_STALL_S:  # real time: the watchdog's, also under a test's clock
            return f"the owner has been handling one message for {took:.0f} s"
        return self.host.overdue()

    def status(self) -> dict[str, Any]:
        """`GET /status`: built once per snapshot; the fields that move with time are read
        per call. The nested values are shared between calls: readers must not change them."""
        snap = self.snapshot()
        cached = self._status
        if cached is None or cached[0] is not snap:
            cached = self._status = (snap, views.status_fixed(snap, gpu_backend=self.gpu.name))
        return views.status_now(
            cached[1],
            snap,
            now_mono=self.clock.monotonic(),
            real_mono=self.host.real.monotonic(),
            sweep=self.sweeps.running_view() if self.sweeps is not None else None,
            supervising=self.stuck() is None,
            booting=self.booting(),
            proxy=self.host.proxy.view() if self.host.proxy is not None else None,
        )

    def booting(self) -> bool:
        """The previous life is being restored: its record read, its server stopped, the
        saved intent read and preflighted."""
        return not self._booted.is_set() or self.snapshot().booting

    async def restored(self) -> None:
        await self._booted.wait()  # (the history: an earlier launch's record masks its log)

    def redactor_for(self, record: Mapping[str, Any] | None) -> Redactor:
        """A redactor for the log of the launch whose history entry is `record`."""
        salt = self.machine.ledger.secret_salt
        return views.redactor_for(self.snapshot(), self.configs, record, salt)
