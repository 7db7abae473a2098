"""A scheduler rank once loaded: rank 0's batch loop, the other ranks' wait, faults after ready.

Rank 0 admits requests (a ``Prefill batch`` line), advances every running request by one
decode cycle at the pace of `specmodel.DecodeModel` (never time-scaled), and logs a ``Decode
batch`` line every ``--decode-log-interval`` cycles; the other ranks wait for shutdown. On the
main process's ``ready`` each rank arms its timed fault, if any (crash, silent death, watchdog,
hang), and fires it when due.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .childconfig import ChildConfig
from .logline import log_line
from .specmodel import DecodeModel


@dataclass
class _Req:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    generated: int = 0


class Scheduler:
    def __init__(
        self, rank: int, cfg: ChildConfig, conn: Connection, max_total_tokens: int
    ) -> None:
        self.rank = rank
        self.cfg = cfg
        self.conn = conn
        self.prefix = f" TP{rank}" if cfg.tp_size > 1 else ""
        self.max_total_tokens = max_total_tokens
        self.fault_kind = ""
        self.fault_due: float | None = None
        self.hanging = False

    def log(self, message: str) -> None:
        log_line(self.prefix, message)

    # -- faults after ready ----------------------------------------------------------------

    def _arm_fault(self) -> None:
        planned = self.cfg.faults.after_ready(self.rank)
        if planned is not None:
            self.fault_kind, seconds = planned
            self.fault_due = time.monotonic() + seconds

    def _fault_timeout(self) -> float | None:
        if self.fault_due is None:
            return None
        return max(0.0, self.fault_due - time.monotonic())

    def _fire_fault_if_due(self) -> None:
        if self.fault_due is None or time.monotonic() < self.fault_due:
            return
        self.fault_due = None
        kind = self.fault_kind
        if kind == "crash":
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered\n"
                "CUDA kernel errors might be asynchronously reported at some other API call, "
                "so the stacktrace below might be incorrect.\n"
                "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
                "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
            )
        if kind == "silent_death":
            os.abort()  # a C++-level abort: no Python traceback, exit by SIGABRT
        if kind == "watchdog":
            if self.cfg.profile.at_least_0_5_12:
                self.log("Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)")
            else:
                self.log("Watchdog timeout (self.watchdog_timeout=300)")
            self.cfg.sleep("watchdog_grace")
            with contextlib.suppress(ProcessLookupError):
                os.kill(os.getppid(), signal.SIGQUIT)
            self.hanging = True
        if kind == "hang":
            self.hanging = True

    def _hang(self) -> None:
        """Make no progress, but stay alive (and keep reading so the pipe never fills)."""
        while True:
            if self.conn.poll(None):
                msg = self.conn.recv()
                if msg[0] == "shutdown":
                    return

    # -- serving -------------------------------------------------------------------------------

    def serve(self) -> None:
        if self.rank != 0:
            self._idle()
            return
        cfg = self.cfg
        model = DecodeModel(cfg.spec, cfg.cuda_graph)
        rng = random.Random(cfg.seed)
        waiting: deque[_Req] = deque()
        running: list[_Req] = []
        interval = max(1, cfg.decode_log_interval)
        cycles = 0
        win_tokens = 0
        win_seq_cycles = 0
        win_start = time.monotonic()
        total_accepted = 0
        total_seq_cycles = 0
        deadline = time.monotonic()

        while True:
            timeout = self._fault_timeout() if not (running or waiting) else 0.0
            while self.conn.poll(timeout):
                msg = self.conn.recv()
                timeout = 0.0
                kind = msg[0]
                if kind == "gen":
                    waiting.append(_Req(rid=msg[1], prompt_tokens=msg[2], max_new_tokens=msg[3]))
                elif kind == "abort":
                    running = [r for r in running if r.rid != msg[1]]
                    waiting = deque(r for r in waiting if r.rid != msg[1])
                elif kind == "ready":
                    self._arm_fault()
                elif kind == "shutdown":
                    return
            self._fire_fault_if_due()
            if self.hanging:
                self._hang()
                return
            if waiting:
                new: list[_Req] = []
                while waiting and len(running) + len(new) < cfg.max_running_requests:
                    new.append(waiting.popleft())
                if new:
                    new_tokens = sum(r.prompt_tokens for r in new)
                    used = sum(r.prompt_tokens + r.generated for r in running) + new_tokens
                    t0 = time.monotonic()
                    time.sleep(0.0005 + new_tokens * 0.00001)
                    self.log(
                        cfg.profile.prefill_line(
                            new_seq=len(new),
                            new_token=new_tokens,
                            cached=0,
                            usage=used / max(1, self.max_total_tokens),
                            running=len(running),
                            queue=len(waiting),
                            input_throughput=new_tokens / max(1e-6, time.monotonic() - t0),
                        )
                    )
                    # Prefill yields each new request's first token.
                    for r in new:
                        r.generated = 1
                    self.conn.send(("out", [(r.rid, 1, r.max_new_tokens <= 1) for r in new]))
                    if not running:
                        deadline = time.monotonic()
                        if win_tokens == 0:
                            win_start = deadline  # the window starts with work, not idle time
                    running.extend(r for r in new if r.generated < r.max_new_tokens)
            if not running:
                continue
            # One decode cycle for the whole batch, paced in real time (never scaled).
            deadline += model.cycle_s(len(running))
            now = time.monotonic()
            if deadline > now:
                time.sleep(deadline - now)
            elif now - deadline > 0.25:
                deadline = now  # far behind (a stalled machine): do not burst to catch up
            out = []
            for r in running:
                n = min(model.sample_accepted(rng), r.max_new_tokens - r.generated)
                r.generated += n
                win_tokens += n
                total_accepted += n
                win_seq_cycles += 1
                total_seq_cycles += 1
                out.append((r.rid, n, r.generated >= r.max_new_tokens))
            self.conn.send(("out", out))
            cycles += 1
            if cycles % interval == 0:
                now = time.monotonic()
                accept_len = win_tokens / max(1, win_seq_cycles) if cfg.spec else None
                rate = None
                if cfg.spec is not None and accept_len is not None:
                    rate = cfg.profile.accept_rate(
                        accept_len, cfg.spec.steps, cfg.spec.draft_tokens
                    )
                throughput = win_tokens / max(1e-6, now - win_start)
                tokens = sum(r.prompt_tokens + r.generated for r in running)
                self.log(
                    cfg.profile.decode_line(
                        running=len(running),
                        tokens=tokens,
                        usage=tokens / max(1, self.max_total_tokens),
                        throughput=throughput,
                        queue=len(waiting),
                        cuda_graph=cfg.cuda_graph,
                        accept_len=accept_len,
                        accept_rate=rate,
                    )
                )
                avg_accept = total_accepted / max(1, total_seq_cycles) if cfg.spec else None
                self.conn.send(
                    (
                        "stats",
                        {"last_gen_throughput": throughput, "avg_spec_accept_length": avg_accept},
                    )
                )
                win_tokens = 0
                win_seq_cycles = 0
                win_start = now
            running = [r for r in running if r.generated < r.max_new_tokens]

    def _idle(self) -> None:
        """Ranks other than 0: wait for shutdown, firing this rank's timed fault if any."""
        while True:
            if self.conn.poll(self._fault_timeout()):
                msg = self.conn.recv()
                if msg[0] == "shutdown":
                    return
                if msg[0] == "ready":
                    self._arm_fault()
            self._fire_fault_if_due()
            if self.hanging:
                self._hang()
                return
