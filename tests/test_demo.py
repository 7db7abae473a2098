"""`gpuwarden demo` as a real process: where it listens, what it prints, where its server runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import yaml

from gpuwarden.standin import fakegpu

from .conftest import PY, Proc
from .daemon_harness import Daemon


def test_demo_honours_gpuwarden_listen_prints_the_bound_address_and_a_free_server_port(
    procs: list[Proc], tmp_path: Path
) -> None:
    env = {**os.environ, "GPUWARDEN_LISTEN": "127.0.0.1:0", "PYTHONUNBUFFERED": "1"}
    env.pop(fakegpu.ENV_DIR, None)  # the demo makes its own
    root = tmp_path / "demo"
    proc = Proc([PY, "-m", "gpuwarden.api.cli", "demo", "--dir", str(root)], env=env)
    procs.append(proc)
    d = Daemon(proc, root)  # the api.listening record: the address really bound
    printed = proc.wait_for(r"the daemon listens on (http://\S+);", timeout=30).group(1)
    assert printed == d.url and not printed.endswith(":0")
    assert f"curl {d.url}/status" in proc.text()
    server_port = int(proc.wait_for(r"serving on 127\.0\.0\.1:(\d+)").group(1))
    baseline = yaml.safe_load((root / "configs" / "baseline.yaml").read_text())
    assert baseline["args"]["port"] == server_port
    assert re.search(rf"curl 127\.0\.0\.1:{server_port}/v1/models", proc.text())
    d.wait_state("ready", timeout=90)
    assert httpx.get(f"http://127.0.0.1:{server_port}/v1/models", timeout=10).status_code == 200
