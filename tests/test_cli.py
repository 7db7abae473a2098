"""The command line as operators run it: a subprocess against a live daemon."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from .support.configs import standin_config
from .support.daemon import Daemon, start_daemon
from .support.procs import PY, Proc, free_port, require_tool, wait_until


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
    kinds = [e["event"] for e in json.loads(res.stdout)["events"]]
    assert res.returncode == 0 and kinds == ["shim_connected"]  # nothing ran yet
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
# Nor rich: the CLI's tables and progress lines are its own few lines of standard library.
SERVER_SIDE = (
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic",
    "pydantic_settings",
    "httpx",
    "rich",
)

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


PARSER_THEN_MODULES = """
import json, sys
from gpuwarden.api import cli
cli.build_parser().parse_args(["serve"])
print(json.dumps(sorted(sys.modules)))
"""


def test_building_the_parser_imports_no_http_client() -> None:
    """What `serve` holds for the daemon's life: the CLI's parser, not its HTTP client."""
    res = subprocess.run(
        [PY, "-c", PARSER_THEN_MODULES], capture_output=True, text=True, timeout=60, check=True
    )
    modules = json.loads(res.stdout)
    client = [m for m in modules if m in ("gpuwarden.api.client", "gpuwarden.api.transport")]
    assert client == [] and "http.client" not in modules, client


def cli_on_tty(*args: str | Path, which: str = "stdout") -> tuple[int, str, str]:
    """Run with `which` (stdout or stderr) a terminal (a pty), the other a pipe: what the
    command writes for a person at a terminal. Returns (rc, tty text, pipe text)."""
    master, slave = pty.openpty()
    kw: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    kw[which] = slave
    env = {k: v for k, v in _env().items() if k != "NO_COLOR"}
    env["TERM"] = "xterm"
    proc = subprocess.Popen(
        [PY, "-m", "gpuwarden.api.cli", *map(str, args)], stdin=subprocess.DEVNULL, env=env, **kw
    )
    os.close(slave)
    other = proc.stderr if which == "stdout" else proc.stdout
    assert other is not None
    pipe_text: list[bytes] = []
    reader = threading.Thread(target=lambda: pipe_text.append(other.read()), daemon=True)
    reader.start()
    chunks = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1)
        if not ready:
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    rc = proc.wait(30)
    reader.join(30)
    return rc, b"".join(chunks).decode(errors="replace"), b"".join(pipe_text).decode()


def swap_daemon(procs: list[Proc], tmp_path: Path, fake_gpu: Path, probation_s: float) -> Daemon:
    """good (serving) and flaky (ready, then a scheduler crash 1 s later), on one port."""
    port = free_port()
    configs = {
        "good": standin_config(port=port),
        "flaky": standin_config("--standin-crash-after=1.0", port=port),
        "slow": standin_config(port=port, scale=0.3),
    }
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        configs,
        default="good",
        restart={"probation_s": probation_s, "initial_delay_s": 30},
    )
    d.wait_state("ready")
    return d


def test_restart_wait_reports_a_rollback_inside_probation_as_a_failure(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Before: `restart --wait` answered `ready`, exit 0, for a config that crashed and was
    rolled back a second later, inside its probation."""
    d = swap_daemon(procs, tmp_path, fake_gpu, probation_s=5)
    mark = d.mark()
    res = cli("restart", "flaky", "--wait", "--url", d.url)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stdout.startswith("rolled_back: "), res.stdout
    assert "illegal memory access" in res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuwarden: restart ended rolled_back: crash"), res.stderr
    # Progress while it waited, a plain line per change on a stderr that is not a terminal.
    assert "ready · on probation" in res.stderr and "\r" not in res.stderr, res.stderr
    rollback = d.wait_event("server.rollback", after=mark)
    assert rollback["from_config"] == "flaky"
    st = d.status()
    assert (st["state"], st["config"], st["last_good_config"]) == ("ready", "good", "good")

    # Over HTTP, the same; probation=false answers at ready, as before.
    body = d.http.post("/restart", params={"config": "flaky", "wait": "true"}).json()
    assert (body["outcome"], body["reason"], body["state"]) == ("rolled_back", "crash", "ready")
    assert len(body["launch_ids"]) == 2  # flaky's launch and the rollback's
    mark = d.mark()
    res = cli("restart", "flaky", "--wait", "--no-probation", "--url", d.url)
    assert res.returncode == 0 and res.stdout.startswith("ready: flaky is ready"), res.stderr
    d.wait_state("ready", after=d.wait_event("server.rollback", after=mark)["_index"])


def test_restart_wait_through_a_probation_that_passes_is_ready(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = swap_daemon(procs, tmp_path, fake_gpu, probation_s=1)
    res = cli("restart", "slow", "--wait", "--url", d.url, "--json")
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert body["outcome"] == "ready" and "survived its probation" in body["evidence"]
    assert res.stderr == ""  # --json: no progress
    assert d.status()["last_good_config"] == "slow"  # it answered after probation passed
    # On a terminal the progress is one line rewritten in place, with the loading phase.
    rc, tty, out = cli_on_tty("restart", "good", "--wait", "--url", d.url, which="stderr")
    assert rc == 0 and out.startswith("ready: good is ready and survived its probation"), out
    assert "\r\x1b[K[" in tty and "· ready · on probation" in tty, tty
    assert tty.endswith("\r\x1b[K")  # the line is cleared before the outcome is printed
    rc, tty, _ = cli_on_tty("restart", "slow", "--wait", "--url", d.url, which="stderr")
    assert rc == 0 and "starting · loading weights" in tty, tty


def test_restart_wait_of_the_current_config_waits_through_its_probation(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Before: a restart of the current config was answered at ready (`ready: ... survived
    its probation after 0s`, exit 0) for a server that crashed 0.3 s later."""
    port = free_port()
    configs = {
        "crashy": standin_config("--standin-crash-after=0.3", port=port),
        "good": standin_config(port=port),
    }
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        configs,
        default="crashy",
        restart={"probation_s": 5, "initial_delay_s": 30},
    )
    d.wait_state("backoff", reason="crash")  # its first crash; the retry is 30 s away
    mark = d.mark()
    res = cli("restart", "--wait", "--url", d.url)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stdout.startswith("failed: crashy crashed during its probation (5 s after ready)")
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("gpuwarden: restart ended failed: crash (crashy crashed during its")
    # No rollback for a restart of the same config: the crash follows the restart policy.
    d.wait_state("backoff", after=mark, reason="crash")
    assert not [line for _, line in d.proc.lines[mark:] if '"server.rollback"' in line]

    # A config that stays up is answered once the probation is over, saying so.
    d.http.post("/restart", params={"config": "good", "wait": "true", "probation": "false"})
    res = cli("restart", "--wait", "--url", d.url, "--json")
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert body["evidence"] == "good is ready and survived its probation (5 s)", body
    assert body["elapsed_s"] >= 5  # the probation itself was waited for


def test_stop_waits_for_stopped_so_stop_then_start_works(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Before: `gpuwarden stop` returned at once, and the `start` after it met 409 (the server
    was still stopping)."""
    cfg = standin_config("--standin-ignore-sigterm")  # stopped by the SIGKILL after grace_s
    d = start_daemon(procs, tmp_path, fake_gpu, {"slow": cfg}, default="slow", stop={"grace_s": 3})
    d.wait_state("ready")
    gw = " ".join(shlex.quote(a) for a in (PY, "-m", "gpuwarden.api.cli"))
    mark = d.mark()
    res = subprocess.run(
        ["bash", "-c", f"{gw} stop --url {d.url} && {gw} start --url {d.url}"],
        capture_output=True, text=True, timeout=60, check=False, env=_env(),
    )  # fmt: skip
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert res.stdout.splitlines() == ["stopped", "starting slow (waiting_gpu)"], res.stdout
    d.wait_state("ready", after=mark)

    # --no-wait answers at once, while the server is still stopping.
    mark = d.mark()
    res = cli("stop", "--no-wait", "--url", d.url)
    assert (res.returncode, res.stdout) == (0, "stopping (stopping)\n"), res.stderr
    d.wait_state("stopped", after=mark)
    mark = d.mark()
    assert cli("start", "--url", d.url).returncode == 0
    d.wait_state("ready", after=mark)

    # A bounded wait says what happened, and fails.
    mark = d.mark()
    res = cli("stop", "--timeout", "0.5", "--url", d.url)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stderr.startswith("gpuwarden: the server is still stopping after "), res.stderr
    assert "the stop goes on in the daemon" in res.stderr
    d.wait_state("stopped", after=mark)


def test_status_exits_3_unless_ready_with_human_durations(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """Before: `gpuwarden status` exited 0 while `failed`; systemctl status exits 3."""
    port = free_port()
    configs = {
        "good": standin_config(port=port),
        "oom": standin_config("--standin-crash-on-load=cuda_oom", port=port),
        "bad": standin_config("--speculative-eagle-top-k=4", port=port),
    }
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        configs,
        default="good",
        restart={"initial_delay_s": 30, "max_delay_s": 60},
    )
    d.wait_state("ready")
    res = cli("status", "--url", d.url)
    assert res.returncode == 0, res.stderr
    assert re.search(r"^state\s+ready  up \d+s$", res.stdout, re.M), res.stdout
    assert "\x1b[" not in res.stdout  # not a terminal: plain text
    assert cli("status", "--url", d.url, "--json").returncode == 0
    rc, tty, _ = cli_on_tty("status", "--url", d.url)
    assert rc == 0 and "\x1b[32mready\x1b[0m" in tty, tty

    mark = d.mark()
    assert d.http.post("/stop").status_code == 202
    d.wait_state("stopped", after=mark)
    assert cli("status", "--url", d.url).returncode == 3
    assert cli("status", "--url", d.url, "--json").returncode == 3

    mark = d.mark()
    assert d.http.post("/start", params={"config": "oom"}).status_code == 202
    d.wait_state("backoff", after=mark)  # a start's failure follows the restart policy
    res = cli("status", "--url", d.url)
    assert res.returncode == 3, res.stdout
    assert re.search(r"next retry in (29|30)s", res.stdout), res.stdout
    assert re.search(r"cuda_oom: .*CUDA out of memory.*\(\d+s ago\)", res.stdout), res.stdout

    mark = d.mark()
    assert d.http.post("/stop").status_code == 202
    d.wait_state("stopped", after=mark)
    d.http.post("/start", params={"config": "bad"})
    d.wait_state("failed", after=mark)
    res = cli("status", "--url", d.url)
    assert res.returncode == 3 and re.search(r"^state\s+failed$", res.stdout, re.M), res.stdout
    rc, tty, _ = cli_on_tty("status", "--url", d.url)
    assert rc == 3 and "\x1b[31mfailed\x1b[0m" in tty, tty


def test_sweep_shows_progress_then_the_table(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"c": standin_config()}, default="c")
    d.wait_state("ready")
    argv = ["sweep", "c", "--requests", "1", "--warmup", "0", "--max-tokens", "8", "--url", d.url]
    res = cli(*argv)
    assert res.returncode == 0, res.stderr
    assert re.search(r"^c +\(baseline\) .* ok$", res.stdout, re.M), res.stdout
    assert "files: " in res.stdout, res.stdout
    assert re.search(r"^\[\d+s\] sweep-\S+: [01]/1 · (c|finishing)$", res.stderr, re.M), res.stderr


def test_events_follow_prints_each_new_event_until_ctrl_c(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    d = guarded_daemon(procs, tmp_path, fake_gpu, default="c")
    d.wait_state("ready")
    token = tmp_path / "token"
    follower = Proc(
        [PY, "-m", "gpuwarden.api.cli", "events", "-f", "-n", "3", "--url", d.url,
         "--token-file", str(token)],
        env=_env(),
    )  # fmt: skip
    procs.append(follower)
    follower.wait_for(r"^time\s+event\s+config", timeout=30)  # the last 3, then the follow
    seen = d.http.get(
        "/events", params={"limit": 1}, headers={"Authorization": "Bearer tok-cli-123"}
    )
    last_seq = seen.json()["events"][-1]["seq"]
    res = cli("restart", "--url", d.url, "--token-file", token)
    assert res.returncode == 0, res.stderr
    swap_id = res.stdout.split()[1]
    follower.wait_for(rf"\brestart\s+c\s+swap_id={swap_id}\b", timeout=30)
    follower.wait_for(r"\bstate\b.*\bto=ready\b|\bready\b", timeout=30)
    follower.signal(signal.SIGINT)
    assert follower.wait(10) == 0
    assert follower.text("stderr") == ""
    # Each event once: the cursor is the seq; the events printed are the ones that followed.
    restarts = [ln for _, ln in follower.lines if f"swap_id={swap_id}" in ln and " restart " in ln]
    assert len(restarts) == 1, follower.text()
    after = d.http.get(
        "/events", params={"after": last_seq, "limit": 1},
        headers={"Authorization": "Bearer tok-cli-123"},
    ).json()["events"]  # fmt: skip
    assert after and after[0]["seq"] == last_seq + 1


def test_version_is_the_package_version() -> None:
    res = cli("--version")
    assert (res.returncode, res.stdout) == (0, f"gpuwarden {version('gpuwarden')}\n")


COMPLETE = """
source <({py} -m gpuwarden.api.cli completion bash)
COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1))
_gpuwarden
printf '%s\\n' "${{COMPREPLY[@]}}"
"""


def test_bash_completion_is_made_from_the_parser(tmp_path: Path) -> None:
    bash = require_tool("bash")

    def complete(words: str) -> list[str]:
        res = subprocess.run(
            [bash, "--norc", "-c", COMPLETE.format(py=PY, words=words)],
            capture_output=True, text=True, timeout=60, check=False, env=_env(),
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    assert complete("gpuwarden res") == ["restart"]
    assert complete("gpuwarden --url http://x st") == ["status", "start", "stop"]
    assert complete("gpuwarden restart --no") == ["--no-probation"]
    assert complete("gpuwarden events --f") == ["--follow"]
    assert complete("gpuwarden completion ''") == ["bash", "zsh", "-h", "--help"]
    assert complete("gpuwarden --v") == ["--version"]
    (tmp_path / "settings.yaml").touch()
    assert complete(f"gpuwarden status --settings {tmp_path}/sett") == [f"{tmp_path}/settings.yaml"]
    zsh = cli("completion", "zsh")
    assert zsh.returncode == 0 and "bashcompinit" in zsh.stdout and "complete -F" in zsh.stdout


def test_logs_and_dump_print_the_servers_control_characters_escaped(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    """A server line with escape sequences (a window title, clear screen, colour, a C1 CSI)
    prints as text that cannot act on a terminal; the tab stays a tab."""
    d = start_daemon(
        procs, tmp_path, fake_gpu, {"e": standin_config("--standin-escape-sequences")}, default="e"
    )
    d.wait_state("ready")
    log_file = Path(d.status()["log_file"])
    wait_until(lambda: b"hostile:" in log_file.read_bytes(), 30, "the escape line")
    assert b"\x1b]0;pwned\x07" in log_file.read_bytes()  # the file keeps what the server wrote
    shown = r"hostile: \x1b]0;pwned\x07\x1b[2J\x1b[31mred\x1b[0m \x9b1m end"
    for args in (("logs", "-n", "500"), ("dump",)):
        res = cli(*args, "--url", d.url)
        assert res.returncode == 0, res.stderr
        assert shown in res.stdout, args
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", res.stdout), args
    res = cli("dump", "--json", "--url", d.url)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", res.stdout)
    assert any("\x1b]0;pwned\x07" in t for t in json.loads(res.stdout)["log_tail"])
