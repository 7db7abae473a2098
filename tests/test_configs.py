"""Named configs and settings: extends, argv rules, errors with file and line, env overrides."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.daemon.configs import ConfigError, ConfigNotFound, ConfigStore
from gpuwarden.daemon.configschema import build_argv
from gpuwarden.daemon.launchsecrets import argv_secrets
from gpuwarden.daemon.resolvedconfig import option_value
from gpuwarden.daemon.settings import SettingsError, load_settings
from gpuwarden.standin.argspec import OptionSpec, add_specs

from .support.configs import BOMB

ROOT = Path(__file__).resolve().parents[1]


def store(tmp_path: Path, files: dict[str, str]) -> ConfigStore:
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    return ConfigStore(tmp_path)


def test_argv_rules_without_a_shell() -> None:
    argv = build_argv(
        ["python", "-m", "sglang.launch_server"],
        {
            "model-path": "/m; rm -rf /",
            "tp-size": 8,
            "enable-metrics": True,
            "disable-cuda-graph": False,
            "api-key": None,
            "random-seed": 0,
            "chat-template": "",
            "cuda-graph-bs": [1, 2, 4, 8],
            "json-model-override-args": {"rope_scaling": {"factor": 2}},
        },
    )
    assert argv == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m; rm -rf /",
        "--tp-size",
        "8",
        "--enable-metrics",
        "--random-seed",
        "0",
        "--chat-template",
        "",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "8",
        "--json-model-override-args",
        '{"rope_scaling":{"factor":2}}',
    ]


def test_extends_merges_mappings_deeply_and_replaces_lists(tmp_path: Path) -> None:
    s = store(
        tmp_path,
        {
            "base": "args: {model-path: /m, tp-size: 8, cuda-graph-bs: [1, 2]}\n"
            "env: {CUDA_VISIBLE_DEVICES: '0,1'}\nhealth: {interval_s: 2}\n",
            "eagle": "extends: base\nargs: {speculative-algorithm: EAGLE3, cuda-graph-bs: [4]}\n"
            "health: {failures: 5}\n",
        },
    )
    cfg = s.load("eagle")
    assert cfg.config.args == {
        "model-path": "/m",
        "tp-size": 8,
        "cuda-graph-bs": [4],
        "speculative-algorithm": "EAGLE3",
    }
    assert cfg.config.health.interval_s == 2 and cfg.config.health.failures == 5
    assert cfg.gpus == ["0", "1"]
    assert cfg.health_url == "http://127.0.0.1:30000/health"
    assert [p.name for p in cfg.files] == ["eagle.yaml", "base.yaml"]
    assert s.load("base").config_hash != cfg.config_hash


def test_extends_cycle_and_unknown_parent_are_clear_errors(tmp_path: Path) -> None:
    s = store(
        tmp_path, {"a": "extends: b\n", "b": "extends: a\n", "c": "args: {}\nextends: nope\n"}
    )
    with pytest.raises(ConfigError, match="extends cycle: a → b → a"):
        s.load("a")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: extends: unknown config 'nope'"):
        s.load("c")


def test_errors_name_file_line_and_reason(tmp_path: Path) -> None:
    s = store(
        tmp_path,
        {
            "badyaml": "args:\n  tp-size: [1, 2\n",
            "badtype": "command: [python]\nhealth:\n  interval_s: soon\n",
            "unknown": "args: {}\nheath: {}\n",
            "notmap": "- a\n- b\n",
        },
    )
    with pytest.raises(ConfigError, match=r"badyaml\.yaml:\d+: invalid YAML"):
        s.load("badyaml")
    with pytest.raises(
        ConfigError, match=r"badtype\.yaml:3: health\.interval_s: Input should be a valid number"
    ):
        s.load("badtype")
    with pytest.raises(
        ConfigError, match=r"unknown\.yaml:2: heath: Extra inputs are not permitted"
    ):
        s.load("unknown")
    with pytest.raises(ConfigError, match="must be a mapping"):
        s.load("notmap")


def test_names_are_validated_and_cannot_leave_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    (tmp_path / "outside.yaml").write_text("args: {}\n")
    (folder / "link.yaml").symlink_to(tmp_path / "outside.yaml")
    s = ConfigStore(folder)
    for bad in ("../../etc/passwd", "a/b", ".hidden", "", "x" * 65):
        with pytest.raises(ConfigError) as exc:
            s.load(bad)
        assert exc.value.kind == "bad_request"
    with pytest.raises(ConfigError, match="leaves") as exc2:
        s.load("link")
    assert exc2.value.kind == "bad_request"
    with pytest.raises(ConfigNotFound):
        s.load("absent")


def test_secrets_are_masked_in_the_view(tmp_path: Path) -> None:
    s = store(
        tmp_path,
        {
            "k": "args: {api-key: sk-123456, model-path: /m}\n"
            "env: {HF_TOKEN: hf_abcdef, CUDA_VISIBLE_DEVICES: '0'}\n"
        },
    )
    view = s.load("k").view()
    text = yaml.safe_dump(view)
    assert "sk-123456" not in text and "hf_abcdef" not in text
    assert view["config"]["args"]["api-key"] == "***"
    assert view["config"]["env"]["HF_TOKEN"] == "***"
    assert "--api-key" in view["argv"] and "***" in view["argv"]


def test_env_null_unsets_the_variable_also_through_extends(tmp_path: Path) -> None:
    s = store(
        tmp_path,
        {
            "base": "env: {HF_HOME: /cache, GW_PARENT: p, PORT_HINT: 7}\n",
            "child": "extends: base\nenv: {GW_PARENT: null, GW_INHERITED: null}\n",
        },
    )
    cfg = s.load("child")
    assert cfg.env == {"HF_HOME": "/cache", "PORT_HINT": "7"}
    assert sorted(cfg.unset_env) == ["GW_INHERITED", "GW_PARENT"]
    env = cfg.process_env({"GW_INHERITED": "from-daemon", "PATH": "/bin", "GW_PARENT": "d"})
    assert env == {"PATH": "/bin", "HF_HOME": "/cache", "PORT_HINT": "7"}
    assert cfg.view()["config"]["env"]["GW_PARENT"] is None  # shown as unset, not "None"
    assert s.load("base").env["GW_PARENT"] == "p"


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=10),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=10),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
            max_leaves=8,
        ),
        max_size=6,
    )
)
def test_config_loader_never_raises_anything_but_config_error(data: dict) -> None:  # type: ignore[type-arg]
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "h.yaml").write_text(yaml.safe_dump(data))
        with contextlib.suppress(ConfigError):
            ConfigStore(Path(tmp)).load("h")


def test_settings_env_overrides_and_relative_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("configs_dir: ./cfg\nrestart: {initial_delay_s: 3}\n")
    monkeypatch.setenv("GPUWARDEN_RESTART__INITIAL_DELAY_S", "0")
    monkeypatch.setenv("GPUWARDEN_LISTEN", "127.0.0.1:9999")
    s = load_settings(path)
    assert s.configs_dir == tmp_path / "cfg"
    assert s.state_dir == tmp_path / "state"
    assert s.restart.initial_delay_s == 0
    assert s.restart.multiplier == 2
    assert s.listen == "127.0.0.1:9999"
    assert load_settings(path, listen="127.0.0.1:0").listen_host_port == ("127.0.0.1", 0)


def test_bad_settings_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("restart: {jitter: 2}\nlisten: nowhere\n")
    with pytest.raises(SettingsError, match=r"s\.yaml: .*restart\.jitter"):
        load_settings(path)
    with pytest.raises(SettingsError, match="no such file"):
        load_settings(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"args:\n  model-path: /m\xff\xfe\n", r"not UTF-8 text \(byte 0xff at offset 22\)"),
        (b"args: " + b"[" * 20000 + b"]" * 20000 + b"\n", "nested deeper than 64 levels"),
        (b"args: " + b"[" * 20000 + b"\n", "nested deeper than 64 levels"),  # and broken
        (BOMB.encode(), "more than 100000 nodes once aliases are expanded"),
        (b"args: {x: '" + b"y" * (2 * 1024 * 1024) + b"'}\n", r"too large \(2097166 bytes"),
    ],
    ids=["not-utf8", "deep", "deep-broken", "alias-bomb", "huge"],
)
def test_a_config_that_cannot_be_decoded_is_a_config_error_with_file_and_reason(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    (tmp_path / "bad.yaml").write_bytes(content)
    with pytest.raises(ConfigError, match=rf"bad\.yaml: .*{reason}"):
        ConfigStore(tmp_path).load("bad")
    (tmp_path / "child.yaml").write_text("extends: bad\n")  # through extends as well
    with pytest.raises(ConfigError, match=rf"bad\.yaml: .*{reason}"):
        ConfigStore(tmp_path).load("child")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_config_that_is_not_a_regular_file_is_refused_without_blocking(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "odd.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(ConfigError, match=r"odd\.yaml: not a regular file"):
        ConfigStore(tmp_path).load("odd")


def test_settings_files_are_read_with_the_same_limits(tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_bytes(BOMB.encode())
    with pytest.raises(SettingsError, match="aliases are expanded"):
        load_settings(path)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(SettingsError, match="not a regular file"):
        load_settings(path)


def test_settings_from_the_environment_nest_parse_json_and_ignore_other_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("restart: {multiplier: 3}\nallowed_hosts: [a.example]\n")
    monkeypatch.setenv("GPUWARDEN_restart__max_delay_s", "7")
    monkeypatch.setenv("GPUWARDEN_ALLOWED_HOSTS", '["gpu-box", "b.example"]')
    monkeypatch.setenv("GPUWARDEN_TOKEN", "not-a-setting")
    s = load_settings(path)
    assert (s.restart.multiplier, s.restart.max_delay_s) == (3, 7)
    assert s.allowed_hosts == ["gpu-box", "b.example"]
    monkeypatch.setenv("GPUWARDEN_ALLOWED_HOSTS", "[not json")
    with pytest.raises(SettingsError, match="GPUWARDEN_ALLOWED_HOSTS: not valid JSON"):
        load_settings(path)
    monkeypatch.setenv("GPUWARDEN_ALLOWED_HOSTS", "[]")
    monkeypatch.setenv("GPUWARDEN_RESTART__JITTER", "5")
    with pytest.raises(SettingsError, match=r"restart\.jitter"):
        load_settings(path)


def test_a_failure_is_kept_until_a_file_it_looked_at_changes(tmp_path: Path) -> None:
    """A failed load is kept while its files stay as they were (the fault matrix counts the
    reads); a change to any file of its chain, or a file appearing where one was looked for,
    is read."""
    (tmp_path / "child.yaml").write_text("extends: parent\nargs: {port: 1}\n")
    store = ConfigStore(tmp_path)
    with pytest.raises(ConfigNotFound):
        store.load("missing")
    (tmp_path / "missing.yml").write_text("args: {port: 2}\n")  # appears: found
    assert store.load("missing").config.args["port"] == 2
    with pytest.raises(ConfigError, match="extends: unknown config 'parent'"):
        store.load("child")
    (tmp_path / "parent.yaml").write_text("health: {interval_s: soon}\n")
    with pytest.raises(ConfigError, match=r"health\.interval_s") as first:
        store.load("child")
    with pytest.raises(ConfigError, match=r"health\.interval_s") as again:
        store.load("child")
    assert again.value is not first.value  # a fresh exception each time, same error
    (tmp_path / "parent.yaml").write_text("health: {interval_s: 2}\n")  # fixed: read again
    assert store.load("child").config.health.interval_s == 2


SGLANG = ["python", "-m", "sglang.launch_server"]


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "31000"],
        ["--port=31000"],
        ["--po", "31000"],
        ["--po=31000", "--ho", "0.0.0.0"],
        ["--port", "1", "--model-path", "/m", "--port", "31000"],  # the last one wins
        ["--port=1", "--por", "31000", "--host=10.0.0.7"],
        ["--model-path", "/m", "--host", "::1"],  # no port: the server's default
        [],
    ],
)
def test_the_port_and_host_are_what_the_servers_parser_makes_of_the_argv(
    args: list[str],
) -> None:
    """Before: only `args: {port: N}` counted; `--port` in `command:`, an `args` key `--port`
    and the abbreviations argparse accepts were ignored (30000 was probed)."""
    ns = _sglang_parser().parse_args(["--model-path", "/m", *args])  # argparse itself
    policy = argv_secrets(SGLANG)
    port = option_value([*SGLANG, *args], "--port", policy)
    host = option_value([*SGLANG, *args], "--host", policy)
    # The table keeps no defaults: what the argv does not give is None to argparse too.
    assert (port, host) == (ns.port, ns.host)


def test_a_program_of_unknown_parser_gives_its_port_by_the_exact_flag_only() -> None:
    other = ["/opt/server/bin/serve"]
    policy = argv_secrets(other)
    assert option_value([*other, "--port", "9000"], "--port", policy) == "9000"
    assert option_value([*other, "--port=9000", "--host=h"], "--port", policy) == "9000"
    assert option_value([*other, "--po", "9000"], "--port", policy) is None
    # SGLang with `preflight: {argv: false}`: its parser is not trusted to be SGLang's either.
    assert option_value([*SGLANG, "--po", "9"], "--port", argv_secrets(SGLANG, False)) is None
    # After `--` everything is positional; an option with no value gives none.
    assert option_value([*other, "--", "--port", "1"], "--port", policy) is None
    assert option_value([*other, "--port"], "--port", policy) is None


def test_a_resolved_config_reads_its_port_from_command_and_args_alike(tmp_path: Path) -> None:
    s = store(
        tmp_path,
        {
            "cmd": "command: [python, -m, sglang.launch_server, --port, '31001']\n",
            "key": "args: {'--port': 31002, '--host': 0.0.0.0}\n",
            "abbr": "command: [python, -m, sglang.launch_server, --po=31003]\n"
            "args: {enable-metrics: true}\n",
            # `args` come after `command` in the argv: theirs wins, as the server sees it.
            "both": "command: [python, -m, sglang.launch_server, --port, '1']\n"
            "args: {port: 31004, host: '::1'}\n",
            "garbled": "args: {port: http}\n",
        },
    )
    assert s.load("cmd").health_url == "http://127.0.0.1:31001/health"
    assert s.load("key").health_url == "http://127.0.0.1:31002/health"
    assert s.load("abbr").port == 31003
    assert s.load("abbr").metrics_url == "http://127.0.0.1:31003/metrics"
    assert s.load("both").health_url == "http://[::1]:31004/health"
    assert s.load("garbled").port == 30000  # the server refuses it; its default is probed


def _sglang_parser() -> argparse.ArgumentParser:
    data = json.loads((ROOT / "standin" / "data" / "options-0.5.23.json").read_text())
    parser = argparse.ArgumentParser(add_help=False)
    add_specs(parser, [OptionSpec.from_json(o) for o in data["options"]])
    return parser
