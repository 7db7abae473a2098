"""SGLang's failure output: the exceptions a scheduler raises and how it reports them.

Each ``raise_*`` produces the message (and for torch's errors the exception's module and class
name) that SGLang prints for a CUDA out-of-memory, an NCCL init error, too little memory for
the KV cache or a failed CUDA graph capture; `report_scheduler_exception` is the scheduler's
``except``: the traceback in SGLang's words, then SIGQUIT to the main process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import traceback

from .logline import log_line

GIB = 1024.0  # MiB per GiB


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
