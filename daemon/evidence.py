"""The running launch's evidence, judged: what its log lines (ready, or SGLang's word that a
process died), its probes, the check of who holds its health URL's socket, the startup timer
and the GPU samples say about whether it is ready and whether it is still alive. A part of the
machine's: `judge` keeps that evidence on the launch (the fields `Launch` marks as the
evidence's, written only here), asks for the listener check, and answers with a verdict; the
machine acts on it (a transition, a stop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .effects import Effects
from .messages import (
    GpuSampled,
    LineParsed,
    ListenerChecked,
    ProbeFailed,
    ProbeSucceeded,
    StartupTimedOut,
)
from .model import Launch
from .sglanglines import strip_prefix
from .states import SERVING_STATES, ServerState


@dataclass(frozen=True)
class Ready:
    """The launch is ready: `how` it said so (its ready line, a probe's 200)."""

    how: str


@dataclass(frozen=True)
class NotLive:
    """The launch is to be ended and the restart policy to decide: `reason`, `evidence`.
    `unhealthy`: it failed its liveness probes (ready, then unhealthy first)."""

    reason: str
    evidence: str
    unhealthy: str | None = None


@dataclass(frozen=True)
class Dead:
    """SGLang said that a process of the server died (`line`, redacted): the launch is dead."""

    line: str


Verdict = Ready | NotLive | Dead | None
# What the running launch signals: each judged by `Evidence.judge`.
Signal = LineParsed | ProbeSucceeded | ListenerChecked | ProbeFailed | StartupTimedOut | GpuSampled


class Evidence:
    def __init__(self, host: Effects, event: Callable[..., None]) -> None:
        self.host, self.event = host, event
        # Configs whose listener could not be checked: said once per config (the same reason
        # holds for every launch of it).
        self.unchecked: set[str] = set()

    def judge(self, msg: Signal, launch: Launch, state: ServerState) -> Verdict:
        """What `msg` says of `launch` (the current one) while the server is in `state`."""
        starting = state == ServerState.STARTING
        match msg:
            case LineParsed() if msg.parsed.death:
                return self.death_said(launch, msg.line)
            case LineParsed() if msg.parsed.ready and starting:
                return self.ready_said(launch, "ready line")
            case ProbeSucceeded() if starting:
                return self.ready_said(launch, msg.detail)
            case ProbeSucceeded() if state in SERVING_STATES:
                launch.probe_failures = 0  # the failures before it no longer count
            case ListenerChecked() if starting:
                return self.listener_checked(launch, msg)
            case ProbeFailed() if state in SERVING_STATES:
                return self.probe_failed(launch, msg.detail)
            case StartupTimedOut() if starting:
                timeout = launch.config.config.health.startup_timeout_s
                return NotLive("startup_timeout", f"not ready within startup_timeout_s={timeout:g}")
            case GpuSampled() if state == ServerState.READY and not launch.exited and msg.tree:
                return self.gpus_sampled(launch, msg)
        return None

    @staticmethod
    def death_said(launch: Launch, line: str) -> Verdict:
        """Said once, of a launch still running (our SIGKILL makes more such lines)."""
        if launch.announced is not None or not launch.running:
            return None
        launch.announced = launch.redactor.text(strip_prefix(line).strip())
        return Dead(launch.announced)

    def ready_said(self, launch: Launch, how: str) -> Verdict:
        """The ready line or a 200 says ready; neither proves that this launch answers (SGLang
        prints its ready line when its warm-up reached another server on its port, its own
        bind having failed). Who holds the health URL's socket is asked first."""
        if launch.checking_listener or launch.child is None:
            return None
        if not launch.config.config.health.check_listener:
            return Ready(how)
        launch.checking_listener = True
        self.host.check_listener(launch, how)
        return None

    def listener_checked(self, launch: Launch, msg: ListenerChecked) -> Verdict:
        launch.checking_listener = False
        check = msg.check
        if check.ours is False:
            return NotLive("port_in_use", check.detail)
        if check.nothing_listens and msg.how != "ready line" and not launch.listener_rechecked:
            # A 200, and then nobody listens: whoever answered may be gone. Not ready yet: probe
            # again. A second time it is taken as "cannot tell" (a port forwarded by the kernel,
            # as docker does without its proxy, has no listener here).
            launch.listener_rechecked = True
            self.host.probe(launch, readiness=True)
            return None
        if check.ours is None and launch.config.name not in self.unchecked:
            self.unchecked.add(launch.config.name)
            self.event(
                "listener_unchecked",
                config=launch.config.name,
                detail=f"cannot check that this launch answers {launch.config.shown_health_url}: "
                f"{check.detail}; readiness rests on the {msg.how}",
            )
        return Ready(msg.how)

    def probe_failed(self, launch: Launch, detail: str) -> Verdict:
        launch.probe_failures += 1
        limit = launch.config.config.health.failures
        self.event("probe_failed", detail=detail, consecutive=launch.probe_failures)
        if launch.probe_failures < limit:
            return None
        last = f"{limit} consecutive failed probes; last: {detail}"
        return NotLive("liveness_failed", last, unhealthy=detail)

    def gpus_sampled(self, launch: Launch, msg: GpuSampled) -> Verdict:
        """A GPU sample of the ready launch: the GPUs its ranks hold are noted at the first one;
        a GPU that no longer holds a process of the launch later is a lost rank."""
        tree_pids = {pid for pid, _ in msg.tree}
        held = {
            g.index: [p.pid for p in g.processes if p.pid in tree_pids] for g in msg.snapshot.gpus
        }
        if launch.rank_gpus is None:
            launch.rank_gpus = {i: pids for i, pids in held.items() if pids}
            if launch.rank_gpus:
                self.event("ranks", gpus=sorted(launch.rank_gpus))
            return None
        lost = [i for i in launch.rank_gpus if not held.get(i)]
        if not lost:
            return None
        pids = ", ".join(map(str, launch.rank_gpus[lost[0]]))
        why = f"GPU {lost[0]} no longer holds a process of this launch (it held pid {pids} "
        return NotLive("rank_lost", why + "when ready)")
