"""One scheduler rank's startup on the (fake) GPU, line by line as SGLang logs it.

`RankLoader.load` runs torch distributed init, loads the weights (with the checkpoint shards'
progress bar), allocates the KV cache, captures the CUDA graphs (target, then draft under
speculative decoding) and reports the token capacity; each step checks and holds fake GPU
memory, so another holder on the GPU makes it fail as SGLang does. The escapee (a grandchild
that outlives the server) is started here when a fault asks for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import fakegpu, weightcache
from .childconfig import ChildConfig
from .failures import (
    GIB,
    raise_capture_failure,
    raise_cuda_oom,
    raise_nccl_init_error,
    raise_not_enough_memory,
)
from .logline import log_line

# SGLang 0.5.23's graph phases in `startup_time.cuda_graph` (`graph_memory_usage.py`).
GRAPH_KEYS = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")


class RankLoader:
    def __init__(self, rank: int, cfg: ChildConfig) -> None:
        self.rank = rank
        self.cfg = cfg
        # What SGLang 0.5.23 reports of its start (`startup_time` in /server_info), in seconds.
        self.timings: dict[str, Any] = {"load_weight": 0.0, "kv_cache_allocation": 0.0}
        self.graph_times: dict[str, float] = {}
        self.prefix = f" TP{rank}" if cfg.tp_size > 1 else ""
        self.fake_root = Path(cfg.fake_gpu_dir) if cfg.fake_gpu_dir else None
        self.total_mib = fakegpu.DEFAULT_TOTAL_MIB
        self.gpu = rank
        self.used_mib = 0
        self.max_total_tokens = 0
        self.helper_pids: set[int] = set()  # processes of ours holding memory (the escapee)
        self.helper_mib = 0

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
        began = time.monotonic()
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
        # --weight-cache-mode client: the daemon's weights, mapped (it holds their memory).
        cached = self._from_weight_cache() if cfg.weight_cache is not None else None
        own_weights = 0 if cached is not None else weights_mib
        shards = 0 if cached is not None else cfg.load_shards + faults.progress_bars
        for i in range(shards + 1 if shards else 0):
            sys.stderr.write(
                f"\rLoading safetensors checkpoint shards: {100 * i // shards:3d}% Completed "
                f"| {i}/{shards} [00:0{i}<00:00,  1.05it/s]"
            )
            sys.stderr.flush()
            if i < shards:
                cfg.sleep("load_shard")
        if shards:
            sys.stderr.write("\n")
        self._hold(own_weights)
        self.timings["load_weight"] += time.monotonic() - start
        self.log(
            cfg.profile.load_weight_end(
                time.monotonic() - start, self.avail_gb(), own_weights / GIB
            )
        )

        self.log("Using KV cache dtype: torch.bfloat16")
        kv_mib = int(self.total_mib * cfg.mem_fraction_static) - weights_mib - self.helper_mib
        if faults.has("not_enough_memory") or kv_mib <= 0 or self.avail_gb() * GIB < kv_mib:
            raise_not_enough_memory(cfg.mem_fraction_static)
        kv_start = time.monotonic()
        cfg.sleep("kv_alloc")
        self.timings["kv_cache_allocation"] = time.monotonic() - kv_start
        self.max_total_tokens = max(1024, kv_mib * 16)
        kv_gb = kv_mib / GIB / 2
        self.log(
            f"KV Cache is allocated. #tokens: {self.max_total_tokens}, "
            f"K size: {kv_gb:.2f} GB, V size: {kv_gb:.2f} GB"
        )
        self._hold(own_weights + kv_mib)
        self.log(f"Memory pool end. avail mem={self.avail_gb():.2f} GB")

        if cfg.deepgemm_cache is not None and not cfg.cuda_graph:  # else at the capture
            self._deepgemm_jit(cfg.deepgemm_cache)
        if cfg.cuda_graph:
            self._capture("target", faults.has("capture"))
        if cfg.spec is not None:
            self.log(f"Load weight begin. avail mem={self.avail_gb():.2f} GB")
            draft_start = time.monotonic()
            cfg.sleep("draft_load")
            self.timings["load_weight"] += time.monotonic() - draft_start
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
        graphs = dict.fromkeys(GRAPH_KEYS, 0.0) | self.graph_times
        return {
            "startup_time": {
                **self.timings,
                "scheduler_e2e": time.monotonic() - began,
                "cuda_graph": graphs,
            },
            "status": "ready",
            "max_total_num_tokens": self.max_total_tokens,
            "max_req_input_len": cfg.context_length - 8,
        }

    def _from_weight_cache(self) -> dict[str, Any] | None:
        """The weight cache daemon's answer for this rank (None: no daemon, a disk load)."""
        assert self.cfg.weight_cache is not None
        spec = fakegpu.read_spec(self.fake_root) if self.fake_root else fakegpu.FakeGpuSpec()
        sock, _ = weightcache.paths(spec.uuid(self.gpu), os.environ)
        began = time.monotonic()
        reply = weightcache.fetch(sock, {**self.cfg.weight_cache, "tp_rank": self.rank})
        if reply is not None:
            took = time.monotonic() - began
            self.log(
                f"[IpcModelLoader] Fetched 291 tensors from daemon (transport=torch_ipc) in "
                f"{took:.2f}s"
            )
            self.log(f"[IpcModelLoader] Loaded model via IPC (mode=client), total={took:.2f}s")
        return reply

    def _deepgemm_jit(self, folder: str) -> None:
        """DeepGEMM's kernels for this model: compiled (a long sleep) into its JIT cache the
        first time, read from it at once after; as 0.5.23 says it, on the first rank only."""
        kernels = Path(folder) / "standin" / (self.cfg.model_path.replace("/", "--") + ".kernels")
        if kernels.exists():
            return
        if self.rank == 0:
            self.log(
                "Entering DeepGEMM JIT Pre-Compile session. It may take a long time (typically "
                "10-20 mins) if you have not run `sglang.compile_deep_gemm`."
            )
            self.log(
                "Try DeepGEMM JIT Compiling for <GEMM_NT_F8F8BF16> N=7168, K=2048, "
                "num_groups=1 with all Ms."
            )
        self.cfg.sleep("deepgemm_jit")
        kernels.parent.mkdir(parents=True, exist_ok=True)
        part = kernels.with_name(f"{kernels.name}.{os.getpid()}")
        part.write_bytes(b"\0" * 65536)  # what a few compiled kernels weigh, give or take
        os.replace(part, kernels)

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
        if what == "target" and cfg.deepgemm_cache is not None:  # its first use
            self._deepgemm_jit(cfg.deepgemm_cache)
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
        key = ("target_verify" if spec else "decode") if what == "target" else "draft_decode"
        self.graph_times[key] = elapsed
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
