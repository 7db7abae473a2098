"""``gpuwarden demo``: a daemon on the bundled SGLang stand-in and a fake 8-GPU host.

Writes settings, a fake GPU folder and two server configs (``baseline`` and ``eagle3``) into a
folder (a temporary one unless ``--dir``), then runs there in the foreground. The stand-in
serves on a port picked free at start (SGLang's 30000 may be taken on a shared host); the
banner, printed once the control plane listens, names the bound addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from gpuwarden.standin import fakegpu

DEMO_TIME_SCALE = 0.05  # the stand-in loads in about a second instead of twenty


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick), for the stand-in."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def demo_configs(
    root: Path, server_port: int, python: str = sys.executable
) -> dict[str, dict[str, Any]]:
    """The demo's named server configs: the seed's baseline and its best EAGLE-3 setting."""
    baseline = {
        "command": [python, "-m", "gpuwarden.standin"],
        "args": {
            "model-path": str(root / "models" / "Kimi-K2.5"),
            "tp-size": 8,
            "port": server_port,
            "standin-time-scale": DEMO_TIME_SCALE,
        },
        "env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
        "health": {"startup_timeout_s": 120, "interval_s": 2},
    }
    eagle3 = {
        "extends": "baseline",
        "args": {
            "speculative-algorithm": "EAGLE3",
            "speculative-draft-model-path": str(root / "models" / "eagle3-drafter"),
            "speculative-num-steps": 3,
            "speculative-eagle-topk": 4,
            "speculative-num-draft-tokens": 5,
        },
    }
    # The seed's EAGLE-3 experiments, for `gpuwarden sweep`.
    cg16 = {"extends": "eagle3", "args": {"speculative-num-draft-tokens": 16}}
    nocg16 = {"extends": "eagle3_cg_16", "args": {"disable-cuda-graph": True}}
    return {
        "baseline": baseline,
        "eagle3": eagle3,
        "eagle3_cg_16": cg16,
        "eagle3_nocg_16": nocg16,
    }


def write_demo_dir(root: Path, listen: str, server_port: int) -> Path:
    """Lay out settings.yaml, configs/, and the fake GPU under `root`; return the settings path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "configs").mkdir(exist_ok=True)
    for model in ("Kimi-K2.5", "eagle3-drafter"):  # the stand-in loads nothing from them
        (root / "models" / model).mkdir(parents=True, exist_ok=True)
    for name, cfg in demo_configs(root, server_port).items():
        (root / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    if not (root / "fakegpu" / "gpus.json").exists():
        fakegpu.init_dir(root / "fakegpu", count=8)
    settings = {
        "listen": listen,
        "configs_dir": "./configs",
        "default_config": "baseline",
        "state_dir": "./state",
        "log_dir": "./logs",
        "restart": {"initial_delay_s": 2, "max_delay_s": 30},
        "stop": {"grace_s": 10},
        "gpu": {"backend": "fake", "release_timeout_s": 30},
    }
    path = root / "settings.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


def banner(root: Path, host: str, port: int, server_port: int) -> str:
    # A wildcard address is not one to send requests to: curl the loopback instead.
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    return f"""gpuwarden demo in {root}
  the daemon listens on {url}; it runs the SGLang stand-in (config 'baseline', tp 8)
  on a fake 8-GPU host, serving on 127.0.0.1:{server_port} (a free port; see configs/).

  try:
    curl {url}/status
    curl -X POST '{url}/restart?config=eagle3'     # swap to EAGLE-3
    gpuwarden status --url {url}
    curl -X POST {url}/chat -H 'Content-Type: application/json' -d '{{"text":"server crashed"}}'
    gpuwarden fake-gpu hold --gpu 3 --mib 40000 --dir {root / "fakegpu"}   # a foreign holder
    curl 127.0.0.1:{server_port}/v1/models
    gpuwarden sweep baseline eagle3 eagle3_cg_16 eagle3_nocg_16 --url {url}   # table + chart

  Ctrl-C stops the daemon and the server.
"""


def run(args: argparse.Namespace) -> int:
    from gpuwarden.daemon import logsetup  # noqa: PLC0415
    from gpuwarden.daemon.settings import SettingsError, load_settings  # noqa: PLC0415

    from .serve import serve  # noqa: PLC0415

    root = (args.dir or Path(tempfile.mkdtemp(prefix="gpuwarden-demo-"))).resolve()
    server_port = free_port()
    settings_path = write_demo_dir(root, args.listen, server_port)
    os.environ[fakegpu.ENV_DIR] = str(root / "fakegpu")
    logsetup.configure()
    try:
        # The flag (or $GPUWARDEN_LISTEN, its default) names the address.
        settings = load_settings(settings_path, listen=args.listen)
    except SettingsError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return 1

    def announce(host: str, port: int) -> None:
        print(banner(root, host, port, server_port), flush=True)

    return asyncio.run(serve(settings, on_listening=announce))
