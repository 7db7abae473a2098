"""The machine: every decision about the server's lifecycle, top to bottom.

`handle(msg)` decides on one message synchronously, dispatched by one explicit `match`: no
awaits, processes, files or clocks of its own. `Machine` holds the lifecycle's fields and is
their one writer (the state only through `transition`, checked against `states.py`'s table).
It composes parts that own their fields: `Swaps` (`swaps.py`, a swap's phase, outcome and
rollback), `Booting` (`booting.py`, the daemon's start under way) and a `Ledger` (`ledger.py`,
the records that decide nothing). What it decides leaves
through the host (`host.py`), whose tasks post outcomes back; sites say `# FROM -> TO`.

A crash, read top to bottom: `ServerExited` (`# READY -> STOPPING`, host.sweep) → `SweepFinished`
(classify, record, the restart policy: `# STOPPING -> BACKOFF`, host.retry_after) →
`BackoffElapsed` (`# BACKOFF -> WAITING_GPU`, host.wait_for_gpus) → `GpuWaitEnded`
(host.spawn) → `Spawned` (`# WAITING_GPU -> STARTING`, probes and the startup timer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, assert_never

from . import errors, saved
from .booting import Booting
from .effects import Effects
from .errors import CommandError
from .evidence import Evidence, NotLive, Ready, Verdict
from .ledger import Ledger
from .messages import (
    BackoffElapsed,
    BootBegan,
    EventNoted,
    GpuSampled,
    GpuWaitEnded,
    GraceExpired,
    LineParsed,
    ListenerChecked,
    Message,
    OrphansKilled,
    PreviousServerStopped,
    ProbationOver,
    ProbeFailed,
    ProbeSucceeded,
    RestartRequested,
    SaveDelayElapsed,
    ServerExited,
    ServerFiguresRead,
    ShutdownRequested,
    Spawned,
    SpawnFailed,
    StableUptimeReached,
    StartRequested,
    StartupTimedOut,
    StateSaved,
    StopRequested,
    SweepBegan,
    SweepEnded,
    SweepFinished,
    TaskFailed,
    WriteHealthChanged,
)
from .model import Launch, Next, utc_iso, utc_stamp
from .policy import NOT_RETRIED, Classification, backoff_delay, classify_exit
from .redact import Redactor
from .sglanglines import decode_metrics, strip_prefix
from .states import RUNNING_STATES, ServerState, SwapPhase, check_transition
from .swaps import Swaps

if TYPE_CHECKING:
    import random

    from .clock import Clock
    from .resolvedconfig import ResolvedConfig
    from .settings import Settings


class Machine:
    def __init__(self, settings: Settings, host: Effects, clock: Clock, rng: random.Random) -> None:
        self.settings, self.host, self.clock, self.rng = settings, host, clock, rng
        self.state = ServerState.STOPPED
        self.state_since = clock.time()
        self.finished = False  # the daemon's shutdown is complete: the owner ends
        self.dirty = False  # the saved state is stale: saved once after this message
        self.gen = 0
        self.launch: Launch | None = None
        self.intent_config: str | None = None
        self.intent_running = False
        self.last_good_config: str | None = None
        self.last_good_launch: str | None = None
        self.last_failed_launch: str | None = None
        self.failures = 0
        self.restarts = 0  # relaunches of the same config: retries and requested restarts
        self.crash_loop = False
        self.next_retry_at: float | None = None
        self.launch_seq = 0
        self.stop_ticket = 0
        self.active_sweep: str | None = None
        # What the active sweep ends on: no other config it starts becomes last-good, and a
        # daemon that dies mid-sweep starts this one at its next boot.
        self.sweep_restore_to: str | None = None
        self.saving_again = False
        self.ledger = Ledger(clock, self.event)  # the records, which decide nothing
        self.swaps = Swaps(self.event, host.swap_settled)  # a swap or restart under way
        self.booting = Booting(host, self.event)  # the daemon's start, while under way
        self.evidence = Evidence(host, self.event)  # the running launch's, judged

    def handle(self, msg: Message) -> Any:
        """Decide on one message. A command's answer is returned (a refusal raises
        `CommandError`); a shutdown's is given once `finished` holds."""
        match msg:
            # The restart path first: an exit, its sweep, the retry, the GPU wait, the exec.
            case ServerExited():
                self.on_server_exited(msg)
            case SweepFinished():
                self.on_sweep_finished(msg)
            case BackoffElapsed():
                self.on_backoff_elapsed(msg)
            case GpuWaitEnded():
                self.on_gpu_wait_ended(msg)
            case Spawned():
                self.on_spawned(msg)
            case SpawnFailed():
                self.on_spawn_failed(msg)
            case LineParsed():
                self.on_line_parsed(msg)
            case ProbeSucceeded():
                self.on_probe_succeeded(msg)
            case ListenerChecked():
                self.on_listener_checked(msg)
            case ProbeFailed():
                self.on_probe_failed(msg)
            case GpuSampled():
                self.on_gpu_sampled(msg)
            case StartupTimedOut():
                self.on_startup_timed_out(msg)
            case GraceExpired():
                self.on_grace_expired(msg)
            case StableUptimeReached():
                self.on_stable_uptime_reached(msg)
            case ProbationOver():
                self.on_probation_over(msg)
            case TaskFailed():
                self.on_task_failed(msg)
            # The commands.
            case StartRequested():
                return self.start(msg)
            case StopRequested():
                return self.stop(msg)
            case RestartRequested():
                return self.restart(msg)
            case ShutdownRequested():
                return self.shutdown(msg)
            case SweepBegan():
                return self.sweep_began(msg)
            case SweepEnded():
                return self.sweep_ended(msg)
            # The boot.
            case BootBegan():
                self.on_boot_began(msg)
            case PreviousServerStopped():
                self.on_previous_server_stopped(msg)
            # Records that decide nothing (kept by the ledger).
            case EventNoted():
                self.on_event_noted(msg)
            case OrphansKilled():
                self.on_orphans_killed(msg)
            case StateSaved():
                self.on_state_saved(msg)
            case SaveDelayElapsed():
                self.on_save_delay_elapsed(msg)
            case WriteHealthChanged():
                self.on_write_health_changed(msg)
            case ServerFiguresRead():
                self.on_server_figures_read(msg)
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

    def start(self, msg: StartRequested) -> dict[str, Any]:
        if msg.boot:
            self.booting.start_arrived(msg.config)
        else:
            self.booting.refuse_while_stopping("start")
        self._cancelled_by_stop(msg.ticket, "start")
        if not msg.boot:  # a boot resumes an interrupted swap as that swap
            self.swaps.refuse_if_under_way(self.active_sweep)
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
        swap = self.swaps.current
        if msg.boot and swap is not None and swap.rollback_to is None:
            # A resumed swap: what it rolls back to was read with the config it starts.
            rollback: ResolvedConfig | None = msg.last_good
            if rollback is not None and rollback.name == (
                swap.rollback_name or self.last_good_config
            ):
                swap.rollback_to = rollback
        self.host.cancel_retry()
        self.failures, self.crash_loop = 0, False
        self.set_intent(cfg.name, True)
        self.begin_attempt(cfg, rollback=swap is not None and swap.phase == SwapPhase.ROLLING_BACK)
        return {"accepted": True, "config": cfg.name, "state": str(self.state)}

    def stop(self, msg: StopRequested) -> dict[str, Any]:
        # Stop wins: whatever was asked before it and is still on its way (a preflight that
        # finishes later) is refused when it arrives.
        self.stop_ticket = max(self.stop_ticket, msg.ticket)
        self.set_intent(self.intent_config, False)
        # A boot under way starts nothing (the previous life's server still goes).
        self.booting.stop()
        if self.swaps.active() is not None:
            self.swaps.settle(
                "failed", "requested_stop", "stopped on request during the swap", self.intent_config
            )
        launch = self.launch
        if self.state in (ServerState.FAILED, ServerState.BACKOFF) or (
            self.state == ServerState.WAITING_GPU and (launch is None or not launch.spawning)
        ):
            self.host.cancel_retry()
            self.host.cancel_gpu_wait()
            # FAILED|BACKOFF|WAITING_GPU -> STOPPED
            self.transition(ServerState.STOPPED, reason="requested_stop")
        elif self.state != ServerState.STOPPED and launch is not None:
            self.begin_stop(launch, Next.STOP)
        # The grace a waiting client bounds its wait by (SIGTERM, then SIGKILL after it).
        return {"accepted": True, "state": str(self.state), "grace_s": self.settings.stop.grace_s}

    def restart(self, msg: RestartRequested) -> dict[str, Any]:
        self.booting.refuse_while_stopping("restart")
        self._cancelled_by_stop(msg.ticket, "restart")
        self.swaps.refuse_if_under_way(self.active_sweep, msg.sweep_id)
        cfg = msg.resolved
        if cfg is None:
            raise CommandError(errors.INVALID_CONFIG, f"config {msg.config!r} was not read")
        self.booting.replaced()
        current = self.current_config()
        serving = self.serving()
        if (
            msg.ensure
            and serving is not None
            and self.state == ServerState.READY
            and current == cfg.name
        ):
            return {"accepted": True, "config": cfg.name, "state": str(self.state), "swap_id": None}
        if serving is not None and serving.on_probation:
            # A swap away from a config on probation: its probation counts as passed, and it is
            # what this swap rolls back to (it was serving, not the older last-good); a config a
            # sweep measures never becomes last-good.
            serving.on_probation = False
            if self.may_be_last_good(serving):
                self._good(serving)
                self.event("probation_passed", detail="a swap began while it served")
        swap = self.swaps.begin(
            cfg,
            current=current,
            serving=serving,
            last_good_config=self.last_good_config,
            last_good=msg.last_good,
            seq=self.launch_seq,
            now=self.clock.time(),
        )
        self.failures, self.crash_loop = 0, False
        self.set_intent(cfg.name, True)
        launch = self.launch
        if (
            self.state in (*RUNNING_STATES, ServerState.WAITING_GPU)
            and launch is not None
            and (self.state != ServerState.WAITING_GPU or launch.spawning)
        ):
            self.begin_stop(launch, Next.RELAUNCH, next_config=cfg)
        else:
            self.host.cancel_retry()
            self.host.cancel_gpu_wait()
            self.begin_attempt(cfg)
        return {"accepted": True, "config": cfg.name, "state": str(self.state), "swap_id": swap.id}

    def shutdown(self, msg: ShutdownRequested) -> None:
        if self.booting.shutdown_waits():  # the daemon ends once the previous server is stopped
            return
        launch = self.launch
        if launch is not None and (self.state in RUNNING_STATES or launch.spawning):
            self.begin_stop(launch, Next.SHUTDOWN)
            return
        self.host.cancel_retry()
        self.host.cancel_gpu_wait()
        self.finished = True
        self.persist()

    def sweep_began(self, msg: SweepBegan) -> None:
        self.active_sweep, self.sweep_restore_to = msg.sweep_id, msg.restore_to
        self.persist()  # on record: a later life ends it (sweep_interrupted)

    def sweep_ended(self, msg: SweepEnded) -> None:
        if self.active_sweep == msg.sweep_id:
            self.active_sweep, self.sweep_restore_to = None, None
            self.persist()

    def refuse(self, name: str | None, detail: str) -> None:
        """A start whose preflight failed (or whose config no longer reads): `failed`."""
        self.intent_config, self.intent_running = name, True
        self.ledger.note_exit("preflight_refused", detail)
        self.event("preflight_refused", config=name, detail=detail)
        if self.state != ServerState.FAILED:
            # STOPPED|BACKOFF -> FAILED
            self.transition(ServerState.FAILED, reason="preflight_refused")
        self.persist()

    # -- the one writer of the state and of a swap's phase, and what it reads ------------------

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

    def may_be_last_good(self, launch: Launch) -> bool:
        """A launch a sweep measures is not last-good (the sweep ends on another config); the
        config the sweep ends on may be."""
        return self.active_sweep is None or launch.config.name == self.sweep_restore_to

    def _good(self, launch: Launch) -> None:
        """`launch` is what a failed swap rolls back to from now on, and what a later life
        keeps the logs of."""
        self.last_good_config, self.last_good_launch = launch.config.name, launch.launch_id

    def set_intent(self, config: str | None, running: bool) -> None:
        self.intent_config, self.intent_running = config, running
        self.persist()

    def current_config(self) -> str | None:
        launch = self.launch
        if launch is not None and self.state in (ServerState.WAITING_GPU, *RUNNING_STATES):
            return launch.config.name
        return self.intent_config

    def serving(self) -> Launch | None:
        """The launch serving requests now (ready, or ready and failing probes)."""
        launch = self.launch
        if launch is None or launch.exited or launch.ready_at is None:
            return None
        return launch if self.state in (ServerState.READY, ServerState.UNHEALTHY) else None

    def count_relaunch(self) -> None:
        """A relaunch of the same config is a restart; a swap was counted when it was asked."""
        swap = self.swaps.current
        if swap is None or not swap.is_swap:
            self.restarts += 1

    def protected_logs(self) -> set[str]:
        current = self.launch.launch_id if self.launch else None
        return {x for x in (current, self.last_good_launch, self.last_failed_launch) if x}

    # -- records, kept by the ledger -------------------------------------------------------------

    def on_server_figures_read(self, msg: ServerFiguresRead) -> None:
        """Figures read from the server's own /metrics; dropped when their launch is gone."""
        launch = self.current(msg.gen)
        if launch is not None and launch.running:
            self.ledger.note_figures(launch, dict(msg.figures), "sglang_metrics")

    def on_orphans_killed(self, msg: OrphansKilled) -> None:
        self.ledger.note_killed(msg.killed, "gpu_orphans_killed")

    def on_event_noted(self, msg: EventNoted) -> None:
        self.event(msg.kind, **msg.fields)

    def on_state_saved(self, msg: StateSaved) -> None:
        self.ledger.note_write_health("state", msg.error)
        if msg.error is not None and not self.saving_again:
            self.saving_again = True  # keep trying: the state on disk is stale until it works
            self.host.save_again()

    def on_save_delay_elapsed(self, msg: SaveDelayElapsed) -> None:
        self.saving_again = False
        self.persist()

    def on_write_health_changed(self, msg: WriteHealthChanged) -> None:
        self.ledger.note_write_health(msg.target, msg.error)

    # -- the boot: what the previous life left ----------------------------------------------------

    def on_boot_began(self, msg: BootBegan) -> None:
        """The previous life's record is restored at once (`/status` shows it, `booting`); a
        server that life left running is stopped (the host's `stop_previous`), then the saved
        intent starts, read and preflighted like any start (the host's `boot_start`), each
        step decided by the boot's own sub-machine (`booting.py`)."""
        data = msg.record
        self.ledger.secret_salt = msg.secret_salt
        if msg.note:
            self.event("state_file_corrupt", detail=msg.note)
        try:
            restored = saved.read(data, lambda pid, ct: (pid, ct) in msg.alive_known)
        except (TypeError, ValueError, AttributeError) as exc:  # a JSON object of other shape
            self.event(
                "state_file_corrupt",
                detail=f"state.json does not read as a record ({type(exc).__name__}: {exc}); "
                "starting as on a first start",
            )
            data, restored = {}, saved.Restored()
        self.intent_config, self.intent_running = restored.intent_config, restored.intent_running
        self.last_good_config, self.last_good_launch = (
            restored.last_good_config,
            restored.last_good_launch,
        )
        self.last_failed_launch, self.launch_seq = restored.last_failed_launch, restored.launch_seq
        self.failures = restored.failures
        self.ledger.restore(restored.history, restored.last_exit, restored.known_ours)
        swept = saved.interrupted_sweep(data)
        if swept is not None:
            # The sweep ended with that life: its config does not go on serving; the config the
            # sweep was to end on does (none: none was serving before it).
            sweep_id, back = swept
            self.set_intent(back or self.intent_config, back is not None)
            data = {**data, "intent": {"config": self.intent_config, "running": back is not None}}
            self.event(
                "sweep_interrupted",
                sweep_id=sweep_id,
                restore_to=back,
                detail=f"the daemon stopped during sweep {sweep_id}; "
                + (f"{back} serves again" if back else "nothing was serving before it"),
            )
        name = saved.boot_config(data, self.settings.default_config)
        rollback = None
        record = data.get("swap")
        swap = saved.resumed_swap(record, name) if name else None
        if swap is not None:
            self.swaps.resume(swap, record.get("phase") if isinstance(record, dict) else None)
            rollback = swap.rollback_name or self.last_good_config
        self.persist()  # the previous life's record, brought up to date, is saved now
        # The previous server's record, kept in state.json until it is stopped.
        previous = msg.record.get("current_launch") if msg.previous is not None else None
        if self.booting.begin(name, rollback, msg.previous, previous):
            self._boot_go_on("")  # nothing of that life runs

    def on_previous_server_stopped(self, msg: PreviousServerStopped) -> None:
        self.booting.previous_stopped(msg)
        self._boot_go_on(msg.previous.launch_id if msg.previous.alive else "")

    def _boot_go_on(self, stopped_id: str) -> None:
        """Nothing of the previous life runs any more: its launches get their exit records,
        and the boot goes on to its start (or the daemon ends: a shutdown asked meanwhile)."""
        if not self.booting.active:
            return
        self.ledger.close_unobserved(stopped_id)
        if self.booting.go_on():
            self.finished = True
        self.persist()

    def begin_attempt(self, cfg: ResolvedConfig, rollback: bool = False) -> None:
        self.gen += 1
        swap = self.swaps.active()
        self.launch = Launch(gen=self.gen, config=cfg, swap=swap, rollback=rollback)
        self.ledger.reset_figures()  # each launch's own figures
        if swap is not None:
            self.swaps.attempt_began(swap)
        if self.state != ServerState.WAITING_GPU:
            # STOPPED|STOPPING|BACKOFF|FAILED -> WAITING_GPU
            self.transition(ServerState.WAITING_GPU, config=cfg.name)
        self.host.wait_for_gpus(
            self.launch, self.ledger.known_ours, self.ledger.gpu_pids_unresolved
        )

    def on_gpu_wait_ended(self, msg: GpuWaitEnded) -> None:
        launch = self.current(msg.gen)
        if launch is None or self.state != ServerState.WAITING_GPU:
            return
        if not msg.ok:
            timeout = self.settings.gpu.release_timeout_s
            busy = f"GPUs still busy after {timeout:g} s: {msg.busy}"
            self._fail(launch, Classification("gpu_busy", busy))
            return
        self.launch_seq += 1
        launch.launch_id = f"{utc_stamp(self.clock.time())}-{self.launch_seq:06d}"
        launch.redactor = Redactor(launch.config.secret_values())
        launch.spawning = True
        self.host.spawn(launch)

    def on_spawn_failed(self, msg: SpawnFailed) -> None:
        launch = self.current(msg.gen)
        if launch is None:
            return
        launch.spawning = False
        if self.state == ServerState.STOPPING:  # a stop or swap came while it executed
            verdict = Classification(msg.reason, msg.detail)
            self.ledger.record_exit(launch, verdict)
            self._after_stop(launch, verdict, recorded=True)
        else:
            self._fail(launch, Classification(msg.reason, msg.detail))

    def on_spawned(self, msg: Spawned) -> None:
        launch = self.current(msg.gen)
        if launch is None:  # no attempt wants it (a spawn is never overtaken: defensive)
            self.host.abandon(msg.server, msg.log)
            return
        launch.spawning, launch.child, launch.log = False, msg.server, msg.log
        self.ledger.note_write_health("launch_log", None)  # a new file: any gap is over
        if launch.swap is not None:
            self.swaps.spawned(launch.swap, launch.launch_id)
        launch.started_at, launch.started_mono = self.clock.time(), self.clock.monotonic()
        path = str(msg.log.path)
        self.ledger.launch_started(launch, msg.server.pid, path)
        self.persist()
        if self.state == ServerState.STOPPING:  # stopped while it executed: it goes now
            self.event(
                "launch", pid=msg.server.pid, argv=launch.config.redacted_argv(), log_file=path
            )
            self._terminate(launch)
            return
        # WAITING_GPU -> STARTING
        self.transition(ServerState.STARTING, pid=msg.server.pid, log_file=path)
        self.event("launch", pid=msg.server.pid, argv=launch.config.redacted_argv(), log_file=path)
        health = launch.config.config.health
        self.host.timer(health.startup_timeout_s, StartupTimedOut(launch.gen), launch)
        self.host.probe(launch, readiness=True)
        # Oldest first by the order of the launches on record, never by the time in their ids.
        self.host.prune_logs(
            self.protected_logs(), [e["launch_id"] for e in self.ledger.history.entries()]
        )

    def on_line_parsed(self, msg: LineParsed) -> None:
        launch = self.current(msg.gen)
        if launch is None:
            return
        if msg.parsed.decode is not None:
            self.ledger.note_figures(launch, decode_metrics(msg.parsed.decode), "log")
        if msg.parsed.death:
            self._death_announced(launch, launch.redactor.text(strip_prefix(msg.line).strip()))
        elif msg.parsed.ready and self.state == ServerState.STARTING:
            self._judged(launch, self.evidence.ready_said(launch, "ready line"))

    def _death_announced(self, launch: Launch, line: str) -> None:
        """SGLang says a process of the server died. It is dead: what follows is diagnostics
        (5 s of settling, py-spy, up to 60 s waiting for CUDA coredumps) with its port open and
        requests hanging. No grace and no probe can change that, so the group is SIGKILLed now
        and the exit's evidence is SGLang's line."""
        if launch.announced is not None or not launch.running:
            return
        launch.announced = line
        self.event("death_announced", line=line)
        if launch.next is None:
            # Not being stopped yet: a crash, retried by the policy. Already being stopped (on
            # request, or by us for a timeout, a probe, a foreign listener), that reason stands:
            # our SIGTERM may be what the line reports.
            launch.next = Next.RETRY
        self.host.end_tasks(launch)
        if self.state != ServerState.STOPPING:
            # STARTING|READY|UNHEALTHY -> STOPPING
            self.transition(
                ServerState.STOPPING, next=str(launch.next), reason="death_announced", detail=line
            )
        self.host.kill_group(launch)

    def on_probe_succeeded(self, msg: ProbeSucceeded) -> None:
        launch = self.current(msg.gen)
        if launch is None:
            return
        if self.state == ServerState.STARTING:
            self._judged(launch, self.evidence.ready_said(launch, msg.detail))
        elif self.state in (ServerState.READY, ServerState.UNHEALTHY):
            self.evidence.probe_succeeded(launch)

    def on_listener_checked(self, msg: ListenerChecked) -> None:
        launch = self.current(msg.gen)
        if launch is not None and self.state == ServerState.STARTING:
            self._judged(launch, self.evidence.listener_checked(launch, msg))

    def _judged(self, launch: Launch, verdict: Verdict) -> None:
        """What the evidence says (`evidence.py`), acted on."""
        if isinstance(verdict, Ready):
            self._became_ready(launch, verdict.how)
        elif isinstance(verdict, NotLive):
            if verdict.unhealthy is not None:  # READY -> UNHEALTHY
                self.transition(ServerState.UNHEALTHY, detail=verdict.unhealthy)
            # STARTING|READY|UNHEALTHY -> STOPPING
            self._end_for_retry(launch, verdict.reason, verdict.evidence)

    def _became_ready(self, launch: Launch, how: str) -> None:
        launch.ready_at, launch.ready_mono = self.clock.time(), self.clock.monotonic()
        self.host.end_tasks(launch)
        took = launch.ready_mono - (launch.started_mono or launch.ready_mono)
        # STARTING -> READY
        self.transition(ServerState.READY, via=how, time_to_ready_s=round(took, 3))
        self.ledger.note_ready(launch.config.name, took)
        probation = self.settings.restart.probation_s
        if self.swaps.ready(launch, self.intent_config, probation):
            # A swapped-in config becomes last-good only once it has stayed up.
            launch.on_probation = True
            self.host.timer(probation, ProbationOver(launch.gen), launch)
        elif self.may_be_last_good(launch):
            self._good(launch)
        self.persist()
        self.host.probe(launch, readiness=False)
        self.host.timer(
            self.settings.restart.reset_after_s, StableUptimeReached(launch.gen), launch
        )
        self.host.refresh_gpus()

    def on_probe_failed(self, msg: ProbeFailed) -> None:
        launch = self.current(msg.gen)
        if launch is not None and self.state in (ServerState.READY, ServerState.UNHEALTHY):
            self._judged(launch, self.evidence.probe_failed(launch, msg.detail))

    def on_gpu_sampled(self, msg: GpuSampled) -> None:
        launch = self.current(msg.gen)
        if self.ledger.note_gpus(msg, launch):
            self.persist()  # a holder known as ours: a later life knows its orphans
        if launch is None or launch.exited or not msg.tree or self.state != ServerState.READY:
            return
        noted = launch.rank_gpus is not None
        self._judged(launch, self.evidence.gpus_sampled(launch, msg))
        if not noted:
            self.persist()  # the GPUs its ranks hold, on record

    def on_probation_over(self, msg: ProbationOver) -> None:
        launch = self.current(msg.gen)
        if launch is None or not launch.on_probation or self.state != ServerState.READY:
            return
        launch.on_probation = False
        if not self.may_be_last_good(launch):
            return  # a sweep measures it: it ends on another config
        self._good(launch)
        self.event("probation_passed", probation_s=self.settings.restart.probation_s)
        self.persist()

    def on_startup_timed_out(self, msg: StartupTimedOut) -> None:
        launch = self.current(msg.gen)
        if launch is not None and self.state == ServerState.STARTING:
            self._judged(launch, self.evidence.startup_timed_out(launch))

    def on_stable_uptime_reached(self, msg: StableUptimeReached) -> None:
        if self.current(msg.gen) is None or self.state != ServerState.READY:
            return
        if self.failures or self.crash_loop:
            self.event("failures_reset", after_failures=self.failures)
        self.failures, self.crash_loop = 0, False
        self.persist()

    def begin_stop(
        self,
        launch: Launch,
        nxt: Next,
        next_config: ResolvedConfig | None = None,
        imposed: Classification | None = None,
    ) -> None:
        if self.state == ServerState.STOPPING:
            # On its way out already: only what follows changes (a stop wins over a relaunch,
            # a restart asked for after a stop relaunches).
            launch.next, launch.next_config = nxt, next_config
            return
        launch.next, launch.next_config, launch.imposed = nxt, next_config, imposed
        # WAITING_GPU (executing)|STARTING|READY|UNHEALTHY -> STOPPING
        self.transition(
            ServerState.STOPPING, next=str(nxt), reason=imposed.reason if imposed else None
        )
        if launch.running:  # else it goes once it exists, or its exit is being handled
            self._terminate(launch)

    def _terminate(self, launch: Launch) -> None:
        """SIGTERM to the server's group; SIGKILL after `grace_s`."""
        self.host.end_tasks(launch)
        self.host.terminate(launch)
        self.host.timer(self.settings.stop.grace_s, GraceExpired(launch.gen), launch)

    def _end_for_retry(self, launch: Launch, reason: str, evidence: str) -> None:
        """We end this launch (it is not ready in time, not live, or lost a rank): stop it, and
        let the restart policy (or a swap's rollback) decide what follows."""
        self.begin_stop(launch, Next.RETRY, imposed=Classification(reason, evidence))

    def on_grace_expired(self, msg: GraceExpired) -> None:
        launch = self.current(msg.gen)
        if launch is None or not launch.running:
            return
        grace = self.settings.stop.grace_s
        self.event(
            "stop_escalated", detail=f"still running after grace_s={grace:g}; SIGKILL to the group"
        )
        self.host.kill_group(launch)

    def on_server_exited(self, msg: ServerExited) -> None:
        launch = self.current(msg.gen)
        if launch is None or launch.exited:
            return
        launch.exited, launch.returncode = True, msg.returncode
        self.host.end_tasks(launch)
        if self.state != ServerState.STOPPING:
            # STARTING|READY|UNHEALTHY -> STOPPING
            self.transition(
                ServerState.STOPPING, returncode=msg.returncode, detail="the server exited"
            )
        self.host.sweep(launch, self.ledger.known_ours, self.ledger.gpu_pids_unresolved)

    def on_sweep_finished(self, msg: SweepFinished) -> None:
        launch = self.current(msg.gen)
        if launch is None or launch.child is None or self.state != ServerState.STOPPING:
            return
        if msg.killed:
            self.ledger.note_killed(msg.killed, "sweep")
        requested = launch.next in (Next.STOP, Next.RELAUNCH, Next.SHUTDOWN)
        verdict = classify_exit(
            launch.returncode,
            launch.evidence(),
            requested_stop=requested and launch.imposed is None,
            imposed=launch.imposed,
        )
        self.ledger.record_exit(launch, verdict)
        last = self.ledger.last_exit
        self.host.close_launch(launch, f"exit: {last and last['evidence']}")
        self._after_stop(launch, verdict, recorded=True)

    def _after_stop(self, launch: Launch, verdict: Classification, recorded: bool = False) -> None:
        """The launch is gone (swept, or never executed): what it was stopped for follows."""
        nxt = launch.next
        if nxt is None or nxt == Next.RETRY:
            self._fail(launch, verdict, recorded=recorded)
        elif nxt == Next.STOP:
            self.transition(ServerState.STOPPED, reason=verdict.reason)  # STOPPING -> STOPPED
        elif nxt == Next.RELAUNCH:
            assert launch.next_config is not None
            self.count_relaunch()
            self.begin_attempt(launch.next_config)  # STOPPING -> WAITING_GPU
        elif nxt == Next.SHUTDOWN:
            self.transition(ServerState.STOPPED, reason="daemon shutdown")  # STOPPING -> STOPPED
            self.finished = True
        self.persist()

    def _fail(self, launch: Launch, verdict: Classification, recorded: bool = False) -> None:
        if not recorded:
            self.ledger.record_exit(launch, verdict)
        self.ledger.count_exit(verdict.reason)
        if self.swaps.rolls_back(launch):
            self._roll_back(launch, verdict)
            return
        self.swaps.failed(launch, verdict, self.intent_config)
        policy = self.settings.restart
        self.failures += 1
        if launch.launch_id:
            self.last_failed_launch = launch.launch_id
        if self.failures >= policy.crash_loop_after and not self.crash_loop:
            self.crash_loop = True
            self.event("crash_loop", failures=self.failures, reason=verdict.reason)
        if verdict.reason in NOT_RETRIED:
            # WAITING_GPU|STOPPING -> FAILED
            self.transition(
                ServerState.FAILED, reason=verdict.reason, detail="not retried: fix the config"
            )
        elif policy.max_failures is not None and self.failures >= policy.max_failures:
            detail = f"{self.failures} consecutive failures (max_failures)"
            self.transition(ServerState.FAILED, reason=verdict.reason, detail=detail)  # -> FAILED
        else:
            delay = backoff_delay(policy, self.failures, self.rng)
            # WAITING_GPU|STOPPING -> BACKOFF
            self.transition(
                ServerState.BACKOFF,
                reason=verdict.reason,
                delay_s=round(delay, 3),
                failures=self.failures,
            )
            self.next_retry_at = self.clock.time() + delay
            # Even with no delay the retry is a message of its own, after its config is read.
            self.host.retry_after(max(delay, 0.0), launch.gen, self.intent_config)
        self.persist()

    def _roll_back(self, launch: Launch, verdict: Classification) -> None:
        """A swapped-in config failed its first start or its probation: back at once, no
        backoff, to the config that served when the swap began (else the last good one)."""
        if launch.launch_id:
            self.last_failed_launch = launch.launch_id
        target = self.swaps.roll_back(launch, verdict, self.last_good_config, self.launch_seq)
        if isinstance(target, str):  # nothing to go back to
            self.transition(ServerState.FAILED, reason=verdict.reason, detail=target)  # -> FAILED
            self.swaps.settle("failed", verdict.reason, verdict.evidence, self.intent_config)
            self.persist()
            return
        self.set_intent(target.name, True)
        self.begin_attempt(target, rollback=True)  # STOPPING|WAITING_GPU -> WAITING_GPU

    def on_backoff_elapsed(self, msg: BackoffElapsed) -> None:
        if self.current(msg.gen) is None or self.state != ServerState.BACKOFF:
            return
        resolved = msg.resolved
        launch = self.launch
        if (
            resolved is None
            and msg.unreadable
            and launch is not None
            and launch.config.name == self.intent_config
        ):
            # A relaunch of the config that was running, whose file is missing or half-written
            # just now (an editor's save, a deploy): the server comes back as it ran, and the
            # next retry reads the file again. A command that names the config still gets
            # the error.
            resolved = launch.config
            self.event(
                "config_unreadable",
                error=msg.error,
                detail=f"relaunched with the resolution of launch {launch.launch_id} "
                f"(hash {resolved.config_hash}); the file is read again at the next retry",
            )
        if resolved is None:
            self.refuse(self.intent_config, msg.error or "the config does not load")
            return
        self.restarts += 1
        self.begin_attempt(resolved)  # BACKOFF -> WAITING_GPU

    def on_task_failed(self, msg: TaskFailed) -> None:
        """A helper task raised (descriptors exhausted, /proc unreadable, a bug): record it, then
        recover so the machine never waits for a message that will not come."""
        self.ledger.internal_errors += 1
        self.event("internal_error", task=msg.name, error=msg.error)
        launch = self.current(msg.gen)
        evidence = f"the {msg.name} task failed: {msg.error}"
        if msg.name == "after_exit":
            if launch is not None and launch.exited and self.state == ServerState.STOPPING:
                # Degrade: the exit is handled without the sweep (leftovers may remain; the
                # next launch's GPU wait still finds and kills holders of ours).
                self.on_sweep_finished(SweepFinished(msg.gen, []))
        elif msg.name == "spawn":  # no process came of it
            self.on_spawn_failed(SpawnFailed(msg.gen, "internal_error", evidence))
        elif msg.name == "retry":  # the retry's config read is lost: as a config that did not read
            self.on_backoff_elapsed(BackoffElapsed(msg.gen, None, evidence))
        elif msg.name == "wait_for_gpus":
            if launch is not None and self.state == ServerState.WAITING_GPU and not launch.spawning:
                self._fail(launch, Classification("internal_error", evidence))  # retried
        elif msg.name == "stop_previous":  # as stopped: the GPU wait kills what holds GPUs
            self._boot_go_on("")
        elif msg.name == "boot_start":
            if not self.booting.active:
                return  # a command asked during the boot replaced its start: nothing is lost
            self.booting.start_failed()
            if self.state == ServerState.STOPPED:
                self.ledger.note_exit("internal_error", evidence)
                # STOPPED -> FAILED
                self.transition(ServerState.FAILED, reason="internal_error", detail=evidence)
        elif (
            launch is not None
            and launch.running
            and self.state in (ServerState.STARTING, ServerState.READY, ServerState.UNHEALTHY)
        ):
            # A probe loop or timer of this launch is gone: nothing would notice a hang or a
            # timeout any more, so end it and let the restart policy start it afresh.
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
