"""One launch attempt, step by step, as a part of the machine's: what the host is asked at each
step (the GPU wait, the exec, the startup timer and probes, SIGTERM, the grace and SIGKILL, the
sweep) and the launch record's own fields, written as the steps happen, up to the record of
its end. What a step leads to is the machine's to decide, and what an end means the policy's
(`policy.classify_end`); the two rules kept here are stated where they apply (`stop`, `dead`).

The machine owns the state, and takes each step here as part of its handling of a message,
beside its transition. The `Launch` fields written here (and
only here) are its steps' (`launch_id`, `redactor`, `spawning`, `child`, `log`, the times) and
its end's (`next`, `next_config`, `imposed`, `exited`, `returncode`, `exited_at`). A launch
adopted from a previous life (`adopt`) gets them from that life's record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .messages import GraceExpired, StableUptimeReached, StartupTimedOut
from .model import Adoptee, Launch, Next
from .policy import Classification, classify_end
from .redact import Redactor

if TYPE_CHECKING:
    from .clock import Clock
    from .effects import Effects, ServerHandle, ServerLog
    from .ledger import Ledger
    from .resolvedconfig import ResolvedConfig
    from .settings import Settings


def _time(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


class Attempts:
    def __init__(
        self,
        settings: Settings,
        host: Effects,
        clock: Clock,
        ledger: Ledger,
        event: Callable[..., None],
    ) -> None:
        self.settings, self.host, self.clock, self.ledger, self.event = (
            settings,
            host,
            clock,
            ledger,
            event,
        )

    # -- the way up -------------------------------------------------------------------------------

    def wait_for_gpus(self, launch: Launch) -> None:
        self.ledger.reset_figures()  # each launch's own figures
        self.host.wait_for_gpus(launch, self.ledger.known_ours, self.ledger.gpu_pids_unresolved)

    def execute(self, launch: Launch, launch_id: str) -> None:
        """The GPUs are free: the log is created and the server executed."""
        launch.launch_id = launch_id
        launch.redactor = Redactor(launch.config.secret_values())
        launch.spawning = True
        self.host.spawn(launch)

    @staticmethod
    def spawn_failed(launch: Launch) -> None:
        launch.spawning = False

    def spawned(self, launch: Launch, server: ServerHandle, log: ServerLog) -> None:
        """It runs: on record from now on (its exit fills the record in)."""
        launch.spawning, launch.child, launch.log = False, server, log
        self.ledger.note_write_health("launch_log", None)  # a new file: any gap is over
        launch.started_at, launch.started_mono = self.clock.time(), self.clock.monotonic()
        self.ledger.launch_started(launch, server.pid, str(log.path))

    def adopt(self, launch: Launch, adoptee: Adoptee) -> None:
        """A previous life's server, taken over as it runs (or as it ended while the daemon
        was away): its steps as that life recorded them. Its log comes with `adopted`."""
        r, now, mono = adoptee.record, self.clock.time(), self.clock.monotonic()
        launch.launch_id, launch.token = str(r["launch_id"]), str(r["token"])
        launch.redactor = Redactor(launch.config.secret_values())
        launch.child, launch.exited_at = adoptee.server, adoptee.exited_at
        launch.recorded = dict(r)
        launch.started_at, launch.ready_at = _time(r.get("started_at")), _time(r.get("ready_at"))
        # Its monotonic times, as far back from now as its wall times are.
        launch.started_mono = mono - max(0.0, now - (launch.started_at or now))
        if launch.ready_at is not None:
            launch.ready_mono = mono - max(0.0, now - launch.ready_at)
        self.ledger.reset_figures()
        self.event(
            "adopted",
            pid=adoptee.server.pid,
            config_changed=adoptee.config_changed or None,
            exited_away=adoptee.exited_at is not None or None,
            detail="the server of the daemon's previous life, verified, is supervised as it runs"
            + (
                " (its config changed since it was launched: restart to apply)"
                if adoptee.config_changed
                else ""
            ),
        )

    def adopted(self, launch: Launch, log: ServerLog) -> None:
        """Its log is taken up: the shim writes it, its lines come from now on."""
        launch.log = log

    def watch_adopted(self, launch: Launch) -> None:
        """Starting when its previous life ended: the startup timer (what is left of it) and the
        readiness probe."""
        timeout = launch.config.config.health.startup_timeout_s
        took = self.clock.monotonic() - (launch.started_mono or self.clock.monotonic())
        self.host.timer(max(timeout - took, 1.0), StartupTimedOut(launch.gen), launch)
        self.host.probe(launch, readiness=True)

    def launched(self, launch: Launch) -> None:
        assert launch.child is not None and launch.log is not None
        argv = launch.config.redacted_argv()
        self.event("launch", pid=launch.child.pid, argv=argv, log_file=str(launch.log.path))

    def watch_start(self, launch: Launch, protect: set[str]) -> None:
        """Starting: the startup timer, the readiness probe; older logs pruned (but those of
        the launches in `protect`)."""
        self.launched(launch)
        timeout = launch.config.config.health.startup_timeout_s
        self.host.timer(timeout, StartupTimedOut(launch.gen), launch)
        self.host.probe(launch, readiness=True)
        # Oldest first by the order of the launches on record, never by the time in their ids.
        self.host.prune_logs(protect, [e["launch_id"] for e in self.ledger.history.entries()])

    def ready(self, launch: Launch) -> float:
        """It is ready: the start's tasks end; how long it took from its exec."""
        launch.ready_at, launch.ready_mono = self.clock.time(), self.clock.monotonic()
        self.host.end_tasks(launch)
        took = launch.ready_mono - (launch.started_mono or launch.ready_mono)
        self.ledger.note_ready(launch, took)
        return took

    def watch_ready(self, launch: Launch) -> None:
        """Ready: the liveness probe, the stable-uptime timer, a GPU sample (its ranks)."""
        self.host.probe(launch, readiness=False)
        reset_after = self.settings.restart.reset_after_s
        self.host.timer(reset_after, StableUptimeReached(launch.gen), launch)
        self.host.refresh_gpus()

    # -- the way down -----------------------------------------------------------------------------

    def stop(
        self,
        launch: Launch,
        nxt: Next,
        next_config: ResolvedConfig | None,
        imposed: Classification | None,
        under_way: bool,
    ) -> None:
        """`launch` is to end, and `nxt` to follow. Already on its way out (`under_way`): only
        what follows changes (a stop wins over a relaunch, a restart asked after a stop
        relaunches)."""
        launch.next, launch.next_config = nxt, next_config
        if under_way:
            return
        launch.imposed = imposed
        if launch.running:  # else it goes once it exists, or its exit is being handled
            self.terminate(launch)

    def terminate(self, launch: Launch) -> None:
        """SIGTERM to the server's group; SIGKILL after `grace_s`."""
        self.host.end_tasks(launch)
        self.host.terminate(launch)
        self.host.timer(self.settings.stop.grace_s, GraceExpired(launch.gen), launch)

    def grace_expired(self, launch: Launch) -> None:
        if not launch.running:
            return
        grace = self.settings.stop.grace_s
        self.event(
            "stop_escalated", detail=f"still running after grace_s={grace:g}; SIGKILL to the group"
        )
        self.host.kill_group(launch)

    def dead(self, launch: Launch, line: str) -> None:
        """SGLang says a process of the server died. It is dead: what follows is diagnostics
        (5 s of settling, py-spy, up to 60 s waiting for CUDA coredumps) with its port open and
        requests hanging. No grace and no probe can change that, so the group is SIGKILLed now
        and the exit's evidence is SGLang's line."""
        self.event("death_announced", line=line)
        if launch.next is None:
            # Not being stopped yet: a crash, retried by the policy. Already being stopped (on
            # request, or by us for a timeout, a probe, a foreign listener), that reason stands:
            # our SIGTERM may be what the line reports.
            launch.next = Next.RETRY
        self.host.end_tasks(launch)
        self.host.kill_group(launch)

    def exited(self, launch: Launch, returncode: int | None, unknown: str | None = None) -> bool:
        """The server exited (False: its exit was handled already), or what ran it was lost
        (`unknown`: the sweep then ends whatever of it runs on, and that is its end's reason
        unless it was being stopped already). The sweep comes once the machine has said so."""
        if launch.exited:
            return False
        launch.exited, launch.returncode = True, returncode
        if unknown is not None and launch.next is None and launch.imposed is None:
            launch.imposed = Classification("internal_error", unknown)
        self.host.end_tasks(launch)
        return True

    def sweep(self, launch: Launch) -> None:
        self.host.sweep(launch, self.ledger.known_ours, self.ledger.gpu_pids_unresolved)

    def swept(self, launch: Launch, killed: list[dict[str, object]]) -> Classification:
        """Swept: what its end means (`policy.classify_end`) on record, its log closed."""
        if killed:
            self.ledger.note_killed(killed, "sweep")
        verdict = classify_end(launch)
        self.ledger.record_exit(launch, verdict)
        last = self.ledger.last_exit
        self.host.close_launch(launch, f"exit: {last and last['evidence']}")
        return verdict
