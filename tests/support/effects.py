"""`RecordingEffects`: the machine's `Effects` for tests without processes. Every method of the
protocol is written out and records `(name, args)`, in order, so an effect the machine asks for
under a name the protocol does not have fails at once (and mypy checks the class against the
protocol: the `_` line below)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuwarden.daemon.effects import Effects

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from gpuwarden.daemon.effects import ServerHandle, ServerLog
    from gpuwarden.daemon.gpustate import KnownOurs
    from gpuwarden.daemon.messages import Message
    from gpuwarden.daemon.model import Launch, PreviousServer, PrewarmProgress


class RecordingEffects:
    """Takes the machine's effects and keeps them, in order: `calls` has each as `(name,
    args)`, and `records` the records (events) alone."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.records: list[dict[str, Any]] = []

    def _note(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def called(self, name: str) -> list[tuple[Any, ...]]:
        """The arguments of each call of the effect `name`, in order."""
        return [args for n, args in self.calls if n == name]

    def events(self, kind: str) -> list[dict[str, Any]]:
        """The records of one kind of event, in order."""
        return [r for r in self.records if r["event"] == kind]

    # -- the protocol, method by method ----------------------------------------------------------

    def record(self, record: dict[str, Any]) -> None:
        self._note("record", record)
        self.records.append(record)

    def wait_for_gpus(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        self._note("wait_for_gpus", launch, known_ours, unresolved)

    def cancel_gpu_wait(self) -> None:
        self._note("cancel_gpu_wait")

    def refresh_gpus(self) -> None:
        self._note("refresh_gpus")

    def spawn(self, launch: Launch) -> None:
        self._note("spawn", launch)

    def adopt(self, launch: Launch) -> None:
        self._note("adopt", launch)

    def abandon(self, server: ServerHandle, log: ServerLog) -> None:
        self._note("abandon", server, log)

    def terminate(self, launch: Launch) -> None:
        self._note("terminate", launch)

    def kill_group(self, launch: Launch) -> None:
        self._note("kill_group", launch)

    def end_tasks(self, launch: Launch) -> None:
        self._note("end_tasks", launch)

    def timer(self, seconds: float, msg: Message, launch: Launch | None = None) -> None:
        self._note("timer", seconds, msg, launch)

    def probe(self, launch: Launch, readiness: bool) -> None:
        self._note("probe", launch, readiness)

    def check_listener(self, launch: Launch, how: str) -> None:
        self._note("check_listener", launch, how)

    def sweep(self, launch: Launch, known_ours: KnownOurs, unresolved: bool) -> None:
        self._note("sweep", launch, known_ours, unresolved)

    def close_launch(self, launch: Launch, note: str) -> None:
        self._note("close_launch", launch, note)

    def retry_after(self, delay_s: float, gen: int, config: str | None) -> None:
        self._note("retry_after", delay_s, gen, config)

    def cancel_retry(self) -> None:
        self._note("cancel_retry")

    def save_again(self) -> None:
        self._note("save_again")

    def prune_logs(self, protect: set[str], order: list[str]) -> None:
        self._note("prune_logs", protect, order)

    def swap_settled(self, swap_id: str, outcome: dict[str, Any]) -> None:
        self._note("swap_settled", swap_id, outcome)

    def prewarm(self, swap_id: str, files: Sequence[Path], progress: PrewarmProgress) -> None:
        self._note("prewarm", swap_id, tuple(files), progress)

    def cancel_prewarm(self) -> None:
        self._note("cancel_prewarm")

    def stop_weight_cache(self, reason: str) -> None:
        self._note("stop_weight_cache", reason)

    def stop_previous(self, previous: PreviousServer) -> None:
        self._note("stop_previous", previous)

    def boot_start(self, config: str, rollback: str | None) -> None:
        self._note("boot_start", config, rollback)


_: Effects = RecordingEffects()  # mypy: the class is the protocol, method for method
