"""gpuwarden against the real SGLang 0.5.23 (CPU, tiny local model): one daemon and its server
shared by the scenarios of this module. Each scenario starts from `ready` (whatever config
serves), so they pass in any order; those that break the server wait for the daemon to bring
it back."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from gpuwarden.daemon import weightcache
from gpuwarden.daemon.configs import ConfigStore
from tests.support.daemon import Daemon, start_daemon
from tests.support.procs import Proc, alive, free_port, wait_until

from . import env as real_env
from .conftest import STARTUP_S, sglang_config

pytestmark = pytest.mark.timeout(900)
# Where SGLang 0.5.23's weight cache daemon stops on a machine without CUDA.
WEIGHT_CACHE_NEEDS_A_GPU = re.compile(r"weight cache daemon requires a CUDA-alike platform")


@pytest.fixture(scope="module")
def served(
    module_procs: list[Proc], tmp_path_factory: pytest.TempPathFactory, sglang_env: Path
) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("shared")
    port = free_port()
    configs = {
        "tiny": sglang_config(sglang_env, port, args={"enable-metrics": True}),
        # Another real config for swaps and sweeps: a smaller chunked prefill, its own stats.
        "tiny-b": sglang_config(sglang_env, port, args={"chunked-prefill-size": 1024}),
        # Fails at load: exit 1, `OSError: Repo id must be in the form ...`. (Relative, so
        # that preflight, which refuses a missing local path at once, lets it through.)
        "missing": sglang_config(sglang_env, port, args={"model-path": "no/such/model/here"}),
    }
    d = start_daemon(
        module_procs,
        root,
        root / "no-fake-gpu",
        configs,
        default="tiny",
        gpu={"backend": "none"},
        stop={"grace_s": 30},
        restart={"initial_delay_s": 0, "jitter": 0, "probation_s": 5},
    )
    d.server_port = port  # type: ignore[attr-defined]  # every config serves there
    yield d


def wait_ready(d: Daemon) -> dict[str, Any]:
    wait_until(lambda: d.status()["state"] == "ready", STARTUP_S, "the real server to be ready")
    return d.status()


def base(d: Daemon) -> str:
    return f"http://127.0.0.1:{d.server_port}"  # type: ignore[attr-defined]


def child_named(main_pid: int, prefix: str) -> psutil.Process:
    return next(c for c in psutil.Process(main_pid).children() if c.name().startswith(prefix))


def chat(url: str, max_tokens: int = 48) -> dict[str, Any]:
    res = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "Hello, how are you today?"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
        timeout=120,
        trust_env=False,
    )
    res.raise_for_status()
    data: dict[str, Any] = res.json()
    return data


def test_ready_then_a_chat_completion_and_metrics_from_real_decode_lines(served: Daemon) -> None:
    st = wait_ready(served)
    assert st["launch_id"] and st["pid"]
    reply = chat(base(served))
    assert reply["usage"]["completion_tokens"] == 48
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    # SGLang logs a Decode batch line every 40 decode steps: 48 tokens make one.
    wait_until(
        lambda: (served.status()["server_metrics"] or {}).get("gen_throughput_tok_s") is not None,
        30,
        "server_metrics from a Decode batch line",
    )
    metrics = served.status()["server_metrics"]
    assert metrics["gen_throughput_tok_s"] > 0
    assert metrics["running_req"] >= 1 and 0 <= metrics["token_usage"] <= 1


def check(d: Daemon, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import yaml  # noqa: PLC0415

    (d.root / "configs" / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    res = d.http.post(f"/configs/{name}/check", timeout=300)
    assert res.status_code in (200, 422), res.text
    data: dict[str, Any] = res.json()
    return data


@pytest.mark.parametrize("form", ["-m sglang.launch_server", "serve --model-path", "serve MODEL"])
def test_preflight_is_exact_with_the_real_parser(
    served: Daemon, sglang_env: Path, form: str
) -> None:
    cfg = sglang_config(sglang_env, args={"tp-size": "two"}, serve=form.startswith("serve"))
    if form == "serve MODEL":  # `sglang serve <model>`: SGLang's positional model path
        model = cfg["args"].pop("model-path")
        cfg["command"] = [*cfg["command"], model]
    bad = check(served, "bad-tp", cfg)
    assert bad["ok"] is False and bad["method"] == "parser", bad
    problems = " ".join(bad["problems"])
    assert "argument --tp-size/--tensor-parallel-size: invalid int value: 'two'" in problems, bad
    cfg["args"]["tp-size"] = 1
    good = check(served, "good-tp", cfg)
    assert good["ok"] is True and good["method"] == "parser", good


def test_other_serve_forms_are_said_to_be_unchecked(served: Daemon, sglang_env: Path) -> None:
    cfg = sglang_config(sglang_env, serve=True, args={"model-type": "diffusion"})
    data = check(served, "diffusion", cfg)
    assert any("--model-type diffusion" in w and "not checked" in w for w in data["warnings"]), data


def test_a_killed_scheduler_is_a_crash_with_sglangs_line_then_ready_again(served: Daemon) -> None:
    st = wait_ready(served)
    mark = served.mark()
    child_named(st["pid"], "sglang::sched").kill()
    ex = served.wait_event("server.exit", after=mark, timeout=60)
    assert ex["reason"] == "crash"
    assert re.fullmatch(
        r"Subprocess scheduler_0 \(pid=\d+\) crashed with exit code -9\. "
        r"Triggering SIGQUIT for cleanup\.\.\.",
        ex["evidence"],
    ), ex
    assert not alive(st["pid"])
    after = wait_ready(served)
    assert after["launch_id"] != st["launch_id"]
    # The real crash's dump: the exit with SGLang's line, marked in the crashed launch's tail.
    dump = served.http.get("/dump").text
    assert "last exit: crash" in dump
    assert re.search(r"^! \[[\d\- :]+\] Subprocess scheduler_0 \(pid=\d+\) crashed", dump, re.M), (
        dump
    )


def test_a_killed_detokenizer_ends_the_launch_on_sglangs_line_not_its_linger(
    served: Daemon,
) -> None:
    """SGLang's defaults keep a dead server up 65 s (5 s settling, py-spy, a 60 s wait for CUDA
    coredumps) with its port open and requests hanging: the launch ends on the first line."""
    st = wait_ready(served)
    mark = served.mark()
    child_named(st["pid"], "sglang::detok").kill()
    said = served.wait_event("server.death_announced", after=mark, timeout=30)
    assert re.fullmatch(
        r"Subprocess detokenizer \(pid=\d+\) crashed with exit code -9\. "
        r"Triggering SIGQUIT for cleanup\.\.\.",
        said["line"],
    ), said
    ex = served.wait_event("server.exit", after=mark, timeout=20)  # SGLang alone: 65 s
    assert (ex["reason"], ex["evidence"]) == ("crash", said["line"])
    assert not alive(st["pid"])
    assert wait_ready(served)["launch_id"] != st["launch_id"]


def swap(d: Daemon, name: str) -> dict[str, Any]:
    res = d.http.post("/restart", params={"config": name, "wait": "true"}, timeout=STARTUP_S * 2)
    assert res.status_code == 200, res.text
    data: dict[str, Any] = res.json()
    return data


def test_swaps_between_real_configs_and_a_failed_load_is_rolled_back(served: Daemon) -> None:
    st = wait_ready(served)
    other = "tiny-b" if st["config"] == "tiny" else "tiny"
    done = swap(served, other)
    assert (done["outcome"], done["state"]) == ("ready", "ready"), done
    assert served.status()["config"] == other
    failed = swap(served, "missing")
    assert failed["outcome"] == "rolled_back", failed
    assert failed["reason"] == "crash"
    assert (
        "OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name'"
        in (failed["evidence"])
    )
    st = served.status()
    assert (st["state"], st["config"], st["rolled_back_from"]) == ("ready", other, "missing")
    # The dump names the failed launch and shows the real traceback from its log.
    dump = served.http.get("/dump").text
    assert "Traceback (most recent call last):" in dump
    assert "OSError: Repo id must be in the form" in dump


def test_a_sweep_of_two_real_configs_counts_tokens_from_the_streams_usage(
    served: Daemon,
) -> None:
    wait_ready(served)
    res = served.http.post(
        "/sweeps",
        json={"configs": ["tiny", "tiny-b"], "requests": 2, "warmup": 1, "max_tokens": 24},
    )
    assert res.status_code == 202, res.text
    sweep_id = res.json()["id"]

    def finished() -> bool:
        # Its whole answer: measured, and the config it found serving back (`ended_at`).
        return served.http.get(f"/sweeps/{sweep_id}").json().get("ended_at") is not None

    wait_until(finished, STARTUP_S * 3, "the sweep to finish and restore")
    view = served.http.get(f"/sweeps/{sweep_id}").json()
    assert view["state"] == "done", view
    rows = {r["config"]: r for r in view["rows"]}
    for name in ("tiny", "tiny-b"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["tokens_counted_by"] == "usage", row
        assert 2 <= row["output_tokens"] <= 2 * 24, row
        assert row["tok_s"] > 0
    wait_ready(served)


def test_the_environment_is_the_pinned_one(sglang_env: Path) -> None:
    import subprocess  # noqa: PLC0415

    out = subprocess.run(
        [
            str(real_env.python_of(sglang_env)),
            "-c",
            "import importlib.metadata as m; print(m.version('sglang'), m.version('torch'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["0.5.23", "2.13.0+cpu"]


def test_a_start_is_recorded_in_phases_and_the_next_one_has_an_eta(served: Daemon) -> None:
    st = wait_ready(served)
    # The real server's lines mark the phases (on the CPU: no CUDA graphs), and its own
    # account of the start (`/server_info` startup_time) is kept beside them.
    wait_until(
        lambda: (served.status()["startup"] or {}).get("server") is not None,
        60,
        "SGLang's startup_time",
    )
    start = served.status()["startup"]
    assert {"init", "weights", "kv_cache", "warmup"} <= set(start["phases"]), start
    assert start["ready_s"] == pytest.approx(sum(start["phases"].values()), abs=0.05)
    assert {"load_weight", "kv_cache_allocation", "scheduler_e2e"} <= set(start["server"]), start
    # Its compile caches' folder, named by the versions its own interpreter has.
    [folder] = served.status()["compile_cache"]["folders"]
    assert folder["name"] == "no-gpu_sglang-0.5.23_torch-2.13.0+cpu", folder
    # A restart of the config it serves: its phase with an ETA from the earlier start.
    mark = served.mark()
    served.http.post("/restart", params={"config": st["config"], "wait": "false"})
    served.wait_state("starting", after=mark, timeout=120)
    seen: list[dict[str, Any]] = []

    def eta_shown() -> bool:
        phase = served.status()["phase"]
        if phase is not None:
            seen.append(phase)
        return phase is not None and phase["eta_s"] is not None

    wait_until(eta_shown, STARTUP_S, "a phase with an ETA")
    served.wait_state("ready", after=mark, timeout=STARTUP_S)
    assert served.status()["startup"]["ready_s"] > 0


def test_sglangs_own_parsers_take_the_weight_cache_flags_gpuwarden_passes(
    served: Daemon, sglang_env: Path
) -> None:
    """The engine's `--weight-cache-mode client` passes SGLang's parser (preflight); the
    sidecar's argv passes its daemon's own parsers (its flags, then the server's), and on this
    CPU it stops where SGLang's daemon needs a GPU, not at an argument."""
    cfg = sglang_config(sglang_env, args={"tp-size": 1, "dtype": "bfloat16"})
    cfg["weight_cache"] = True
    good = check(served, "wc", cfg)
    assert good["ok"] is True and good["method"] == "parser", good
    resolved = ConfigStore(served.root / "configs").load("wc")
    assert resolved.argv[-2:] == ["--weight-cache-mode", "client"]
    env = resolved.process_env(dict(os.environ))
    spec = weightcache.spec_of(resolved, str(real_env.python_of(sglang_env)), env)
    assert spec is not None and spec.argv[2] == "sglang.srt.weight_cache.daemon"
    ran = subprocess.run(
        [*spec.argv, "--timeout", "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=STARTUP_S,
        check=False,
    )
    out = ran.stdout + ran.stderr
    assert "unrecognized arguments" not in out and "error: argument" not in out, out[-3000:]
    assert ran.returncode != 0 and WEIGHT_CACHE_NEEDS_A_GPU.search(out), out[-3000:]
