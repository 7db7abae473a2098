"""The stand-in's ServerArgs: validation after argparse, and the ``server_args=`` line.

`resolve` checks what SGLang checks after parsing (the log level, the speculative algorithm and
its parameters), failing with a traceback and exit 1 as SGLang does, and builds the
`ChildConfig` the children run on; `server_args_repr` is the ``ServerArgs(...)`` repr SGLang
logs, without the stand-in's own ``--standin-*`` options.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from . import fakegpu, weightcache
from .childconfig import ChildConfig
from .durations import DURATIONS
from .faults import faults_from_args
from .logline import log
from .specmodel import resolve_spec_params
from .versions import SPEC_ALGORITHMS_0_5_23, Profile


def server_args_repr(args: Any) -> str:
    fields = {k: v for k, v in vars(args).items() if not k.startswith("standin_")}
    return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def resolve(args: Any, profile: Profile) -> ChildConfig:
    """Semantic validation after argparse: failures are tracebacks with exit 1, as in SGLang."""
    getattr(logging, args.log_level.upper())  # a bad --log-level is an AttributeError
    algorithm = args.speculative_algorithm
    if (
        profile.version == "0.5.23"
        and algorithm is not None
        and algorithm.upper() not in SPEC_ALGORITHMS_0_5_23
    ):
        raise ValueError(f"Unknown speculative algorithm name: {algorithm}")
    warn: list[str] = []
    spec = resolve_spec_params(
        algorithm,
        args.speculative_num_steps,
        args.speculative_eagle_topk,
        args.speculative_num_draft_tokens,
        warn,
    )
    if spec is not None:
        args.speculative_num_steps = spec.steps
        args.speculative_eagle_topk = spec.topk
        args.speculative_num_draft_tokens = spec.draft_tokens
    for message in warn:
        log(message)
    max_running = getattr(args, "max_running_requests", None)
    if max_running is None:
        max_running = 48 if spec is not None else 1024
    environ = os.environ
    return ChildConfig(
        version=profile.version,
        tp_size=args.tp_size,
        time_scale=args.standin_time_scale,
        seed=args.standin_seed,
        decode_log_interval=args.decode_log_interval,
        spec=spec,
        cuda_graph=not args.disable_cuda_graph,
        mem_fraction_static=args.mem_fraction_static or 0.85,
        max_running_requests=max_running,
        context_length=getattr(args, "context_length", None) or 32768,
        model_path=args.model_path,
        faults=faults_from_args(args),
        fake_gpu_dir=environ.get(fakegpu.ENV_DIR),
        cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        durations=dict(DURATIONS),
        deepgemm_cache=deepgemm_cache(environ) if args.standin_deepgemm else None,
        load_shards=args.standin_load_shards,
        weight_cache=(
            weightcache.fingerprint(args, 0)
            if getattr(args, "weight_cache_mode", "off") == "client"
            else None
        ),
    )


def deepgemm_cache(environ: Mapping[str, str]) -> str:
    """Where 0.5.23 keeps DeepGEMM's JIT kernels: SGLANG_DG_CACHE_DIR, else under
    SGLANG_CACHE_DIR, else ~/.cache/sglang (`sglang.srt.environ`)."""
    if environ.get("SGLANG_DG_CACHE_DIR"):
        return environ["SGLANG_DG_CACHE_DIR"]
    base = environ.get("SGLANG_CACHE_DIR") or "~/.cache/sglang"
    return os.path.join(os.path.expanduser(base), "deep_gemm")
