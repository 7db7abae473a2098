"""What a stand-in child is told: `ChildConfig`, built by the main process, pickled for spawn.

It carries the resolved server arguments a scheduler rank acts on (TP size, speculative
parameters, memory fraction, limits), the faults to produce, the fake GPU folder and the
simulated durations, scaled by ``--standin-time-scale`` through `ChildConfig.sleep`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .faults import Faults
from .specmodel import SpecParams
from .versions import PROFILES, Profile


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
    faults: Faults
    fake_gpu_dir: str | None = None
    cuda_visible_devices: str | None = None
    durations: dict[str, float] = field(default_factory=dict)
    # --standin-deepgemm: the JIT cache its kernels are compiled into (None: no DeepGEMM)
    deepgemm_cache: str | None = None
    load_shards: int = 4  # --standin-load-shards
    # --weight-cache-mode client: the fingerprint its weights must match (the rank's added)
    weight_cache: dict[str, Any] | None = None

    @property
    def profile(self) -> Profile:
        return PROFILES[self.version]

    def sleep(self, name: str) -> None:
        time.sleep(self.durations.get(name, 0.0) * self.time_scale)
