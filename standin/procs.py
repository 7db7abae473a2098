"""The stand-in's child processes: one scheduler per TP rank and a detokenizer.

They are started with multiprocessing *spawn*, as SGLang's are, so this module keeps its imports
light. Each child first simulates its heavy imports, then arms parent-death (PR_SET_PDEATHSIG,
SIGKILL) and names itself with setproctitle, exactly in SGLang's order: a parent that dies
during the import window leaves an orphan that goes on to "load" onto the GPU.

Scheduler rank 0 runs the batch loop: it admits requests (a ``Prefill batch`` line), advances
every running request by one decode cycle at the pace of `specmodel.DecodeModel` (never
time-scaled), and logs a ``Decode batch`` line every ``--decode-log-interval`` cycles.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from . import fakegpu
from .faults import Faults
from .specmodel import DecodeModel, SpecParams
from .versions import PROFILES, Profile

PR_SET_PDEATHSIG = 1
GIB = 1024.0


def log_line(prefix: str, message: str) -> None:
    """One line in SGLang's format: ``[YYYY-mm-dd HH:MM:SS<prefix>] message`` on stderr."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stderr.write(f"[{stamp}{prefix}] {message}\n")
    sys.stderr.flush()


def arm_parent_death() -> None:
    """SGLang's kill_itself_when_parent_died(): SIGKILL this process when its parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def set_title(title: str) -> None:
    try:
        import setproctitle  # noqa: PLC0415 - optional, as in SGLang

        setproctitle.setproctitle(title)
    except ImportError:
        pass


@dataclass
class ChildConfig:
    """Everything a child needs, picklable for spawn."""

    version: str
    tp_size: int
    time_scale: float
    seed: int
    decode_log_interval: int
    spec: SpecParams | None
    cuda_graph: bool
    mem_fraction_static: float
    max_running_requests: int
    context_length: int
    model_path: str
    draft_model_path: str | None
    faults: Faults
    fake_gpu_dir: str | None = None
    cuda_visible_devices: str | None = None
    durations: dict[str, float] = field(default_factory=dict)

    @property
    def profile(self) -> Profile:
        return PROFILES[self.version]

    def sleep(self, name: str) -> None:
        time.sleep(self.durations.get(name, 0.0) * self.time_scale)


@dataclass
class _Req:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    generated: int = 0


class _Scheduler:
    def __init__(self, rank: int, cfg: ChildConfig, conn: Connection) -> None:
        self.rank = rank
        self.cfg = cfg
        self.conn = conn
        self.prefix = f" TP{rank}" if cfg.tp_size > 1 else ""
        self.fake_root = Path(cfg.fake_gpu_dir) if cfg.fake_gpu_dir else None
        self.total_mib = fakegpu.DEFAULT_TOTAL_MIB
        self.gpu = rank
        self.used_mib = 0
        self.max_total_tokens = 0
        self.fault_kind = ""
        self.helper_pids: set[int] = set()  # processes of ours holding memory (the escapee)
        self.helper_mib = 0
        self.fault_due: float | None = None
        self.hanging = False

    def log(self, message: str) -> None:
        log_line(self.prefix, message)

    # -- GPU memory (fake) ---------------------------------------------------------------------

    def _others_mib(self) -> int:
        if self.fake_root is None:
            return 615  # the driver's reserved memory on an idle H200
        reader = fakegpu.FakeGpuReader(self.fake_root)
        for gpu in reader.usage():
            if gpu.index == self.gpu:
                mine = {os.getpid(), *self.helper_pids}
                return sum(h.mib for h in gpu.holders if h.pid not in mine)
        return 0

    def _hold(self, mib: int) -> None:
        self.used_mib = mib
        if self.fake_root is not None:
            fakegpu.write_holder(self.fake_root, self.gpu, mib)

    def avail_gb(self) -> float:
        used = self._others_mib() + self.used_mib + self.helper_mib
        return max(0.0, self.total_mib - used) / GIB

    # -- startup -------------------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        cfg = self.cfg
        faults = cfg.faults
        if self.fake_root is not None:
            spec = fakegpu.read_spec(self.fake_root)
            self.total_mib = spec.total_mib
            self.gpu = fakegpu.gpu_for_rank(spec, self.rank, cfg.cuda_visible_devices)
        self.log("Init torch distributed begin.")
        cfg.sleep("dist_init")
        if faults.has("nccl_init"):
            raise_nccl_init_error(self.rank)
        self.log("Init torch distributed ends. mem usage=0.00 GB")

        weights_mib = int(self.total_mib * 0.30)
        avail = self.avail_gb()
        self.log(f"Load weight begin. avail mem={avail:.2f} GB")
        if faults.has("cuda_oom") or avail * GIB < weights_mib:
            raise_cuda_oom(weights_mib, avail, self.total_mib / GIB)
        if faults.escape_grandchild_mib and self.rank == 0 and self.fake_root is not None:
            self.helper_pids.add(
                start_escapee(self.fake_root, self.gpu, faults.escape_grandchild_mib)
            )
            self.helper_mib = faults.escape_grandchild_mib
        start = time.monotonic()
        shards = 4 + faults.progress_bars
        for i in range(shards + 1):
            sys.stderr.write(
                f"\rLoading safetensors checkpoint shards: {100 * i // shards:3d}% Completed "
                f"| {i}/{shards} [00:0{i}<00:00,  1.05it/s]"
            )
            sys.stderr.flush()
            if i < shards:
                cfg.sleep("load_shard")
        sys.stderr.write("\n")
        self._hold(weights_mib)
        self.log(
            cfg.profile.load_weight_end(
                time.monotonic() - start, self.avail_gb(), weights_mib / GIB
            )
        )

        self.log("Using KV cache dtype: torch.bfloat16")
        kv_mib = int(self.total_mib * cfg.mem_fraction_static) - weights_mib - self.helper_mib
        if faults.has("not_enough_memory") or kv_mib <= 0 or self.avail_gb() * GIB < kv_mib:
            raise_not_enough_memory(cfg.mem_fraction_static)
        cfg.sleep("kv_alloc")
        self.max_total_tokens = max(1024, kv_mib * 16)
        kv_gb = kv_mib / GIB / 2
        self.log(
            f"KV Cache is allocated. #tokens: {self.max_total_tokens}, "
            f"K size: {kv_gb:.2f} GB, V size: {kv_gb:.2f} GB"
        )
        self._hold(weights_mib + kv_mib)
        self.log(f"Memory pool end. avail mem={self.avail_gb():.2f} GB")

        if cfg.cuda_graph:
            self._capture("target", faults.has("capture"))
        if cfg.spec is not None:
            self.log(f"Load weight begin. avail mem={self.avail_gb():.2f} GB")
            cfg.sleep("draft_load")
            self._hold(self.used_mib + 2048)
            self.log(cfg.profile.load_weight_end(0.5, self.avail_gb(), 2.0))
            if cfg.cuda_graph:
                self._capture("draft", False)
        if self.rank == 0:
            self.log(
                f"max_total_num_tokens={self.max_total_tokens}, chunked_prefill_size=8192, "
                f"max_prefill_tokens=16384, max_running_requests={cfg.max_running_requests}, "
                f"context_len={cfg.context_length}, available_gpu_mem={self.avail_gb():.2f} GB"
            )
        return {
            "status": "ready",
            "max_total_num_tokens": self.max_total_tokens,
            "max_req_input_len": cfg.context_length - 8,
        }

    def _capture(self, what: str, fail: bool) -> None:
        cfg = self.cfg
        bs = [1, 2, 4, 8, 12, 16, 24, 32]
        avail = self.avail_gb()
        spec = cfg.spec
        if cfg.profile.new_capture_lines:
            if what == "target":
                kind = "target verify" if spec else "target decode"
                self.log(
                    f"Capture {kind} CUDA graph begin. backend=full, "
                    f"num_tokens_per_req={spec.draft_tokens if spec else 1}, "
                    f"avail mem={avail:.2f} GB"
                )
            else:
                self.log(
                    f"Capture draft decode CUDA graph begin. backend=full, "
                    f"num_tokens_per_req={spec.topk if spec else 1}, bs={bs}, "
                    f"avail mem={avail:.2f} GB"
                )
        elif what == "target":
            self.log(
                "Capture cuda graph begin. This can take up to several minutes. "
                f"avail mem={avail:.2f} GB"
            )
            self.log(f"Capture cuda graph bs {bs}")
        else:
            self.log(
                "Capture draft cuda graph begin. This can take up to several minutes. "
                f"avail mem={avail:.2f} GB"
            )
        start = time.monotonic()
        for i, b in enumerate(reversed(bs)):
            sys.stderr.write(
                f"\rCapturing batches (bs={b} avail_mem={avail - 0.05 * i:.2f} GB): "
                f"{100 * (i + 1) // len(bs):3d}%|          | {i + 1}/{len(bs)} [00:00<00:00]"
            )
            sys.stderr.flush()
            cfg.sleep("capture_step")
            if fail and i == len(bs) // 2:
                sys.stderr.write("\n")
                raise_capture_failure()
        sys.stderr.write("\n")
        self._hold(self.used_mib + 1474)
        elapsed = time.monotonic() - start
        avail = self.avail_gb()
        if cfg.profile.new_capture_lines:
            kind = (
                ("target verify" if spec else "target decode")
                if what == "target"
                else "draft decode"
            )
            self.log(
                f"Capture {kind} CUDA graph end. bs={bs}, elapsed={elapsed:.2f} s, "
                f"mem usage=1.44 GB, avail mem={avail:.2f} GB."
            )
        elif what == "target":
            self.log(
                f"Capture cuda graph end. Time elapsed: {elapsed:.2f} s. mem usage=1.44 GB. "
                f"avail mem={avail:.2f} GB."
            )
        else:
            self.log(f"Capture draft cuda graph end. Time elapsed: {elapsed:.2f} s.")
            self.log("Capture draft extend cuda graph begin. This can take up to several minutes.")
            self.log(f"Capture draft extend cuda graph end. Time elapsed: {elapsed:.2f} s.")

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


def start_escapee(root: Path, gpu: int, mib: int) -> int:
    """Start `escapee`, wait until its holder is registered; return the escapee's pid."""
    with tempfile.TemporaryDirectory() as tmp:
        pidfile = Path(tmp) / "escapee.pid"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuwarden.standin.escapee",
                str(root),
                str(gpu),
                str(mib),
                str(pidfile),
            ],
            stdin=subprocess.DEVNULL,
            check=True,
        )
        return int(pidfile.read_text())


# -- SGLang's failure output ---------------------------------------------------------------------


def raise_cuda_oom(needed_mib: int, avail_gb: float, total_gb: float) -> None:
    free = min(avail_gb, needed_mib / GIB * 0.4)  # the failing allocation did not fit
    used = max(0.0, total_gb - free)
    raise _torch_oom(
        f"CUDA out of memory. Tried to allocate {needed_mib / GIB:.2f} GiB. GPU 0 has a total "
        f"capacity of {total_gb:.2f} GiB of which {free:.2f} GiB is free. Process has "
        f"{used:.2f} GiB memory in use. Of the allocated memory "
        f"{max(0.0, used - 0.41):.2f} GiB is allocated by PyTorch, and 0.41 GiB is reserved "
        "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def _torch_oom(message: str) -> Exception:
    cls: type[RuntimeError] = type("OutOfMemoryError", (RuntimeError,), {"__module__": "torch"})
    return cls(message)


def raise_nccl_init_error(rank: int) -> None:
    cls = type("DistBackendError", (RuntimeError,), {"__module__": "torch.distributed"})
    raise cls(
        "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled "
        "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed "
        "or device error. \nLast error:\n"
        f"socketStartConnect: Connect to 127.0.0.1<{46000 + rank}> failed : "
        "Software caused connection abort"
    )


def raise_not_enough_memory(mem_fraction_static: float) -> None:
    raise RuntimeError(
        "Not enough memory. Please try to increase --mem-fraction-static. "
        f"Current value: mem_fraction_static={mem_fraction_static}"
    )


def raise_capture_failure() -> None:
    raise Exception(
        "Capture cuda graph failed: CUDA error: out of memory\n"
        "Possible solutions:\n"
        "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
        "2. set --cuda-graph-max-bs to a smaller value (e.g., 16)\n"
        "3. disable torch compile by not using --enable-torch-compile\n"
        "4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge performance loss)\n"
        "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose \n"
    )


def report_scheduler_exception(prefix: str) -> None:
    """SGLang's scheduler `except`: log the traceback, then SIGQUIT the parent."""
    log_line(prefix, f"Scheduler hit an exception: {traceback.format_exc()}")
    with contextlib.suppress(ProcessLookupError):
        os.kill(os.getppid(), signal.SIGQUIT)


# -- entry points (spawn targets) ----------------------------------------------------------------


def run_scheduler(rank: int, cfg: ChildConfig, conn: Connection) -> None:
    cfg.sleep("child_import")
    arm_parent_death()
    set_title("sglang::scheduler" if cfg.tp_size == 1 else f"sglang::scheduler_TP{rank}")
    sched = _Scheduler(rank, cfg, conn)
    try:
        info = sched.load()
        conn.send(info)
        sched.serve()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except Exception:
        report_scheduler_exception(sched.prefix)
    finally:
        if sched.fake_root is not None:
            fakegpu.remove_holder(sched.fake_root)


def run_detokenizer(cfg: ChildConfig, conn: Connection) -> None:
    cfg.sleep("child_import")
    arm_parent_death()
    set_title("sglang::detokenizer")
    with contextlib.suppress(EOFError, BrokenPipeError, KeyboardInterrupt):
        while True:
            msg = conn.recv()
            if msg[0] == "shutdown":
                return
