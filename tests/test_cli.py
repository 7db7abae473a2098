"""The command line as operators run it: a subprocess against a live daemon."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from .conftest import PY, Proc, free_port
from .daemon_harness import Daemon, standin_config, start_daemon


def _env() -> dict[str, str]:
    # Only what each test passes says where the daemon is.
    return {k: v for k, v in os.environ.items() if k not in ("GPUWARDEN_URL", "GPUWARDEN_TOKEN")}


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "gpuwarden.api.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_env(),
    )


def guarded_daemon(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, default: str | None = None
) -> Daemon:
    (tmp_path / "token").write_text("tok-cli-123\n")
    return start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {"c": standin_config()},
        default=default,
        listen=f"127.0.0.1:{free_port()}",
        token_file="./token",
    )


def cli_into_closed_pipe(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run with stdout a pipe whose reader is already gone: the first write meets EPIPE, as
    in `gpuwarden dump | head` once head has read its lines."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [PY, "-m", "gpuwarden.api.cli", *map(str, args)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
            env=_env(),
        )
    finally:
        os.close(write_end)


def test_global_flags_work_before_or_after_the_subcommand(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = guarded_daemon(procs, tmp_path, fake_gpu)
    token, settings = tmp_path / "token", tmp_path / "settings.yaml"
    for argv in (
        ["--url", d.url, "--token-file", token, "--json", "configs"],
        ["configs", "--url", d.url, "--token-file", token, "--json"],
        ["--json", "configs", "--url", d.url, "--token-file", token],
        ["--url", d.url, "configs", "--token-file", token, "--json"],
        # Given on both sides, the one after the subcommand wins.
        ["--url", "http://127.0.0.1:9", "--token-file", token, "configs", "--url", d.url, "--json"],
        # The daemon's own settings name its address and token file.
        ["--settings", settings, "--json", "configs"],
        ["configs", "--settings", settings, "--json"],
    ):
        res = cli(*argv)
        assert res.returncode == 0, (argv, res.stderr)
        assert json.loads(res.stdout)["configs"] == ["c"], argv
    res = cli("--json", "events", "--url", d.url, "--token-file", token, "-n", "2")
    assert res.returncode == 0 and json.loads(res.stdout)["events"] == []  # nothing ran yet
    res = cli("--url", d.url, "configs")
    assert res.returncode == 1 and "unauthorized" in res.stderr
    res = cli("--settings", settings, "--json", "check", "c", "--offline")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["ok"] is True
    res = cli("--url", d.url, "configs", "--bogus")
    assert res.returncode == 2 and "unrecognized arguments: --bogus" in res.stderr


def test_a_reader_that_stops_reading_ends_every_printing_command_quietly(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = guarded_daemon(procs, tmp_path, fake_gpu, default="c")
    d.wait_state("ready")
    token, settings = tmp_path / "token", tmp_path / "settings.yaml"
    common = ["--url", d.url, "--token-file", token]
    for argv in (
        ["dump"],
        ["dump", "--json"],
        ["status"],
        ["status", "--json"],
        ["events"],
        ["configs"],
        ["logs", "-n", "50"],
        ["logs", "-f", "-n", "50"],
        ["check", "c"],
        ["check", "c", "--offline", "--settings", settings],
    ):
        res = cli_into_closed_pipe(*common, *argv)
        assert res.stderr == "", (argv, res.stderr)
        assert res.returncode == 141, argv  # 128 + SIGPIPE, as cat or git under `head`
    for argv in (["--help"], ["dump", "--help"]):
        # argparse itself ignores errors writing help: quiet, and its usual 0.
        res = cli_into_closed_pipe(*argv)
        assert (res.returncode, res.stderr) == (0, ""), argv
    assert cli("--url", d.url, "--token-file", token, "configs").returncode == 0


# The modules of the control plane and the supervisor: `gpuwarden status --url` needs none of
# them, and importing them took most of a second before the command could send its request.
SERVER_SIDE = ("fastapi", "uvicorn", "starlette", "pydantic", "pydantic_settings", "httpx")

STATUS_THEN_MODULES = """
import json, sys
from gpuwarden.api import cli
rc = cli.main(["status", "--url", sys.argv[1]])
print(json.dumps({"rc": rc, "modules": sorted(sys.modules)}))
"""


def test_status_imports_neither_the_control_plane_nor_the_daemon_core() -> None:
    res = subprocess.run(
        [PY, "-c", STATUS_THEN_MODULES, f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_env(),
    )
    assert "cannot reach the daemon" in res.stderr, res.stderr
    out = json.loads(res.stdout)
    assert out["rc"] == 1
    loaded = [m for m in out["modules"] if m.split(".")[0] in SERVER_SIDE]
    assert loaded == [], loaded
    daemon = [m for m in out["modules"] if m.startswith("gpuwarden.daemon")]
    assert daemon == [], daemon
