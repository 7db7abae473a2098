"""Preflight runs only SGLang and the stand-in to learn their options, and leaves no process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from pathlib import Path

import pytest
import yaml

from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.preflight import Preflight, check_port
from gpuwarden.daemon.resolvedconfig import SGLANG_DEFAULT_PORT
from gpuwarden.daemon.serverparser import ServerParsers

from .support.daemon import start_daemon
from .support.procs import Proc, alive, wait_until

PY = sys.executable


async def test_a_cancelled_introspection_leaves_no_process(tmp_path: Path) -> None:
    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    code = f"import os, time; open({str(fifo)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    task = asyncio.create_task(ServerParsers()._run([PY, "-c", code], 60, dict(os.environ)))
    pid = int(await asyncio.wait_for(asyncio.to_thread(fifo.read_text), 30))
    assert alive(pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not alive(pid)


def test_preflight_never_runs_a_program_it_does_not_know(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    ran = tmp_path / "ran.txt"
    script = tmp_path / "server.py"
    script.write_text(
        "import sys, time\n"
        f"open({str(ran)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "time.sleep(60)\n"
    )
    cfg = {
        "command": [PY, str(script), "--mode", "serve"],
        "health": {"url": "http://127.0.0.1:9/health", "startup_timeout_s": 60},
    }
    d = start_daemon(procs, tmp_path, fake_gpu, {"script": cfg}, default=None)
    res = d.http.post("/configs/script/check")
    assert res.status_code == 200 and res.json()["ok"] is True
    assert any("neither SGLang nor the stand-in" in w for w in res.json()["warnings"])
    assert not ran.exists()  # not run with --help, nor at all
    assert d.http.post("/start", params={"config": "script"}).status_code == 202
    wait_until(ran.exists, 30, "the program's one run")
    d.wait_state("starting")
    assert ran.read_text() == "--mode serve\n"


async def test_a_program_it_does_not_know_is_not_held_to_sglangs_default_port(
    tmp_path: Path,
) -> None:
    """Another program listens where its own flags say: SGLang's busy default is no problem."""
    (tmp_path / "script.yaml").write_text(
        yaml.safe_dump({"command": [PY, "server.py"], "health": {"url": "http://127.0.0.1:9/h"}})
    )
    cfg = ConfigStore(tmp_path).load("script")
    with contextlib.ExitStack() as stack:
        holder = socket.socket()
        stack.enter_context(holder)
        with contextlib.suppress(OSError):  # already busy on this host is the same case
            holder.bind(("127.0.0.1", SGLANG_DEFAULT_PORT))
            holder.listen()
        assert check_port("127.0.0.1", SGLANG_DEFAULT_PORT, None) is not None
        result = await Preflight().check(cfg)
    assert result.ok, result.problems


def test_sglang_serve_forms_are_read_as_sglang_reads_them(tmp_path: Path) -> None:
    from gpuwarden.daemon.preflight import config_file_warnings, serve_args  # noqa: PLC0415
    from gpuwarden.daemon.serverparser import script_interpreter  # noqa: PLC0415

    serve = ["sglang", "serve"]
    assert serve_args(serve, ["org/model", "--tp", "2"]) == (
        ["--model-path", "org/model", "--tp", "2"],
        None,
    )
    assert serve_args(serve, ["--model-type", "llm", "--model-path", "m"]) == (
        ["--model-path", "m"],
        None,
    )
    _, why = serve_args(serve, ["m", "--model-type=diffusion"])
    assert why is not None and "--model-type diffusion" in why and "not checked" in why
    # The -m form has no positional model path: left to the parser, which refuses it.
    assert serve_args(["python", "-m", "sglang.launch_server"], ["m"]) == (["m"], None)
    assert "--config x.yaml" in config_file_warnings(["--config", "x.yaml"])[0]
    assert config_file_warnings(["--tp", "2"]) == []

    script = tmp_path / "bin" / "sglang"
    script.parent.mkdir()
    script.write_text("#!/opt/venv/bin/python3.11\nimport sys\n")
    script.chmod(0o755)
    assert script_interpreter("sglang", str(script.parent)) == "/opt/venv/bin/python3.11"
    script.write_text("#!/usr/bin/env python3\n")
    assert script_interpreter(str(script), None) == "python3"
    script.write_text("#!/bin/sh\nexec something\n")
    assert script_interpreter(str(script), None) is None
    assert script_interpreter(str(tmp_path / "missing"), None) is None


async def test_callers_share_one_build_which_ends_with_its_last_caller(tmp_path: Path) -> None:
    """Two preflights of one server wait for one parser build; the first cancelled leaves it
    running for the other, and the last cancelled kills it."""
    builds, started = tmp_path / "builds", tmp_path / "started"
    os.mkfifo(started)
    wrapper = tmp_path / "python3-slow"  # its parser build never ends
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "$2" in *_dump*) echo $$ >> {builds}; echo $$ > {started}; exec sleep 60;; esac\n'
        f'exec {PY} "$@"\n'
    )
    wrapper.chmod(0o755)
    (tmp_path / "configs").mkdir()
    cfg = {"command": [str(wrapper), "-m", "gpuwarden.standin"], "args": {"model-path": "m"}}
    (tmp_path / "configs" / "s.yaml").write_text(yaml.safe_dump(cfg))
    resolved = ConfigStore(tmp_path / "configs").load("s")
    parsers = ServerParsers()
    first = asyncio.create_task(parsers.parser_for(resolved))
    second = asyncio.create_task(parsers.parser_for(resolved))
    pid = int(await asyncio.wait_for(asyncio.to_thread(started.read_text), 30))
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert alive(pid)  # the second still waits for it
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert not alive(pid)
    assert builds.read_text().count("\n") == 1
