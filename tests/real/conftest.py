"""The real SGLang 0.5.23 on the CPU, under a real daemon: fixtures of `make test-real`.

The environment (tests/real/env.py) must have been built: `make test-real` builds it first.
Without it these tests skip, saying so; under CI (`CI` set) that skip is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Daemon, start_daemon
from tests.support.procs import Proc, free_port, owned_processes

from . import env as real_env

# (The JIT and compile caches are the daemon's: `compile_cache`, under each test's folder.)
RUNTIME_DIRS = {
    "HOME": "home",
    "XDG_CACHE_HOME": "xdg-cache",
    "HF_HOME": "hf",
}

# Loading takes 10-40 s here (imports, the engine, a warm-up round trip); more on a busy machine.
STARTUP_S = 300.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/real/" in str(item.fspath):
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session")
def sglang_env() -> Path:
    path = real_env.env_dir()
    if not real_env.is_complete(path):
        why = f"the real-SGLang environment is not built ({path}): run `make test-real`"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


def sglang_config(
    env: Path,
    port: int | None = None,
    *,
    serve: bool = False,
    args: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A config that runs the real SGLang on the tiny model, on the CPU, with a capped KV cache
    (SGLang would otherwise size it from free RAM: 14 GB and 35 s)."""
    command = (
        [str(env / "bin" / "sglang"), "serve"]
        if serve
        else [str(real_env.python_of(env)), "-m", "sglang.launch_server"]
    )
    cfg: dict[str, Any] = {
        "command": command,
        "args": {
            "model-path": str(real_env.model_of(env)),
            "device": "cpu",
            "host": "127.0.0.1",
            "port": port or free_port(),
            "max-total-tokens": 8192,
            "mem-fraction-static": 0.1,
            **(args or {}),
        },
        "env": {
            # The developer's own SGLang switches (a coredump wait, a forced shutdown) would
            # change what is tested: unset (null) here.
            **{k: None for k in os.environ if k.startswith(("SGLANG_", "SGL_"))},
            "SGLANG_USE_CPU_ENGINE": "1",  # without it SGLang takes GPU code paths
            "PYTHONPATH": str(real_env.STUBS),
            "HF_HUB_OFFLINE": "1",
            # What SGLang, torch and the hub cache at run time stays in the environment's cache.
            **{name: str(env / "runtime" / sub) for name, sub in RUNTIME_DIRS.items()},
            **(environ or {}),
        },
        "health": {"startup_timeout_s": STARTUP_S, "interval_s": 1, "timeout_s": 10},
    }
    for key, value in fields.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


DaemonFactory = Callable[..., Daemon]


@pytest.fixture
def real_daemon(procs: list[Proc], tmp_path: Path, sglang_env: Path) -> DaemonFactory:
    """A daemon with real SGLang configs: `real_daemon({"a": cfg}, default="a", **settings)`."""

    def start(
        configs: dict[str, dict[str, Any]], default: str | None = None, **settings: Any
    ) -> Daemon:
        settings.setdefault("gpu", {"backend": "none"})
        settings.setdefault("stop", {"grace_s": 30})
        return start_daemon(procs, tmp_path, tmp_path / "no-fake-gpu", configs, default, **settings)

    return start


@pytest.fixture(scope="module")
def module_procs() -> Iterator[list[Proc]]:
    """Children shared by the tests of a module (one running server for many scenarios)."""
    with owned_processes() as started:
        yield started
