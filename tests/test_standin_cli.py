"""The stand-in's command line, checked from outside on real processes."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwarden.standin.argspec import option_strings, parse_help
from gpuwarden.standin.versions import VERSIONS

from .support.procs import PY, Proc

# SGLang 0.5.23's own --help, kept in the repository (the project reads nothing outside it).
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "sglang-0.5.23-help.txt"


def run_standin(*args: str, version: str = "0.5.23") -> subprocess.CompletedProcess[str]:
    argv = [PY, "-m", "gpuwarden.standin", "--standin-version", version]
    argv += ["--standin-time-scale", "0", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


PROG = {
    "0.4.10": "launch_server.py",
    "0.5.5": "launch_server.py",
    "0.5.12": "sglang serve",
    "0.5.23": "sglang serve",
}


@pytest.mark.parametrize("version", VERSIONS)
def test_unknown_flag_exits_2_with_argparse_error(version: str) -> None:
    res = run_standin("--model-path", "/m", "--bogus-flag", "1", version=version)
    assert res.returncode == 2
    assert f"{PROG[version]}: error: unrecognized arguments: --bogus-flag 1" in res.stderr


@pytest.mark.parametrize("version", VERSIONS)
def test_ambiguous_prefix_exits_2(version: str) -> None:
    res = run_standin("--model-path", "/m", "--speculative", "x", version=version)
    assert res.returncode == 2
    assert "error: ambiguous option: --speculative could match" in res.stderr


def test_old_cuda_graph_max_bs_is_ambiguous_in_0_5_23() -> None:
    res = run_standin("--model-path", "/m", "--cuda-graph-max-bs", "8")
    assert res.returncode == 2
    assert (
        "error: ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, "
        "--cuda-graph-max-bs-prefill" in res.stderr
    )


def test_misspelled_topk_is_unrecognized_in_0_5_23() -> None:
    res = run_standin("--model-path", "/m", "--speculative-eagle-top-k", "4")
    assert res.returncode == 2
    assert "unrecognized arguments: --speculative-eagle-top-k 4" in res.stderr


@pytest.mark.parametrize("version", ["0.4.10", "0.5.5", "0.5.12"])
def test_cuda_graph_max_bs_exists_up_to_0_5_12(standin: Callable[..., Proc], version: str) -> None:
    proc: Proc = standin("--cuda-graph-max-bs", "8", version=version)
    proc.wait_for(r"server_args=ServerArgs\(.*cuda_graph_max_bs=8")


@pytest.mark.parametrize("version", VERSIONS)
def test_abbreviations_are_accepted(standin: Callable[..., Proc], version: str) -> None:
    proc: Proc = standin("--tp", "2", "--mem-frac", "0.7", version=version)
    m = proc.wait_for(r"server_args=ServerArgs\(.*")
    assert "tp_size=2" in m.group(0)
    assert "mem_fraction_static=0.7" in m.group(0)


def test_missing_model_path_exits_2() -> None:
    res = run_standin("--port", "1")
    assert res.returncode == 2
    assert "error: the following arguments are required: --model-path/--model" in res.stderr


def test_bad_int_exits_2() -> None:
    res = run_standin("--model-path", "/m", "--tp-size", "x")
    assert res.returncode == 2
    assert "error: argument --tp-size/--tensor-parallel-size: invalid int value: 'x'" in res.stderr


def test_help_matches_sglang_0_5_23_option_set() -> None:
    res = run_standin("--help")
    assert res.returncode == 0
    assert res.stdout.startswith("usage: sglang serve [-h] --model-path MODEL_PATH")
    ours = {s.primary: s for s in parse_help(res.stdout) if not s.primary.startswith("--standin")}
    theirs = {s.primary: s for s in parse_help(FIXTURE.read_text())}
    assert set(ours) == set(theirs)
    assert option_strings(ours.values()) == option_strings(theirs.values())
    for name, spec in theirs.items():
        mine = ours[name]
        assert (mine.kind, mine.nargs, mine.choices) == (spec.kind, spec.nargs, spec.choices), name


@pytest.mark.parametrize("version", ["0.4.10", "0.5.5"])
def test_old_versions_print_launch_server_prog_in_help(version: str) -> None:
    res = run_standin("--help", version=version)
    assert res.stdout.startswith("usage: launch_server.py")


def test_config_file_is_merged_and_cli_wins(standin: Callable[..., Proc], tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text("tensor-parallel-size: 2\nenable-metrics: true\nmem-fraction-static: 0.6\n")
    proc: Proc = standin("--config", str(cfg), "--mem-fraction-static", "0.75")
    m = proc.wait_for(r"server_args=ServerArgs\(.*")
    assert "tp_size=2" in m.group(0)
    assert "enable_metrics=True" in m.group(0)
    assert "mem_fraction_static=0.75" in m.group(0)


def test_config_file_must_be_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "server.json"
    cfg.write_text("{}")
    res = run_standin("--model-path", "/m", "--config", str(cfg))
    assert res.returncode == 1
    assert "Config file must be YAML format, got: .json" in res.stderr


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--speculative-eagle-topk", "4"], "AssertionError"),
        (["--speculative-num-steps", "3"], "TypeError: '>' not supported"),
    ],
)
def test_partial_speculative_params_fail_like_sglang(flags: list[str], error: str) -> None:
    res = run_standin("--model-path", "/m", "--speculative-algorithm", "EAGLE3", *flags)
    assert res.returncode == 1
    assert "Traceback (most recent call last)" in res.stderr
    assert error in res.stderr


def test_unknown_speculative_algorithm_fails_in_resolution_in_0_5_23() -> None:
    res = run_standin("--model-path", "/m", "--speculative-algorithm", "MEDUSA")
    assert res.returncode == 1
    assert "ValueError: Unknown speculative algorithm name: MEDUSA" in res.stderr


def test_unknown_speculative_algorithm_is_an_argparse_choice_error_in_0_5_5() -> None:
    res = run_standin("--model-path", "/m", "--speculative-algorithm", "MEDUSA", version="0.5.5")
    assert res.returncode == 2
    assert "argument --speculative-algorithm: invalid choice: 'MEDUSA'" in res.stderr


def test_bad_log_level_is_an_attribute_error() -> None:
    res = run_standin("--model-path", "/m", "--log-level", "loud")
    assert res.returncode == 1
    assert "AttributeError" in res.stderr
