"""The machine without processes: `World` holds a machine, its `RecordingEffects`, the configs
it may run (`a`, `b`, `c`) and a fake clock, and plays the messages a host would post (a start,
the GPU wait's end, the exec, a 200, an exit and its sweep). `FAST` turns probation off."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.listener import ListenerCheck
from gpuwarden.daemon.machine import Machine
from gpuwarden.daemon.messages import (
    Adopted,
    BootBegan,
    GpuWaitEnded,
    ListenerChecked,
    Message,
    ProbationOver,
    ProbeSucceeded,
    RestartRequested,
    ServerExited,
    Spawned,
    StartRequested,
    StopRequested,
    SweepFinished,
)
from gpuwarden.daemon.model import Adoptee, Launch, Swap
from gpuwarden.daemon.preflight import PreflightResult
from gpuwarden.daemon.resolvedconfig import ResolvedConfig
from gpuwarden.daemon.states import ServerState, SwapPhase

from .configs import make_settings, write_configs
from .effects import RecordingEffects
from .supervisor import FakeClock

FAST = {"restart": {"probation_s": 0}}


@dataclass
class FakeChild:
    """What the machine reads of a process (it never signals one itself: the host does)."""

    pid: int
    pgid: int = 0
    create_time: float = 0.0
    survives_daemon: bool = False


@dataclass
class FakeLog:
    path: Path


class World:
    """A machine, its recording effects, the configs it may run and a pid for each spawn."""

    def __init__(self, root: Path, **settings: Any) -> None:
        ports = (("a", 18001), ("b", 18002), ("c", 18003))
        write_configs(root, {name: _config(port) for name, port in ports})
        self.configs = ConfigStore(root / "configs")
        self.host = RecordingEffects()
        self.clock = FakeClock()
        self.root = root
        self.m = Machine(make_settings(root, **settings), self.host, self.clock, random.Random(1))
        # Each swap phase change the machine makes, kept.
        self.phases: list[tuple[SwapPhase, SwapPhase]] = []
        set_phase = self.m.swaps.set_phase

        def recording(swap: Swap, new: SwapPhase) -> None:
            old = swap.phase
            set_phase(swap, new)
            if old != new:
                self.phases.append((old, new))

        self.m.swaps.set_phase = recording  # type: ignore[method-assign]
        self.pids = 1000
        self.ticket = 0

    def cfg(self, name: str) -> ResolvedConfig:
        return self.configs.load(name)

    def send(self, msg: Message) -> Any:
        return self.m.handle(msg)

    def edges(self) -> set[tuple[ServerState, ServerState]]:
        return {(ServerState(r["from"]), ServerState(r["to"])) for r in self.host.events("state")}

    @property
    def launch(self) -> Launch:
        assert self.m.launch is not None
        return self.m.launch

    @property
    def swap(self) -> Swap:
        """The last swap or restart begun."""
        assert self.m.swaps.current is not None
        return self.m.swaps.current

    def next_ticket(self) -> int:
        self.ticket += 1
        return self.ticket

    # -- what the host would post ------------------------------------------------------------

    def start(self, name: str = "a", ok: bool = True) -> Any:
        pre = PreflightResult(ok=ok, problems=[] if ok else ["port 18001 is taken"])
        msg = StartRequested(
            name, preflight=pre, resolved=self.cfg(name), ticket=self.next_ticket()
        )
        return self.send(msg)

    def restart(self, name: str, **kw: Any) -> Any:
        msg = RestartRequested(name, resolved=self.cfg(name), ticket=self.next_ticket(), **kw)
        return self.send(msg)

    def stop(self) -> Any:
        return self.send(StopRequested(ticket=self.next_ticket()))

    def gpus_free(self) -> None:
        self.send(GpuWaitEnded(self.launch.gen, True))

    def spawned(self) -> None:
        self.pids += 1
        self.send(Spawned(self.launch.gen, FakeChild(self.pids), FakeLog(self.root / "x.log")))

    def adopt(
        self,
        name: str = "a",
        *,
        ready: bool = True,
        exited: int | None = None,
        record: dict[str, Any] | None = None,
        stopping: bool = False,
        recorded: dict[str, Any] | None = None,
    ) -> Adoptee:
        """The boot finds the previous life's launch L3 of `name` under the shim, verified
        (ready or still starting; `exited`: it ended with that code while the daemon was away),
        and its log is taken up."""
        self.pids += 1
        current = {
            "launch_id": "L3",
            "token": "tok",
            "config": name,
            "pid": self.pids,
            "config_hash": self.cfg(name).config_hash,
            "started_at": self.clock.time() - 100,
            "ready_at": self.clock.time() - 40 if ready else None,
            "stopping": stopping,
            **(recorded or {}),
        }
        saved = {
            "intent": {"config": name, "running": True},
            "last_good_config": name,
            "launch_seq": 3,
            "launches": [{"launch_id": "L3", "config": name, "exit": None}],
            **(record or {}),
            "current_launch": current,
        }
        away = None if exited is None else self.clock.time() - 5
        child = FakeChild(self.pids, self.pids, 1.5, survives_daemon=True)
        adoptee = Adoptee(current, child, self.cfg(name), away)
        self.send(BootBegan(saved, None, None, adoptee=adoptee))
        if self.m.launch is not None and self.m.launch.child is child:
            self.send(Adopted(self.launch.gen, FakeLog(self.root / "L3.log")))
        return adoptee

    def ready(self) -> None:
        self.send(ProbeSucceeded(self.launch.gen, "200 /health"))
        self.send(ListenerChecked(self.launch.gen, "200 /health", ListenerCheck(True, "ours")))

    def up(self, name: str = "a") -> None:
        self.start(name)
        self.gpus_free()
        self.spawned()
        self.ready()

    def exits(self, code: int = 1) -> None:
        gen = self.launch.gen
        self.send(ServerExited(gen, code))
        self.send(SweepFinished(gen, []))

    def relaunch(self) -> None:
        """The next attempt of a restart or swap, to a running server."""
        self.gpus_free()
        self.spawned()

    def probation_over(self) -> None:
        """The probation timer the machine set for the current launch fires."""
        timers = [m for _, m, launch in self.host.called("timer") if launch is self.m.launch]
        assert any(isinstance(m, ProbationOver) for m in timers), "no probation timer was set"
        self.send(ProbationOver(self.launch.gen))


def _config(port: int) -> dict[str, Any]:
    return {
        "command": ["/bin/true"],
        "args": {"model-path": "m", "port": port},
        "health": {"startup_timeout_s": 30, "interval_s": 1, "timeout_s": 1, "failures": 2},
    }
