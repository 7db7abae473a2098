"""SGLang 0.5.23's weight cache daemon as a config's sidecar: what runs it and what names it.

A config with `weight_cache: true` runs its engine with `--weight-cache-mode client` and gets
`python -m sglang.srt.weight_cache.daemon` beside it (the stand-in's
`gpuwarden.standin.weightcache` for the stand-in), launched with the engine's flags that decide
what the daemon loads and where: model, revision, dtype, quantization, load format, the
parallel layout and the GPUs. Those flags, the GPUs the config sees, the interpreter and the
weight cache's own variables are its fingerprint: two configs with the same one share a
sidecar (a swap between them keeps it, and its GPU memory); SGLang's own fingerprint (which
adds the GPU's compute capability and torch's version) is checked by the engine itself.

Pure: the host's `sidecar.py` runs it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwarden.standin.argspec import split_command

if TYPE_CHECKING:
    from .resolvedconfig import ResolvedConfig

SGLANG_MODULE = "sglang.srt.weight_cache.daemon"
STANDIN_MODULE = "gpuwarden.standin.weightcache"
# The engine's options that decide what the daemon loads, and where (0.5.23's `CacheConfig`
# and the daemon's placement of ranks on GPUs).
VALUED = (
    "--model-path",
    "--revision",
    "--dtype",
    "--quantization",
    "--load-format",
    "--model-loader-extra-config",
    "--tp-size",
    "--pp-size",
    "--dp-size",
    "--ep-size",
    "--attn-cp-size",
    "--moe-a2a-backend",
    "--moe-dense-tp-size",
    "--base-gpu-id",
    "--gpu-id-step",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--device",
    "--weight-cache-timeout",
)
FLAGS = ("--trust-remote-code", "--enable-dp-lm-head")
# The environment that places it: the GPUs it sees, and where its sockets are.
ENV = (
    "CUDA_VISIBLE_DEVICES",
    "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE",
    "SGLANG_WEIGHT_CACHE_READY_TEMPLATE",
)
SOCKET_TEMPLATE = "/tmp/sglang_weight_cache_{device_uuid}.sock"
READY_TEMPLATE = "/tmp/sglang_weight_cache_{device_uuid}.ready"


@dataclass(frozen=True)
class SidecarSpec:
    """How to run a config's weight cache daemon, and its fingerprint."""

    fingerprint: str
    argv: tuple[str, ...]
    config: str  # the config it was first started for

    def view(self) -> dict[str, object]:
        return {"fingerprint": self.fingerprint, "argv": list(self.argv), "config": self.config}


def _model_args(cfg: ResolvedConfig) -> list[str]:
    cli = split_command(cfg.argv)
    args: list[str] = []
    for option in VALUED:
        value = cfg.model_path if option == "--model-path" else cfg.server_option(option)
        if value is not None:
            args += [option, value]
    args += [flag for flag in FLAGS if flag in cli.args]
    if cli.module == "gpuwarden.standin":  # its own flags (time scale, shards, memory) too
        for i, arg in enumerate(cli.args):
            if arg.startswith("--standin-"):
                after = cli.args[i + 1 : i + 2]
                args += [arg, *(v for v in after if not v.startswith("--"))]
    return args


def spec_of(
    cfg: ResolvedConfig, interpreter: str | None, env: Mapping[str, str]
) -> SidecarSpec | None:
    """The sidecar of `cfg`, whose server runs with `env` under `interpreter` (None: it asks
    for none, or its server's Python is not known)."""
    if not cfg.config.weight_cache:
        return None
    cli = split_command(cfg.argv)
    module = STANDIN_MODULE if cli.module == "gpuwarden.standin" else SGLANG_MODULE
    if interpreter is None:
        return None
    args = _model_args(cfg)
    placed = {k: env.get(k) for k in ENV}
    identity = {
        "python": interpreter,
        "module": module,
        "args": args,
        "env": placed,
        "gpus": cfg.config.gpus,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    return SidecarSpec(digest, (interpreter, "-m", module, *args), cfg.name)


def socket_paths(uuid: str, env: Mapping[str, str]) -> tuple[str, str]:
    """The socket and ready file SGLang's daemon keeps for the GPU `uuid` (NVML's, `GPU-...`;
    SGLang's device UUID drops the prefix)."""
    device = uuid.removeprefix("GPU-")
    sock = env.get("SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE") or SOCKET_TEMPLATE
    ready = env.get("SGLANG_WEIGHT_CACHE_READY_TEMPLATE") or READY_TEMPLATE
    return sock.replace("{device_uuid}", device), ready.replace("{device_uuid}", device)
