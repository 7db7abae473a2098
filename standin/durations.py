"""How long each simulated phase of SGLang takes, in seconds at ``--standin-time-scale`` 1.0.

One table for the main process and, through `ChildConfig.durations`, the children: imports,
distributed init, weight shards, KV cache, graph capture, warmup, the drain and watchdog
periods, health-check and exit timeouts. Token pacing is not here: it is never time-scaled
(`specmodel.DecodeModel`).
"""

from __future__ import annotations

# Simulated durations in seconds at --standin-time-scale 1.0 (token pacing is never scaled).
DURATIONS: dict[str, float] = {
    "import": 3.0,  # main: torch, triton, transformers ...
    "child_import": 1.0,  # each spawned child re-imports sglang
    "dist_init": 0.5,
    "load_shard": 1.0,  # 4 shards
    "kv_alloc": 0.3,
    "capture_step": 0.25,  # 8 batch sizes
    "deepgemm_jit": 4.0,  # --standin-deepgemm on a cold cache (SGLang's: 10-20 minutes)
    "draft_load": 1.0,
    "warmup_sleep": 1.0,  # the warmup thread's sleep before its first poll
    "drain_step": 5.0,  # sigterm_watchdog's period
    "watchdog_grace": 5.0,  # the scheduler watchdog sleeps before SIGQUIT
    "health_timeout": 20.0,  # SGLANG_HEALTH_CHECK_TIMEOUT
    "scheduler_exit": 15.0,  # 0.5.23's _SCHEDULER_EXIT_TIMEOUT_SECS
    "subprocess_watchdog": 1.0,  # 0.5.12+'s SubprocessWatchdog period
    "crash_settle": 5.0,  # 0.5.23: "Sleeping 5 seconds before crash diagnostics"
}
