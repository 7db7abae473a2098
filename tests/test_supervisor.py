"""The supervisor in-process (real children, real stand-in); a fake clock where time is the subject."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.daemon import views
from gpuwarden.daemon.gpu import FakeGpuBackend
from gpuwarden.daemon.health import ProbeResult
from gpuwarden.daemon.logring import RING_BYTES, RING_LINES
from gpuwarden.daemon.policy import backoff_delay
from gpuwarden.daemon.preflight import Preflight, PreflightResult
from gpuwarden.daemon.server.reaper import TOKEN_ENV
from gpuwarden.daemon.states import ServerState
from gpuwarden.daemon.supervisor import Supervisor

from .support.configs import FAST_RESTART, standin_config, write_configs
from .support.gpu import start_holder
from .support.procs import Proc, alive
from .support.supervisor import FakeClock, running


class PassPreflight(Preflight):
    """Lets every config through, so a test can watch the server fail for real."""

    async def check(self, cfg: Any, replacing_port: int | None = None) -> PreflightResult:
        return PreflightResult(ok=True, method="skipped")


async def settle(turns: int = 100) -> None:
    """Let the loop take its turns: a timer the fake clock woke would post and be handled
    within a few; proving that nothing happened needs them, not wall time."""
    for _ in range(turns):
        await asyncio.sleep(0)


class NeverProbe:
    """A prober that never answers 200: readiness comes from the ready line alone."""

    async def probe(self, url: str, timeout_s: float) -> ProbeResult:
        return ProbeResult(False, "not probed")

    async def close(self) -> None:
        pass


def events(sup: Supervisor, kind: str) -> list[dict[str, Any]]:
    return sup.events.recent(1000, kind)


async def wait_event(
    sup: Supervisor, kind: str, n: int = 1, timeout: float = 20, **match: Any
) -> dict[str, Any]:
    def found(s: Supervisor) -> bool:
        return (
            len([e for e in events(s, kind) if all(e.get(k) == v for k, v in match.items())]) >= n
        )

    await sup.wait_for(found, timeout)
    return [e for e in events(sup, kind) if all(e.get(k) == v for k, v in match.items())][n - 1]


def line_seen(sup: Supervisor, text: str) -> asyncio.Event:
    """An event set when the server prints a line containing `text`."""
    event = asyncio.Event()

    def listener(lines: list[str]) -> None:
        if any(text in line for line in lines):
            event.set()

    sup.line_listeners.add(listener)
    return event


# -- time as the subject: the schedule and the reset -----------------------------------------------


async def test_crash_after_ready_backs_off_with_growing_delays_then_resets_after_stable_uptime(
    tmp_path: Path, fake_gpu: Path
) -> None:
    clock = FakeClock()
    policy = {
        "initial_delay_s": 10,
        "max_delay_s": 300,
        "multiplier": 2,
        "jitter": 0.2,
        "reset_after_s": 600,
        "crash_loop_after": 3,
    }
    flaky = standin_config("--standin-crash-after=0.05")
    async with running(
        tmp_path,
        fake_gpu,
        {"flaky": flaky},
        clock=clock,
        rng=random.Random(7),
        prober=NeverProbe(),
        settings={"restart": policy},
    ) as sup:
        await sup.start("flaky")
        expected = random.Random(7)
        settings = sup.settings.restart
        for n in (1, 2, 3):
            await sup.wait_for_state(ServerState.BACKOFF, timeout=20)
            delay = backoff_delay(settings, n, expected)
            assert sup.machine.next_retry_at == pytest.approx(clock.time() + delay)
            assert sup.machine.retries.failures == n
            assert 10 * 2 ** (n - 1) * 0.8 <= delay <= 10 * 2 ** (n - 1) * 1.2
            assert sup.machine.retries.crash_loop is (n >= 3)
            clock.advance(delay - 0.01)
            await settle()
            assert sup.machine.state == ServerState.BACKOFF  # not a moment early
            stable = standin_config()
            stable["args"]["port"] = flaky["args"]["port"]
            if n == 3:  # the operator fixes the config; the next attempt reads it
                write_configs(tmp_path, {"flaky": stable})
            clock.advance(0.02)
            await sup.wait_for_state(ServerState.STARTING, ServerState.WAITING_GPU, timeout=5)
        await sup.wait_for_state(ServerState.READY, timeout=20)
        assert sup.machine.retries.failures == 3 and sup.machine.retries.restarts == 3
        clock.advance(599)
        await settle()
        assert sup.machine.retries.failures == 3
        clock.advance(1.5)
        await sup.wait_for(lambda s: s.machine.retries.failures == 0, 5)
        assert sup.machine.retries.crash_loop is False
        assert events(sup, "failures_reset")


async def test_max_failures_ends_in_failed(tmp_path: Path, fake_gpu: Path) -> None:
    cfg = standin_config("--standin-crash-on-load=cuda_oom")
    async with running(
        tmp_path,
        fake_gpu,
        {"oom": cfg},
        settings={"restart": {"max_failures": 2, "initial_delay_s": 0}},
    ) as sup:
        await sup.start("oom")
        await sup.wait_for_state(ServerState.FAILED, timeout=30)
        assert sup.machine.retries.failures == 2
        assert (
            sup.machine.ledger.last_exit is not None
            and sup.machine.ledger.last_exit["reason"] == "cuda_oom"
        )


# -- every reason, from the stand-in's real output --------------------------------------------------

REAL_OUTPUT_CASES: list[tuple[str, list[str], dict[str, Any], str, str]] = [
    (
        "cuda_oom",
        ["--standin-crash-on-load=cuda_oom"],
        {},
        "cuda_oom",
        "torch.OutOfMemoryError: CUDA out of memory",
    ),
    (
        "not_enough_memory",
        ["--standin-crash-on-load=not_enough_memory"],
        {},
        "cuda_oom",
        "Not enough memory. Please try to increase --mem-fraction-static",
    ),
    (
        "capture",
        ["--standin-crash-on-load=capture"],
        {},
        "cuda_oom",
        "Capture cuda graph failed: CUDA error: out of memory",
    ),
    ("nccl", ["--standin-crash-on-load=nccl_init"], {}, "nccl_error", "NCCL error in:"),
    (
        "watchdog",
        ["--standin-watchdog-after=0.05"],
        {},
        "watchdog_timeout",
        "Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)",
    ),
    (
        "crash",
        ["--standin-crash-after=0.05"],
        {},
        "crash",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
    ),
    (
        "silent",
        ["--standin-silent-death-after=0.05"],
        {},
        "crash",
        "crashed with exit code -6. Triggering SIGQUIT for cleanup...",
    ),
    (
        "argparse",
        ["--cuda-graph-max-bs=8"],
        {},
        "config_error",
        "error: ambiguous option: --cuda-graph-max-bs could match",
    ),
    (
        "exit1",
        ["--speculative-algorithm=MEDUSA"],
        {},
        "crash",
        "ValueError: Unknown speculative algorithm name: MEDUSA",
    ),
    (
        "startup_timeout",
        [],
        {"health": {"startup_timeout_s": 0.3}, "scale": 1.0},
        "startup_timeout",
        "not ready within startup_timeout_s=0.3",
    ),
    (
        "exec_failed",
        [],
        {"command": ["/nonexistent/python3"]},
        "exec_failed",
        "cannot execute '/nonexistent/python3': No such file or directory",
    ),
]


@pytest.mark.parametrize(
    ("case", "flags", "fields", "reason", "evidence"),
    REAL_OUTPUT_CASES,
    ids=[c[0] for c in REAL_OUTPUT_CASES],
)
async def test_each_reason_is_recognised_from_real_output(
    tmp_path: Path,
    fake_gpu: Path,
    case: str,
    flags: list[str],
    fields: dict[str, Any],
    reason: str,
    evidence: str,
) -> None:
    fields = dict(fields)
    scale = fields.pop("scale", 0.01)
    cfg = standin_config(*flags, scale=scale, **fields)
    async with running(tmp_path, fake_gpu, {case: cfg}, preflight=PassPreflight()) as sup:
        await sup.start(case)
        exit_event = await wait_event(sup, "exit", timeout=30)
        assert exit_event["reason"] == reason, exit_event
        assert evidence in exit_event["evidence"]
        assert (
            sup.machine.ledger.last_exit is not None
            and sup.machine.ledger.last_exit["reason"] == reason
        )


async def test_a_server_that_exits_within_its_first_slice_is_launched_then_ended(
    tmp_path: Path, fake_gpu: Path
) -> None:
    # A shell starts, prints and exits in about a millisecond: before the launch's first
    # slice of CPU (10 ms) is over, so its exit is known before the machine hears of it.
    line = "ValueError: Unknown speculative algorithm name: MEDUSA"
    cfg = {"command": ["/bin/sh", "-c", f"echo '{line}' >&2; exit 3"], "preflight": {"argv": False}}
    async with running(
        tmp_path, fake_gpu, {"quick": cfg}, settings={"restart": {"initial_delay_s": 60}}
    ) as sup:
        await sup.start("quick")
        ex = await wait_event(sup, "exit")
        await sup.wait_for_state(ServerState.BACKOFF)
        assert (ex["code"], ex["reason"]) == (3, "crash"), ex
        # The machine heard of the process, then of its exit: it was starting, then stopping.
        transitions = [(e["from"], e["to"]) for e in events(sup, "state")]
        assert ("waiting_gpu", "starting") in transitions, transitions
        assert ("starting", "stopping") in transitions, transitions
        launch = events(sup, "launch")[0]
        assert launch["seq"] < ex["seq"]
        log = await asyncio.to_thread(Path(launch["log_file"]).read_text)
        assert line in log


async def test_port_in_use_is_recognised(tmp_path: Path, fake_gpu: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = standin_config(port=busy.getsockname()[1])
        async with running(tmp_path, fake_gpu, {"p": cfg}, preflight=PassPreflight()) as sup:
            await sup.start("p")
            ex = await wait_event(sup, "exit")
            assert ex["reason"] == "port_in_use"
            assert "address already in use" in ex["evidence"]
            # Ended on the bind error: SGLang would first wait for its warm-up against
            # whatever holds the port (120 tries of 5 s against this silent socket).
            assert ex["signal"] == signal.SIGKILL


async def test_external_sigkill_is_a_signal_exit(tmp_path: Path, fake_gpu: Path) -> None:
    async with running(tmp_path, fake_gpu, {"k": standin_config()}) as sup:
        await sup.start("k")
        await sup.wait_for_state(ServerState.READY, timeout=20)
        assert sup.machine.launch is not None and sup.machine.launch.child is not None
        import os  # noqa: PLC0415

        os.kill(sup.machine.launch.child.pid, signal.SIGKILL)
        ex = await wait_event(sup, "exit")
        assert ex["reason"] == "signal"
        assert ex["evidence"] == "killed by SIGKILL (possible OOM kill)"
        assert ex["signal"] == 9


def launch_processes(launch: Any) -> list[int]:
    """Live processes (not zombies) of `launch`, by its token: launch ids are unique per daemon
    only, and another suite's daemon may be running a launch of the same id."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(TOKEN_ENV) == launch.token:
                found.append(proc.pid)
    return found


def spawned(sup: Supervisor) -> list[Any]:
    """The launches `sup` executes from now on, each as its spawn begins."""
    launches: list[Any] = []
    spawn = sup.host.spawn

    def recording(launch: Any) -> None:
        launches.append(launch)
        spawn(launch)

    sup.host.spawn = recording  # type: ignore[method-assign]
    return launches


async def test_log_dir_through_a_regular_file_is_log_unwritable(
    tmp_path: Path, fake_gpu: Path
) -> None:
    (tmp_path / "notadir").write_text("a regular file")
    async with running(
        tmp_path,
        fake_gpu,
        {"c": standin_config()},
        settings={"log_dir": str(tmp_path / "notadir" / "logs")},
    ) as sup:
        launches = spawned(sup)
        await sup.start("c")
        ex = await wait_event(sup, "exit")
        assert ex["reason"] == "log_unwritable"
        assert "cannot create the log" in ex["evidence"]
        assert sup.machine.state in (
            ServerState.BACKOFF,
            ServerState.WAITING_GPU,
            ServerState.FAILED,
        )
        assert not events(sup, "launch")  # nothing was launched without a log
        # The server was killed at its exec, before it did anything, and reaped.
        (launch,) = [la for la in launches if la.launch_id == ex["launch_id"]]
        assert not launch_processes(launch)


async def test_foreign_gpu_holder_is_gpu_busy_naming_it(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    holder = start_holder(procs, fake_gpu, 0, 50000)
    async with running(
        tmp_path, fake_gpu, {"c": standin_config()}, settings={"gpu": {"release_timeout_s": 0.3}}
    ) as sup:
        await sup.start("c")
        ex = await wait_event(sup, "exit")
        assert ex["reason"] == "gpu_busy"
        assert f"pid {holder.pid}" in ex["evidence"]
        assert alive(holder.pid)  # a foreign holder is never killed


async def test_launch_waits_for_gpu_memory_then_starts(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    holder = start_holder(procs, fake_gpu, 0, 50000)
    async with running(
        tmp_path, fake_gpu, {"c": standin_config()}, settings={"gpu": {"release_timeout_s": 30}}
    ) as sup:
        await sup.start("c")
        await wait_event(sup, "gpu_wait")
        assert sup.machine.state == ServerState.WAITING_GPU
        holder.signal(signal.SIGTERM)
        await sup.wait_for_state(ServerState.STARTING, ServerState.READY, timeout=10)


async def test_stop_during_backoff_goes_straight_to_stopped(tmp_path: Path, fake_gpu: Path) -> None:
    cfg = standin_config("--standin-crash-on-load=cuda_oom")
    async with running(
        tmp_path, fake_gpu, {"c": cfg}, settings={"restart": {"initial_delay_s": 60}}
    ) as sup:
        await sup.start("c")
        await sup.wait_for_state(ServerState.BACKOFF, timeout=20)
        await sup.stop()
        assert sup.machine.state == ServerState.STOPPED
        transitions = [(e["from"], e["to"]) for e in events(sup, "state")]
        assert transitions[-1] == ("backoff", "stopped")


async def test_stop_during_start_cancels_it(tmp_path: Path, fake_gpu: Path) -> None:
    async with running(tmp_path, fake_gpu, {"slow": standin_config(scale=1.0)}) as sup:
        await sup.start("slow")
        await sup.wait_for_state(ServerState.STARTING, timeout=10)
        await sup.stop()
        await sup.wait_for_state(ServerState.STOPPED, timeout=20)
        ex = events(sup, "exit")[-1]
        assert ex["reason"] == "requested_stop"
        assert ex["signal"] == signal.SIGTERM  # no handler while loading: died at once


async def test_flood_of_a_million_lines_reaches_the_file_with_the_ring_capped(
    tmp_path: Path, fake_gpu: Path
) -> None:
    # No liveness probes here: each one makes the stand-in's scheduler print a Prefill line into
    # the same pipe as the flood, and two writers can split each other's lines (SGLang too).
    cfg = standin_config("--standin-flood=1000000", health={"interval_s": 600})
    async with running(tmp_path, fake_gpu, {"f": cfg}) as sup:
        done = line_seen(sup, "flood done")
        await sup.start("f")
        await sup.wait_for_state(ServerState.READY, timeout=20)
        assert sup.machine.launch is not None and sup.machine.launch.log is not None
        log = sup.machine.launch.log

        await asyncio.wait_for(done.wait(), 120)
        await sup.stop()
        await sup.wait_for_state(ServerState.STOPPED, timeout=20)
        assert len(log.ring) <= RING_LINES
        assert log.ring.nbytes <= RING_BYTES
        with log.path.open("rb") as f:
            count = sum(1 for line in f if b"] flood line " in line)
        assert count == 1_000_000


async def test_arbitrary_output_never_breaks_supervision(tmp_path: Path, fake_gpu: Path) -> None:
    cfg = standin_config("--standin-invalid-utf8", "--standin-long-line=1048576")
    async with running(tmp_path, fake_gpu, {"b": cfg}) as sup:
        seen = line_seen(sup, "long line")
        await sup.start("b")
        await sup.wait_for_state(ServerState.READY, timeout=20)
        await asyncio.wait_for(seen.wait(), 20)
        lines = views.ring_lines(sup.snapshot(), 50)
        assert any("invalid bytes: \ufffd\ufffd" in line for line in lines)
        long_line = next(line for line in lines if "long line" in line)
        assert long_line.endswith("[truncated; the log file has the whole line]")
        assert sup.machine.state == ServerState.READY


# -- supervision never wedges ----------------------------------------------------------------------


class WedgingGpu(FakeGpuBackend):
    """The fake GPUs, whose snapshot blocks (a wedged driver) once `wedge` is set."""

    blocking = True

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.wedge = threading.Event()
        self.unwedge = threading.Event()

    def snapshot(self) -> Any:
        if self.wedge.is_set():
            self.unwedge.wait(60)
        return super().snapshot()


async def test_a_helper_task_past_its_deadline_is_stuck_supervision(
    tmp_path: Path, fake_gpu: Path
) -> None:
    """The watchdog is fed only while `stuck()` is None: a sweep that never ends (here, a GPU
    snapshot that blocks) is stuck supervision, not a state that merely lasts."""
    gpu = WedgingGpu(fake_gpu)
    async with running(
        tmp_path,
        gpu,
        {"f": standin_config()},
        settings={"default_config": "f"},
        preflight=PassPreflight(),
    ) as sup:
        sup.host.exit_sweep.deadline_s = 0.5  # before the supervisor's first step
        try:
            await sup.wait_for_state(ServerState.READY, timeout=30)
            assert sup.stuck() is None
            gpu.wedge.set()
            assert sup.machine.launch is not None and sup.machine.launch.child is not None
            sup.machine.launch.child.kill_group()
            await sup.wait_for_state(ServerState.STOPPING)
            await asyncio.wait_for(_until(lambda: sup.stuck() is not None), 10)
            assert "after_exit task is" in (sup.stuck() or "")
            assert sup.status()["supervising"] is False
            gpu.wedge.clear()
            gpu.unwedge.set()
            await sup.wait_for_state(ServerState.READY, timeout=30)
            assert sup.stuck() is None
        finally:
            gpu.unwedge.set()  # else the shutdown would wait on the wedged snapshot


async def test_a_sweep_that_cannot_begin_is_an_internal_error_and_supervision_goes_on(
    tmp_path: Path, fake_gpu: Path
) -> None:
    """The sweep begins in a loop callback, where a failure would reach only asyncio's exception
    handler and leave the machine in stopping for ever: it is the sweep's failure, recorded,
    and the exit is handled without it."""
    async with running(tmp_path, fake_gpu, {"f": standin_config()}) as sup:
        await sup.start("f")
        await sup.wait_for_state(ServerState.READY, timeout=20)
        host_task = sup.host.tasks.task

        def refuse_the_sweep(coro: Any, **kw: Any) -> Any:
            if getattr(coro, "__qualname__", "").endswith("_after_exit"):
                raise RuntimeError("no task can be made")
            return host_task(coro, **kw)

        sup.host.tasks.task = refuse_the_sweep  # type: ignore[method-assign]
        launch = sup.machine.launch
        assert launch is not None and launch.child is not None
        launch.child.kill_group()
        failed = await wait_event(sup, "internal_error", task="after_exit")
        assert "no task can be made" in failed["error"]
        assert (await wait_event(sup, "exit", launch_id=launch.launch_id))["reason"] == "signal"
        await sup.wait_for_state(ServerState.READY, timeout=20)
        assert sup.machine.launch is not None and sup.machine.launch.gen > launch.gen


async def test_a_spawn_cancelled_before_it_began_ends_its_server_and_is_an_internal_error(
    tmp_path: Path, fake_gpu: Path
) -> None:
    """The server is executed before its task first runs; a task cancelled before that never
    runs its `finally`. The server must not run on unseen, nor the machine wait for a spawn's
    outcome that will not come."""
    async with running(tmp_path, fake_gpu, {"f": standin_config()}) as sup:
        host_task = sup.host.tasks.task
        cancelled: list[Any] = []  # the launch whose spawn is cancelled

        def cancel_the_first_spawn(coro: Any, **kw: Any) -> Any:
            task = host_task(coro, **kw)
            if getattr(coro, "__qualname__", "").endswith("_spawn") and not cancelled:
                cancelled.append(sup.machine.launch)
                task.cancel()  # before its first step: the loop has not run it
            return task

        sup.host.tasks.task = cancel_the_first_spawn  # type: ignore[method-assign]
        await sup.start("f")
        failed = await wait_event(sup, "internal_error", task="spawn")
        assert "cancelled" in failed["error"]
        # SIGKILLed: gone once the kernel has run it to its end
        await asyncio.wait_for(_until(lambda: launch_processes(cancelled[0]) == []), 10)
        await sup.wait_for_state(ServerState.READY, timeout=20)
        assert sup.machine.launch is not None and sup.machine.launch.gen > cancelled[0].gen


async def _until(predicate: Any) -> None:
    while not predicate():  # noqa: ASYNC110 - a deadline passing is no event to await
        await asyncio.sleep(0.05)


# -- what reaches the disk while a relaunch is under way -------------------------------------------


async def file_says(path: Path, predicate: Any, timeout: float) -> Any:
    """Poll a file the daemon writes on its own schedule (nothing announces the write)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            data = json.loads(await asyncio.to_thread(path.read_text))
            if predicate(data):
                return data
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {path.name}")
        await asyncio.sleep(0.02)


async def test_a_long_backoff_is_still_saved_and_its_records_written(
    tmp_path: Path, fake_gpu: Path
) -> None:
    """The save of a relaunch's passing states is put off only briefly: a backoff that lasts is
    in state.json, and every record of the crash is in events.jsonl, in order, while it waits."""
    cfg = standin_config("--standin-crash-on-load=cuda_oom")
    async with running(
        tmp_path,
        fake_gpu,
        {"c": cfg},
        settings={"restart": {"initial_delay_s": 60}},
    ) as sup:
        await sup.start("c")
        await sup.wait_for_state(ServerState.BACKOFF, timeout=20)
        state = await file_says(
            tmp_path / "state" / "state.json",
            lambda d: d.get("failures") == 1 and d.get("current_launch") is None,
            10,
        )
        assert state["failures"] == 1 and state["current_launch"] is None
        log = tmp_path / "state" / "events.jsonl"

        async def written() -> list[dict[str, Any]]:
            text = await asyncio.to_thread(log.read_text)
            return [json.loads(line) for line in text.splitlines()]

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not any(e["event"] == "state" and e.get("to") == "backoff" for e in await written()):
            assert loop.time() < deadline, "the backoff's record never reached events.jsonl"
            await asyncio.sleep(0.02)
        on_disk = await written()
        seqs = [e["seq"] for e in on_disk]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        kinds = [e["event"] for e in on_disk]
        assert "exit" in kinds and kinds.index("exit") < len(kinds) - 1
        assert sup.machine.state == ServerState.BACKOFF


async def test_records_of_a_quick_relaunch_are_all_written_in_order(
    tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config("--standin-crash-on-load=cuda_oom")
    async with running(
        tmp_path,
        fake_gpu,
        {"c": cfg},
        settings={"restart": {**FAST_RESTART, "initial_delay_s": 0, "max_failures": 3}},
    ) as sup:
        await sup.start("c")
        await sup.wait_for_state(ServerState.FAILED, timeout=30)
    on_disk = [
        json.loads(line) for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()
    ]
    assert [e["seq"] for e in on_disk] == sorted(e["seq"] for e in on_disk)
    in_memory = [e["seq"] for e in sup.events.recent(10_000)]
    assert [e["seq"] for e in on_disk][-len(in_memory) :] == in_memory[-len(on_disk) :]
    assert sum(e["event"] == "exit" for e in on_disk) == 3
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["failures"] == 3 and state["current_launch"] is None


async def test_the_newest_save_behind_a_write_under_way_is_written_at_close(
    tmp_path: Path, fake_gpu: Path
) -> None:
    """A state.json write still on the writer thread when the daemon closes: the newer record
    queued behind it is written after it, not dropped."""
    gate, started = threading.Event(), threading.Event()
    async with running(tmp_path, fake_gpu, {}) as sup:
        store = sup.store
        real = store.save

        def slow(data: dict[str, Any]) -> str | None:
            started.set()
            gate.wait(10)
            return real(data)

        store.save = slow  # type: ignore[method-assign]
        sup.host.save({"n": 1})
        await asyncio.to_thread(started.wait, 5)
        sup.host.save({"n": 2})  # behind the write under way
        asyncio.get_running_loop().call_later(0.3, gate.set)  # released while closing
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state != {"n": 1}, "the record behind the last write was dropped"


async def test_a_record_that_cannot_be_written_costs_no_other(
    tmp_path: Path, fake_gpu: Path
) -> None:
    async with running(tmp_path, fake_gpu, {}) as sup:
        circular: dict[str, Any] = {}
        circular["self"] = circular
        sup.host.record({"event": "first"})
        sup.host.record({"event": "broken", "value": circular})
        sup.host.record({"event": "last"})
        sup.host.flush_records()
        assert [e["event"] for e in sup.events.recent(3)] == ["first", "last"]
        assert [e["seq"] for e in sup.events.recent(2)] == [1, 2]
