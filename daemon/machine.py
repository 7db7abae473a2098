"""The machine: every decision about the server's lifecycle, top to bottom.

`handle(msg)` decides on one message synchronously, dispatched by one explicit `match`: no
awaits, processes, files or clocks of its own. `Machine` holds the lifecycle's fields and is
their one writer (the state only through `transition`, checked against `states.py`'s table).
It composes parts that own their fields: `Swaps` (`swaps.py`, a swap's phase, outcome and
rollback), `Booting` (`booting.py`, the daemon's start under way), `Attempts` (`attempt.py`,
a launch's steps and its record), `Evidence` (`evidence.py`, what the running launch's
signals say), `Retries` (`policy.py`, the failures in a row and what follows one) and a
`Ledger` (`ledger.py`, the records that decide nothing). What it decides leaves through the
host (`host.py`), whose tasks post outcomes back; sites say `# FROM -> TO`. Some of its
decisions are written in modules of their own: the commands (`commands.py`), the daemon's
start (`restoring.py`) and recovery from failures (`recovery.py`).

A crash, read top to bottom: `ServerExited` (`# READY -> STOPPING`, host.sweep) → `SweepFinished`
(classify, record, the restart policy: `# STOPPING -> BACKOFF`, host.retry_after) →
`BackoffElapsed` (`# BACKOFF -> WAITING_GPU`, host.wait_for_gpus) → `GpuWaitEnded`
(host.spawn) → `Spawned` (`# WAITING_GPU -> STARTING`, probes and the startup timer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, assert_never

from . import commands, recovery, restoring
from . import messages as ms
from .attempt import Attempts
from .booting import Booting
from .effects import Effects
from .evidence import Dead, Evidence, NotLive, Ready, Signal
from .ledger import Ledger
from .model import Intent, Launch, Next, utc_iso, utc_stamp
from .policy import Classification, Retries
from .states import RUNNING_STATES, SERVING_STATES, ServerState, check_transition
from .swaps import Swaps

if TYPE_CHECKING:
    import random

    from .clock import Clock
    from .resolvedconfig import ResolvedConfig
    from .settings import Settings


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
                restoring.on_adopted(self, msg)
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
                    self.probation_passed(launch, probation_s=self.settings.restart.probation_s)
            case ms.TaskFailed():
                recovery.on_task_failed(self, msg)
            # The commands.
            case ms.StartRequested():
                return commands.start(self, msg)
            case ms.StopRequested():
                return commands.stop(self, msg)
            case ms.RestartRequested():
                return commands.restart(self, msg)
            case ms.PrewarmEnded():
                commands.prewarm_ended(self, msg)
            case ms.ShutdownRequested():
                return commands.shutdown(self, msg)
            case ms.SweepBegan() | ms.SweepEnded():
                commands.sweep_marked(self, msg)
            # The boot.
            case ms.BootBegan():
                restoring.on_boot_began(self, msg)
            case ms.PreviousServerStopped():
                self.booting.previous_stopped(msg)
                restoring.boot_go_on(self, msg.previous.launch_id if msg.previous.alive else "")
            # Records that decide nothing, and the state file's writes.
            case ms.ServerFiguresRead() | ms.OrphansKilled() | ms.WriteHealthChanged():
                self.dirty |= self.ledger.note(msg, self.launch)  # (True: on record, saved)
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

    def cancel_waits(self) -> None:
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

    def probation_passed(self, launch: Launch, **fields: Any) -> None:
        launch.on_probation = False
        if self.intent.good(launch):
            self.event("probation_passed", **fields)
            self.persist()

    # -- a launch's way up: the GPU wait, the exec, its signals, ready -------------------------

    def begin_attempt(self, cfg: ResolvedConfig, rollback: bool = False) -> None:
        self.gen += 1
        swap = self.swaps.active()
        self.launch = Launch(gen=self.gen, config=cfg, swap=swap, rollback=rollback)
        if swap is not None and self.swaps.attempt_began(swap):
            self.host.cancel_prewarm()  # the old server ended first: the new one reads them now
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
            self.fail(launch, Classification("gpu_busy", busy))
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
            self.fail(launch, verdict)

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
                self.end_for_retry(launch, reason, evidence)
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
        self.ready_settles(launch)

    def ready_settles(self, launch: Launch) -> None:
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

    def end_for_retry(self, launch: Launch, reason: str, evidence: str) -> None:
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
            self.fail(launch, verdict, recorded=recorded)
        elif nxt == Next.STOP:
            self.transition(ServerState.STOPPED, reason=verdict.reason)  # STOPPING -> STOPPED
            self.host.stop_weight_cache("stopped on request")
        elif nxt == Next.RELAUNCH:
            assert launch.next_config is not None
            if not (self.swaps.current and self.swaps.current.is_swap):  # (swaps count apart)
                self.retries.restarted()
            self.begin_attempt(launch.next_config)  # STOPPING -> WAITING_GPU
        elif nxt == Next.SHUTDOWN:
            self.transition(ServerState.STOPPED, reason="daemon shutdown")  # STOPPING -> STOPPED
            self.host.stop_weight_cache("the daemon stopped")
            self.finished = True
        self.persist()

    def fail(self, launch: Launch, verdict: Classification, recorded: bool = False) -> None:
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
            commands.refuse(self, self.intent.config, msg.error or "the config does not load")
            return
        self.retries.restarted()
        self.begin_attempt(resolved)  # BACKOFF -> WAITING_GPU
