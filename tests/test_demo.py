"""`gpuwarden demo` as a real process: where it listens, what it prints, where its server runs."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import yaml

from .support.daemon import Daemon, gpuwarden
from .support.procs import Proc


def test_demo_honours_gpuwarden_listen_prints_the_bound_address_and_a_free_server_port(
    procs: list[Proc], tmp_path: Path
) -> None:
    root = tmp_path / "demo"
    env = {"GPUWARDEN_LISTEN": "127.0.0.1:0"}
    # No fake GPU folder of the test's: the demo makes its own.
    proc = gpuwarden(procs, "demo", "--dir", str(root), fake_gpu=None, env=env)
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
