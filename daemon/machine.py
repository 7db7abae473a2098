"""The machine: every decision about the server's lifecycle, top to bottom.

`handle(msg)` decides on one message synchronously, dispatched by one explicit `match`: no
awaits, processes, files or clocks of its own. `Machine` holds the lifecycle's fields and is
their one writer (the state only through `transition`, checked against `states.py`'s table).
It composes parts that own their fields: `Swaps` (`swaps.py`, a swap's phase, outcome and
rollback), `Booting` (`booting.py`, the daemon's start under way), `Attempts` (`attempt.py`,
a launch's steps and its record), `Evidence` (`evidence.py`, what the running launch's
signals say), `Retries` (`policy.py`, the failures in a row and what follows one) and a
`Ledger` (`ledger.py`, the records that decide nothing). What it decides leaves through the
host (`host.py`), whose tasks post outcomes back; sites say `# FROM -> TO`.

A crash, read top to bottom: `ServerExited` (`# READY -> STOPPING`, host.sweep) → `SweepFinished`
(classify, record, the restart policy: `# STOPPING -> BACKOFF`, host.retry_after) →
`BackoffElapsed` (`# BACKOFF -> WAITING_GPU`, host.wait_for_gpus) → `GpuWaitEnded`
(host.spawn) → `Spawned` (`# WAITING_GPU -> STARTING`, probes and the startup timer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, assert_never

from . import errors, saved
from . import messages as ms
from .attempt import Attempts
from .booting import Booting
from .effects import Effects
from .errors import CommandError
from .evidence import Dead, Evidence, NotLive, Ready, Signal
from .ledger import Ledger
from .model import Adoptee, Intent, Launch, Next, utc_iso, utc_stamp
from .policy import Classification, Retries
from .states import LIVE_STATES, RUNNING_STATES, SERVING_STATES, ServerState, check_transition
from .swaps import Swaps

if TYPE_CHECKING:
    import random

    from .clock import Clock
    from .resolvedconfig import ResolvedConfig
    from .settings import Settings


LEFT_RUNNING = "live_restore: the server runs on under the shim; the daemon's next start adopts it"


class Machine:
    def __init__(self, settings: Settings, host: Effects, clock: Clock, rng: random.Random) -> None:
        self.settings, self.host, self.clock = settings, host, clock
        self.state, self.state_since = ServerState.STOPPED, clock.time()
        self.finished = False  # the daemon's shutdown is complete: the owner ends
        self.dirty = False  # the saved state is stale: saved once after this message
        self.gen = 0
        self.launch: Launch | None = None
        self.intent = Intent()  # what is asked to run, and what is known good
        self.next_retry_at: float | None = None
        self.launch_seq = 0
        self.stop_ticket = 0
        self.saving_again = False
        self.ledger = Ledger(clock, self.event)  # the records, which decide nothing
        self.swaps = Swaps(self.event, host.swap_settled)  # a swap or restart under way
        self.booting = Booting(host, self.event)  # the daemon's start, while under way
        self.evidence = Evidence(host, self.event)  # the running launch's, judged
        self.retries = Retries(settings.restart, rng, self.event)  # the restart policy's count
        self.attempts = Attempts(settings, host, clock, self.ledger, self.event)  # their steps

    def handle(self, msg: ms.Message) -> Any:
        """Decide on one message. A command's answer is returned (a refusal raises
        `CommandError`); a shutdown's is given once `finished` holds."""
        match msg:
            # The restart path first: an exit, its sweep, the retry, the GPU wait, the exec.
            case ms.ServerExited():
                self.on_server_exited(msg)
            case ms.SweepFinished():
                self.on_sweep_finished(msg)
            case ms.BackoffElapsed():
                self.on_backoff_elapsed(msg)
            case ms.GpuWaitEnded():
                self.on_gpu_wait_ended(msg)
            case ms.Spawned():
                self.on_spawned(msg)
            case ms.Adopted():
                self.on_adopted(msg)
            case ms.SpawnFailed():
                self.on_spawn_failed(msg)
            # What the running launch signals: noted by the ledger, judged by its evidence.
            case ms.LineParsed() | ms.GpuSampled():
                if self.ledger.note(msg, self.current(msg.gen)):
                    self.persist()  # a GPU holder known as ours: a later life knows its orphans
                self.on_signal(msg)
            case (
                ms.ProbeSucceeded() | ms.ListenerChecked() | ms.ProbeFailed() | ms.StartupTimedOut()
            ):
                self.on_signal(msg)
            case ms.GraceExpired():
                if launch := self.current(msg.gen):
                    self.attempts.grace_expired(launch)
            case ms.StableUptimeReached():
                if self.current(msg.gen) and self.state == ServerState.READY:
                    self.retries.stable()
                    self.persist()
            case ms.ProbationOver():
                launch = self.current(msg.gen)
                if launch and launch.on_probation and self.state == ServerState.READY:
                    self._probation_passed(launch, probation_s=self.settings.restart.probation_s)
            case ms.TaskFailed():
                self.on_task_failed(msg)
            # The commands.
            case ms.StartRequested():
                return self.start(msg)
            case ms.StopRequested():
                return self.stop(msg)
            case ms.RestartRequested():
                return self.restart(msg)
            case ms.ShutdownRequested():
                return self.shutdown(msg)
            case ms.SweepBegan():
                self.intent.sweep, self.intent.sweep_restore_to = msg.sweep_id, msg.restore_to
                self.persist()  # on record: a later life ends it (sweep_interrupted)
            case ms.SweepEnded():
                if self.intent.sweep == msg.sweep_id:
                    self.intent.sweep, self.intent.sweep_restore_to = None, None
                    self.persist()
            # The boot.
            case ms.BootBegan():
                self.on_boot_began(msg)
            case ms.PreviousServerStopped():
                self.booting.previous_stopped(msg)
                self._boot_go_on(msg.previous.launch_id if msg.previous.alive else "")
            # Records that decide nothing, and the state file's writes.
            case ms.ServerFiguresRead() | ms.OrphansKilled() | ms.WriteHealthChanged():
                self.ledger.note(msg, self.launch)
            case ms.EventNoted():
                self.event(msg.kind, **msg.fields)
            case ms.StateSaved():
                self.ledger.note_write_health("state", msg.error)
                if msg.error is not None and not self.saving_again:
                    self.saving_again = True  # keep trying: the file is stale until it works
                    self.host.save_again()
            case ms.SaveDelayElapsed():
                self.saving_again = False
                self.persist()
            case _:
                assert_never(msg)
        return None

    # -- the commands: each refuses (`CommandError`, by kind) or acts, and answers ------------
    # "Stop wins": a stop refuses whatever was asked before it and is still on its way.

    def _cancelled_by_stop(self, ticket: int, what: str) -> None:
        if ticket and ticket < self.stop_ticket:
            raise CommandError(
                errors.CONFLICT, f"a stop was requested after this {what}; it was not carried out"
            )

    def start(self, msg: ms.StartRequested) -> dict[str, Any]:
        if msg.boot:
            self.booting.start_arrived(msg.config)
        else:
            self.booting.refuse_while_stopping("start")
        self._cancelled_by_stop(msg.ticket, "start")
        if not msg.boot:  # a boot resumes an interrupted swap as that swap
            self.swaps.refuse_if_under_way(self.intent.sweep)
        if self.state in (ServerState.WAITING_GPU, *RUNNING_STATES):
            raise CommandError(
                errors.CONFLICT,
                f"a server is already {self.state} (config {self.current_config()}); "
                "use restart to swap",
            )
        self.booting.replaced()  # a start carried out (or refused by its preflight, below)
        pre = msg.preflight
        if pre is not None and not pre.ok:
            detail = "; ".join(pre.problems) or "preflight failed"
            self.refuse(msg.config, detail)
            raise CommandError(
                errors.PREFLIGHT_REFUSED,
                detail,
                extra={"problems": pre.problems, "warnings": pre.warnings},
            )
        cfg = msg.resolved
        if cfg is None:  # the facade reads it first; one that did not read comes refused above
            raise CommandError(errors.INVALID_CONFIG, f"config {msg.config!r} was not read")
        rollback = msg.boot and self.swaps.resumed_read(msg.last_good, self.intent.last_good_config)
        self.host.cancel_retry()
        self.retries.reset()
        self.set_intent(cfg.name, True)
        self.begin_attempt(cfg, rollback=rollback)
        return {"accepted": True, "config": cfg.name, "state": str(self.state)}

    def stop(self, msg: ms.StopRequested) -> dict[str, Any]:
        # Stop wins: whatever was asked before it and is still on its way (a preflight that
        # finishes later) is refused when it arrives.
        self.stop_ticket = max(self.stop_ticket, msg.ticket)
        self.set_intent(self.intent.config, False)
        # A boot under way starts nothing (the previous life's server still goes).
        self.booting.stop()
        if self.swaps.active() is not None:
            self.swaps.settle(
                "failed", "requested_stop", "stopped on request during the swap", self.intent.config
            )
        launch = self.launch
        if self.state in (ServerState.FAILED, ServerState.BACKOFF) or (
            self.state == ServerState.WAITING_GPU and (launch is None or not launch.spawning)
        ):
            self._cancel_waits()
            # FAILED|BACKOFF|WAITING_GPU -> STOPPED
            self.transition(ServerState.STOPPED, reason="requested_stop")
        elif self.state != ServerState.STOPPED and launch is not None:
            self.begin_stop(launch, Next.STOP)
        # The grace a waiting client bounds its wait by (SIGTERM, then SIGKILL after it).
        return {"accepted": True, "state": str(self.state), "grace_s": self.settings.stop.grace_s}

    def restart(self, msg: ms.RestartRequested) -> dict[str, Any]:
        self.booting.refuse_while_stopping("restart")
        self._cancelled_by_stop(msg.ticket, "restart")
        self.swaps.refuse_if_under_way(self.intent.sweep, msg.sweep_id)
        cfg = msg.resolved
        if cfg is None:
            raise CommandError(errors.INVALID_CONFIG, f"config {msg.config!r} was not read")
        self.booting.replaced()
        current = self.current_config()
        serving = self.serving()
        if msg.ensure and serving and self.state == ServerState.READY and current == cfg.name:
            return {"accepted": True, "config": current, "state": str(self.state), "swap_id": None}
        if serving is not None and serving.on_probation:
            # A swap away from a config on probation: its probation counts as passed, and it is
            # what this swap rolls back to (it was serving, not the older last-good).
            self._probation_passed(serving, detail="a swap began while it served")
        swap_id = f"swap-{self.launch_seq + 1}-{int(self.clock.time())}"
        last_good = (self.intent.last_good_config, msg.last_good)
        swap = self.swaps.begin(swap_id, cfg, current, serving, last_good)
        self.retries.reset()
        self.set_intent(cfg.name, True)
        launch = self.launch
        if (
            self.state in (*RUNNING_STATES, ServerState.WAITING_GPU)
            and launch is not None
            and (self.state != ServerState.WAITING_GPU or launch.spawning)
        ):
            self.begin_stop(launch, Next.RELAUNCH, next_config=cfg)
        else:
            self._cancel_waits()
            self.begin_attempt(cfg)
        return {"accepted": True, "config": cfg.name, "state": str(self.state), "swap_id": swap.id}

    def shutdown(self, msg: ms.ShutdownRequested) -> None:
        if self.booting.shutdown_waits():  # the daemon ends once the previous server is stopped
            return
        launch = self.launch
        child = launch.child if launch is not None and launch.running else None
        if child is not None and child.survives_daemon and self.state in LIVE_STATES:
            # Live restore: it runs on under the shim, and the next life adopts it.
            self.event("server_left_running", pid=child.pid, detail=LEFT_RUNNING)
            self.finished = True
            self.persist()
            return
        if launch is not None and (self.state in RUNNING_STATES or launch.spawning):
            self.begin_stop(launch, Next.SHUTDOWN)
            return
        self._cancel_waits()
        self.finished = True
        self.persist()

    def refuse(self, name: str | None, detail: str) -> None:
        """A start whose preflight failed (or whose config no longer reads): `failed`."""
        self.intent.config, self.intent.running = name, True
        self.ledger.note_exit("preflight_refused", detail)
        self.event("preflight_refused", config=name, detail=detail)
        if self.state != ServerState.FAILED:
            # STOPPED|BACKOFF -> FAILED
            self.transition(ServerState.FAILED, reason="preflight_refused")
        self.persist()

    # -- the one writer of the state, and what it reads --------------------------------------

    def transition(self, new: ServerState, **fields: Any) -> None:
        old = self.state
        check_transition(old, new)
        self.state, self.state_since = new, self.clock.time()
        if new != ServerState.BACKOFF:
            self.next_retry_at = None
        self.event("state", **{"from": str(old), "to": str(new)}, **fields)

    def event(self, kind: str, **fields: Any) -> None:
        """Record an event (events.jsonl, the API's listeners, the daemon's log)."""
        record: dict[str, Any] = {"ts": utc_iso(self.clock.time()), "event": kind}
        if self.launch is not None:
            record.setdefault("config", self.launch.config.name)
            if self.launch.launch_id:
                record["launch_id"] = self.launch.launch_id
        record.update({k: v for k, v in fields.items() if v is not None})
        self.host.record(record)

    def persist(self) -> None:
        self.dirty = True

    def current(self, gen: int) -> Launch | None:
        launch = self.launch
        return launch if launch is not None and launch.gen == gen else None

    def _cancel_waits(self) -> None:
        self.host.cancel_retry()
        self.host.cancel_gpu_wait()

    def set_intent(self, config: str | None, running: bool) -> None:
        self.intent.config, self.intent.running = config, running
        self.persist()

    def current_config(self) -> str | None:
        launch = self.launch
        if launch is not None and self.state in (ServerState.WAITING_GPU, *RUNNING_STATES):
            return launch.config.name
        return self.intent.config

    def serving(self) -> Launch | None:
        """The launch serving requests now (ready, or ready and failing probes)."""
        launch = self.launch
        if launch is None or launch.exited or launch.ready_at is None:
            return None
        return launch if self.state in SERVING_STATES else None

    def _probation_passed(self, launch: Launch, **fields: Any) -> None:
        launch.on_probation = False
        if self.intent.good(launch):
            self.event("probation_passed", **fields)
            self.persist()

    # -- the boot: what the previous life left ----------------------------------------------------

    def on_boot_began(self, msg: ms.BootBegan) -> None:
        """The previous life's record is restored at once (`/status` shows it, `booting`). Its
        server, verified under the shim and serving what is asked, is adopted (`_adopt`);
        otherwise a server that life left running is stopped (the host's `stop_previous`),
        then the saved intent starts, read and preflighted like any start (the host's
        `boot_start`), each step decided by the boot's own sub-machine (`booting.py`)."""
        self.ledger.secret_salt = msg.secret_salt
        if msg.note:
            self.event("state_file_corrupt", detail=msg.note)
        known = msg.alive_known
        plan = saved.plan_boot(
            msg.record, lambda pid, ct: (pid, ct) in known, self.settings.default_config
        )
        for kind, fields in plan.notes:
            self.event(kind, **fields)
        r = plan.restored
        self.intent, self.launch_seq = r.intent, r.launch_seq
        self.retries.reset(r.failures)
        self.ledger.restore(r.history, r.last_exit, r.known_ours)
        rollback = None
        if plan.swap is not None:
            self.swaps.resume(plan.swap, plan.swap_phase)
            rollback = plan.swap.rollback_name or self.intent.last_good_config
        self.persist()  # the previous life's record, brought up to date, is saved now
        self.ledger.note_unmanaged(msg.unmanaged)
        adoptee, prev = msg.adoptee, msg.previous
        stopping = adoptee is not None and bool(adoptee.record.get("stopping"))
        if adoptee is not None and adoptee.config.name == plan.config and not stopping:
            adopted = self._adopt(adoptee)  # it serves what is asked: supervised as it runs
            self.booting.begin(None, None, None)
            self._boot_go_on("", adopted)
            return
        if adoptee is not None:  # not what is asked to run, or being stopped: stopped, as ever
            prev = adoptee.previous()
        # The previous server's record, kept in state.json until it is stopped.
        previous = msg.record.get("current_launch") if prev is not None else None
        if self.booting.begin(plan.config, rollback, prev, previous):
            self._boot_go_on("")  # nothing of that life runs

    def _adopt(self, adoptee: Adoptee) -> str:
        """The previous life's server, verified under the shim, taken over in the state it was
        in (no signal sent to it): ready stays ready, starting goes on starting. A swap under
        way for it goes on. Its log, probes and timers follow with `Adopted`."""
        self.gen += 1
        swap = self.swaps.active()
        rollback = swap is not None and self.swaps.resumed_read(
            adoptee.rollback, self.intent.last_good_config
        )
        self.launch = launch = Launch(self.gen, adoptee.config, swap=swap, rollback=rollback)
        self.attempts.adopt(launch, adoptee)
        if swap is not None:
            self.swaps.spawned(swap, launch.launch_id)
        state = ServerState.STARTING if launch.ready_at is None else ServerState.READY
        # STOPPED -> STARTING|READY
        self.transition(state, reason="adopted", pid=adoptee.server.pid)
        self.host.adopt(launch)
        return launch.launch_id

    def on_adopted(self, msg: ms.Adopted) -> None:
        launch = self.current(msg.gen)
        if launch is None:
            return
        self.attempts.adopted(launch, msg.log)
        if launch.exited_at is not None:
            return  # it ended while the daemon was away: its exit comes next
        if self.state == ServerState.READY:
            self._ready_settles(launch)
        elif self.state == ServerState.STARTING:
            self.attempts.watch_adopted(launch)

    def _boot_go_on(self, stopped_id: str, adopted_id: str = "") -> None:
        """Nothing of the previous life runs any more: its launches get their exit records,
        and the boot goes on to its start (or the daemon ends: a shutdown asked meanwhile)."""
        if not self.booting.active:
            return
        self.ledger.close_unobserved(stopped_id, adopted_id)
        if self.booting.go_on():
            self.finished = True
        self.persist()

    # -- a launch's way up: the GPU wait, the exec, its signals, ready -------------------------

    def begin_attempt(self, cfg: ResolvedConfig, rollback: bool = False) -> None:
        self.gen += 1
        swap = self.swaps.active()
        self.launch = Launch(gen=self.gen, config=cfg, swap=swap, rollback=rollback)
        if swap is not None:
            self.swaps.attempt_began(swap)
        if self.state != ServerState.WAITING_GPU:
            # STOPPED|STOPPING|BACKOFF|FAILED -> WAITING_GPU
            self.transition(ServerState.WAITING_GPU, config=cfg.name)
        self.attempts.wait_for_gpus(self.launch)

    def on_gpu_wait_ended(self, msg: ms.GpuWaitEnded) -> None:
        launch = self.current(msg.gen)
        if launch is None or self.state != ServerState.WAITING_GPU:
            return
        if not msg.ok:
            timeout = self.settings.gpu.release_timeout_s
            busy = f"GPUs still busy after {timeout:g} s: {msg.busy}"
            self._fail(launch, Classification("gpu_busy", busy))
            return
        self.launch_seq += 1
        self.attempts.execute(launch, f"{utc_stamp(self.clock.time())}-{self.launch_seq:06d}")

    def on_spawn_failed(self, msg: ms.SpawnFailed) -> None:
        launch = self.current(msg.gen)
        if launch is None:
            return
        self.attempts.spawn_failed(launch)
        verdict = Classification(msg.reason, msg.detail)
        if self.state == ServerState.STOPPING:  # a stop or swap came while it executed
            self.ledger.record_exit(launch, verdict)
            self._after_stop(launch, verdict, recorded=True)
        else:
            self._fail(launch, verdict)

    def on_spawned(self, msg: ms.Spawned) -> None:
        launch = self.current(msg.gen)
        if launch is None:  # no attempt wants it (a spawn is never overtaken: defensive)
            self.host.abandon(msg.server, msg.log)
            return
        self.attempts.spawned(launch, msg.server, msg.log)
        if launch.swap is not None:
            self.swaps.spawned(launch.swap, launch.launch_id)
        self.persist()
        if self.state == ServerState.STOPPING:  # stopped while it executed: it goes now
            self.attempts.launched(launch)
            self.attempts.terminate(launch)
            return
        # WAITING_GPU -> STARTING
        self.transition(ServerState.STARTING, pid=msg.server.pid, log_file=str(msg.log.path))
        self.attempts.watch_start(launch, self.intent.protected_logs(launch.launch_id))

    def on_signal(self, msg: Signal) -> None:
        """A signal of the current launch, judged by its evidence (`evidence.py`), acted on."""
        launch = self.current(msg.gen)
        if launch is None:
            return
        noted = launch.rank_gpus is not None
        match self.evidence.judge(msg, launch, self.state):
            case Ready(how=how):
                self._became_ready(launch, how)
            case NotLive(reason=reason, evidence=evidence, unhealthy=unhealthy):
                if unhealthy is not None:  # READY -> UNHEALTHY
                    self.transition(ServerState.UNHEALTHY, detail=unhealthy)
                # STARTING|READY|UNHEALTHY -> STOPPING
                self._end_for_retry(launch, reason, evidence)
            case Dead(line=line):
                self.attempts.dead(launch, line)
                if self.state != ServerState.STOPPING:  # STARTING|READY|UNHEALTHY -> STOPPING
                    nxt, reason = str(launch.next), "death_announced"
                    self.transition(ServerState.STOPPING, next=nxt, reason=reason, detail=line)
        if not noted and launch.rank_gpus is not None:
            self.persist()  # the GPUs its ranks hold, on record

    def _became_ready(self, launch: Launch, how: str) -> None:
        took = self.attempts.ready(launch)
        # STARTING -> READY
        self.transition(ServerState.READY, via=how, time_to_ready_s=round(took, 3))
        self._ready_settles(launch)

    def _ready_settles(self, launch: Launch) -> None:
        """Ready (or adopted ready): its swap settles, and its probation begins (a swapped-in
        config becomes last-good only once it has stayed up); then it is watched as ready."""
        probation = self.settings.restart.probation_s
        if self.swaps.ready(launch, self.intent.config, probation):
            launch.on_probation = True
            self.host.timer(probation, ms.ProbationOver(launch.gen), launch)
        else:
            self.intent.good(launch)
        self.persist()
        self.attempts.watch_ready(launch)

    # -- a launch's way down: the stop, the exit, its sweep, and what follows ------------------

    def begin_stop(
        self,
        launch: Launch,
        nxt: Next,
        next_config: ResolvedConfig | None = None,
        imposed: Classification | None = None,
    ) -> None:
        under_way = self.state == ServerState.STOPPING
        if not under_way:
            # WAITING_GPU (executing)|STARTING|READY|UNHEALTHY -> STOPPING
            reason = imposed.reason if imposed else None
            self.transition(ServerState.STOPPING, next=str(nxt), reason=reason)
        self.attempts.stop(launch, nxt, next_config, imposed, under_way)

    def _end_for_retry(self, launch: Launch, reason: str, evidence: str) -> None:
        """We end this launch (it is not ready in time, not live, or lost a rank): stop it, and
        let the restart policy (or a swap's rollback) decide what follows."""
        self.begin_stop(launch, Next.RETRY, imposed=Classification(reason, evidence))

    def on_server_exited(self, msg: ms.ServerExited) -> None:
        launch = self.current(msg.gen)
        if launch is None or not self.attempts.exited(launch, msg.returncode, msg.unknown):
            return
        if self.state != ServerState.STOPPING:
            # STARTING|READY|UNHEALTHY -> STOPPING
            self.transition(
                ServerState.STOPPING, returncode=msg.returncode, detail="the server exited"
            )
        self.attempts.sweep(launch)

    def on_sweep_finished(self, msg: ms.SweepFinished) -> None:
        launch = self.current(msg.gen)
        if launch is None or launch.child is None or self.state != ServerState.STOPPING:
            return
        self._after_stop(launch, self.attempts.swept(launch, msg.killed), recorded=True)

    def _after_stop(self, launch: Launch, verdict: Classification, recorded: bool = False) -> None:
        """The launch is gone (swept, or never executed): what it was stopped for follows."""
        nxt = launch.next
        if nxt is None or nxt == Next.RETRY:
            self._fail(launch, verdict, recorded=recorded)
        elif nxt == Next.STOP:
            self.transition(ServerState.STOPPED, reason=verdict.reason)  # STOPPING -> STOPPED
        elif nxt == Next.RELAUNCH:
            assert launch.next_config is not None
            if not (self.swaps.current and self.swaps.current.is_swap):  # (swaps count apart)
                self.retries.restarted()
            self.begin_attempt(launch.next_config)  # STOPPING -> WAITING_GPU
        elif nxt == Next.SHUTDOWN:
            self.transition(ServerState.STOPPED, reason="daemon shutdown")  # STOPPING -> STOPPED
            self.finished = True
        self.persist()

    def _fail(self, launch: Launch, verdict: Classification, recorded: bool = False) -> None:
        if not recorded:
            self.ledger.record_exit(launch, verdict)
        self.ledger.count_exit(verdict.reason)
        if launch.launch_id:
            self.intent.last_failed_launch = launch.launch_id
        if self.swaps.rolls_back(launch):
            self._roll_back(launch, verdict)
            return
        self.swaps.failed(launch, verdict, self.intent.config)
        delay = self.retries.failed(verdict.reason)
        if isinstance(delay, str):  # not retried
            # WAITING_GPU|STOPPING -> FAILED
            self.transition(ServerState.FAILED, reason=verdict.reason, detail=delay)
        else:
            # WAITING_GPU|STOPPING -> BACKOFF
            self.transition(
                ServerState.BACKOFF,
                reason=verdict.reason,
                delay_s=round(delay, 3),
                failures=self.retries.failures,
            )
            self.next_retry_at = self.clock.time() + delay
            # Even with no delay the retry is a message of its own, after its config is read.
            self.host.retry_after(max(delay, 0.0), launch.gen, self.intent.config)
        self.persist()

    def _roll_back(self, launch: Launch, verdict: Classification) -> None:
        """A swapped-in config failed its first start or its probation: back at once, no
        backoff, to the config that served when the swap began (else the last good one)."""
        target = self.swaps.roll_back(
            launch, verdict, self.intent.last_good_config, self.launch_seq
        )
        if isinstance(target, str):  # nothing to go back to
            self.transition(ServerState.FAILED, reason=verdict.reason, detail=target)  # -> FAILED
            self.swaps.settle("failed", verdict.reason, verdict.evidence, self.intent.config)
            self.persist()
            return
        self.set_intent(target.name, True)
        self.begin_attempt(target, rollback=True)  # STOPPING|WAITING_GPU -> WAITING_GPU

    def on_backoff_elapsed(self, msg: ms.BackoffElapsed) -> None:
        launch = self.current(msg.gen)
        if launch is None or self.state != ServerState.BACKOFF:
            return
        ran = launch if launch.config.name == self.intent.config else None
        resolved = self.retries.retried_config(msg, ran)
        if resolved is None:
            self.refuse(self.intent.config, msg.error or "the config does not load")
            return
        self.retries.restarted()
        self.begin_attempt(resolved)  # BACKOFF -> WAITING_GPU

    # -- recovery: a helper task that raised, a message whose handling raised -------------------

    def on_task_failed(self, msg: ms.TaskFailed) -> None:
        """A helper task raised (descriptors exhausted, /proc unreadable, a bug): record it,
        then recover as if it had reported failure, so the machine never waits for a message
        that will not come."""
        self.ledger.internal_errors += 1
        self.event("internal_error", task=msg.name, error=msg.error)
        launch = self.current(msg.gen)
        evidence = f"the {msg.name} task failed: {msg.error}"
        match msg.name:
            case "after_exit":  # the exit is handled unswept (the next GPU wait kills leftovers)
                if launch is not None and launch.exited:
                    self.on_sweep_finished(ms.SweepFinished(msg.gen, []))
            case "spawn":  # no process came of it
                self.on_spawn_failed(ms.SpawnFailed(msg.gen, "internal_error", evidence))
            case "retry":  # its config read is lost: as a config that did not read
                self.on_backoff_elapsed(ms.BackoffElapsed(msg.gen, None, evidence))
            case "wait_for_gpus":  # retried
                if launch and self.state == ServerState.WAITING_GPU and not launch.spawning:
                    self._fail(launch, Classification("internal_error", evidence))
            case "stop_previous":  # as stopped: the GPU wait kills what holds GPUs
                self._boot_go_on("")
            case "boot_start":
                if not self.booting.active:
                    return  # a command asked during the boot replaced its start
                self.booting.start_failed()
                if self.state == ServerState.STOPPED:
                    self.ledger.note_exit("internal_error", evidence)
                    # STOPPED -> FAILED
                    self.transition(ServerState.FAILED, reason="internal_error", detail=evidence)
            case _ if launch is not None and launch.running and self.state in LIVE_STATES:
                # A probe loop or timer of this launch is gone: nothing would notice a hang or
                # a timeout any more, so end it and let the restart policy start it afresh.
                self._end_for_retry(launch, "internal_error", evidence)

    def recover(self, message: str, exc: Exception) -> None:
        """An internal message whose handling raised (a bug): say so, and where the launch has
        already exited, go to failed rather than wait in stopping for ever."""
        self.ledger.internal_errors += 1
        evidence = f"handling {message} failed: {type(exc).__name__}: {exc}"
        self.event("internal_error", message=message, error=evidence)
        launch = self.launch
        if self.state == ServerState.STOPPING and (launch is None or launch.exited):
            # STOPPING -> FAILED
            self.transition(ServerState.FAILED, reason="internal_error", detail=evidence)
