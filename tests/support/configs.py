"""What tests write for a daemon to read: stand-in server configs, the settings of a daemon run
as a process (`write_setup`) or in-process (`make_settings`), and a YAML alias bomb."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuwarden.daemon.settings import Settings

from .procs import PY, free_port

FAST_RESTART = {
    "initial_delay_s": 0.05,
    "max_delay_s": 0.2,
    "multiplier": 2,
    "jitter": 0.0,
    "reset_after_s": 600,
    "crash_loop_after": 3,
}

# Nine levels of nine aliases each: 9**9 strings once expanded, from a few hundred bytes.
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def standin_config(
    *extra: str, scale: float = 0.01, port: int | None = None, **fields: Any
) -> dict[str, Any]:
    """A server config for the stand-in; `extra` flags like '--standin-crash-after=0.1'."""
    args: dict[str, Any] = {
        "model-path": "fake-org/fake-model",
        "port": port or free_port(),
        "standin-time-scale": scale,
    }
    for flag in extra:
        key, _, value = flag.lstrip("-").partition("=")
        args[key] = value if value else True
    cfg: dict[str, Any] = {
        "command": [PY, "-m", "gpuwarden.standin"],
        "args": args,
        "env": {"CUDA_VISIBLE_DEVICES": "0"},
        "health": {"startup_timeout_s": 30, "interval_s": 0.2, "timeout_s": 2, "failures": 3},
    }
    for key, value in fields.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def two_configs(**extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """'good' and 'other' (and each of `extra`) on one port, as the configs of a swap are."""
    port = free_port()
    configs = {"good": standin_config(port=port), "other": standin_config(port=port)}
    for name, cfg in extra.items():
        configs[name] = cfg
        cfg["args"]["port"] = port
    return configs


def write_configs(root: Path, configs: dict[str, dict[str, Any]]) -> None:
    (root / "configs").mkdir(parents=True, exist_ok=True)
    for name, cfg in configs.items():
        (root / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(cfg))


def write_setup(
    root: Path,
    configs: dict[str, dict[str, Any]],
    default: str | None = None,
    **settings: Any,
) -> Path:
    """`configs` and a settings.yaml (fast restarts, the fake GPUs, any port) under `root`;
    returns the settings file's path. `settings` are merged into it, a dict one level deep."""
    write_configs(root, configs)
    base: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "configs_dir": "./configs",
        "state_dir": "./state",
        "log_dir": "./logs",
        "default_config": default,
        "restart": dict(FAST_RESTART),
        "stop": {"grace_s": 5},
        "gpu": {"backend": "fake", "poll_interval_s": 0.02, "release_timeout_s": 5},
    }
    for key, value in settings.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    # A test that asks for a long first delay means it: the fast schedule's cap would cut it.
    base["restart"]["max_delay_s"] = max(
        base["restart"]["max_delay_s"], base["restart"]["initial_delay_s"]
    )
    path = root / "settings.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def make_settings(root: Path, **over: Any) -> Settings:
    """Settings for a supervisor run in-process, its folders under `root`; `over` is merged
    as `write_setup`'s settings are."""
    data: dict[str, Any] = {
        "configs_dir": str(root / "configs"),
        "state_dir": str(root / "state"),
        "log_dir": str(root / "logs"),
        "compile_cache": {"dir": str(root / "cache")},
        "restart": dict(FAST_RESTART),
        "stop": {"grace_s": 3},
        "gpu": {"backend": "fake", "poll_interval_s": 0.02, "release_timeout_s": 3},
    }
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    # A test that asks for a long first delay means it: the fast schedule's cap would cut it.
    data["restart"]["max_delay_s"] = max(
        data["restart"]["max_delay_s"], data["restart"]["initial_delay_s"]
    )
    return Settings(**data)
