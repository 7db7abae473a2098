"""Secrets under every spelling the server's parser accepts: abbreviations, ``--opt=value``,
flags inside ``command:``; and no false alarms on flags that merely mention keys or tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.redact import (
    MASK,
    argv_secrets,
    is_secret_option,
    secret_values,
    sglang_option_strings,
)
from gpuwarden.standin.argspec import OptionSpec, add_specs

from .conftest import PY, Proc
from .daemon_harness import standin_config, start_daemon
from .test_chat import Receiver

ROOT = Path(__file__).resolve().parents[1]
SGLANG = ["python", "-m", "sglang.launch_server"]
STANDIN = [PY, "-m", "gpuwarden.standin"]
TABLE_SECRETS = {"--api-key", "--admin-api-key", "--ssl-keyfile-password"}


def _table_parser() -> argparse.ArgumentParser:
    """SGLang 0.5.23's parser rebuilt from the bundled table, to ask argparse itself."""

    class Raising(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            raise ValueError(message)

    data = json.loads((ROOT / "standin" / "data" / "options-0.5.23.json").read_text())
    parser = Raising(add_help=False)
    add_specs(parser, [OptionSpec.from_json(o) for o in data["options"]])
    return parser


def test_only_credentials_of_the_sglang_table_are_secret() -> None:
    secret = {o for o in sglang_option_strings() if is_secret_option(o)}
    assert secret == TABLE_SECRETS
    # Flags that mention keys or tokens without carrying one.
    for flag in (
        "--kv-cache-dtype",
        "--ssl-keyfile",
        "--speculative-token-map",
        "--kt-max-deferred-experts-per-token",
        "--bucket-time-to-first-token",
        "--max-total-tokens",
        "--enable-tokenizer-batch-encode",
    ):
        assert flag in sglang_option_strings()
        assert not argv_secrets(SGLANG).is_secret(flag), flag


def test_every_abbreviation_is_judged_as_argparse_resolves_it() -> None:
    parser = _table_parser()
    policy = argv_secrets(SGLANG)
    dests = {a.dest for a in parser._actions if set(a.option_strings) & TABLE_SECRETS}
    checked = 0
    for option in sorted(TABLE_SECRETS | {"--ssl-keyfile", "--ssl-certfile"}):
        for end in range(3, len(option) + 1):
            flag = option[:end]
            try:
                ns, _ = parser.parse_known_args(["--model-path", "m", flag, "v"])
            except ValueError as exc:
                # Ambiguous: a secret when any option it may mean is one.
                assert "ambiguous option" in str(exc)
                candidates = policy.resolve(flag)
                assert len(candidates) > 1
                assert policy.is_secret(flag) == bool(set(candidates) & TABLE_SECRETS), flag
                continue
            resolved_secret = any(getattr(ns, d, None) == "v" for d in dests)
            assert policy.is_secret(flag) == resolved_secret, flag
            assert policy.is_secret(f"{flag}=v".partition("=")[0]) == resolved_secret
            checked += 1
    assert checked > 20


def test_abbreviations_and_equals_forms_are_masked_with_the_parser() -> None:
    argv = [
        *SGLANG,
        "--api-k",
        "sk-abbrev-1",
        "--admin-api=adm-equals-2",
        "--ssl-keyfile",
        "/etc/tls/key.pem",  # exact match of a path option: shown
        "--ssl-keyfile-p",
        "pw-prefix-3",
        "--a",  # ambiguous, and one of its meanings is a secret
        "amb-4444",
        "--kv-cache-dtype",
        "fp8_e5m2",
        "--speculative-token-map",
        "/maps/t.pt",
    ]
    policy = argv_secrets(argv)
    assert policy.resolve("--api-k") == ["--api-key"]
    assert policy.resolve("--ssl-keyfile") == ["--ssl-keyfile"]
    assert len(policy.resolve("--a")) > 2
    assert policy.redact(argv) == [
        *SGLANG,
        "--api-k",
        MASK,
        f"--admin-api={MASK}",
        "--ssl-keyfile",
        "/etc/tls/key.pem",
        "--ssl-keyfile-p",
        MASK,
        "--a",
        MASK,
        "--kv-cache-dtype",
        "fp8_e5m2",
        "--speculative-token-map",
        "/maps/t.pt",
    ]
    assert set(secret_values(argv, {}, policy)) == {
        "sk-abbrev-1",
        "adm-equals-2",
        "pw-prefix-3",
        "amb-4444",
    }


def test_without_a_parser_names_and_prefixes_of_secret_options_decide() -> None:
    for command in (["vllm", "serve", "m"], ["/opt/bin/server"]):
        argv = [
            *command,
            "--api-k",
            "sk-1111",
            "--admin-api-key=adm-2222",
            "--hf-tok",
            "hf-3333",
            "--my-service-token",
            "tok-4444",
            "--max-num-tokens",
            "8192",
            "--kv-cache-dtype",
            "fp8",
        ]
        policy = argv_secrets(argv)
        assert policy.options is None
        assert policy.redact(argv) == [
            *command,
            "--api-k",
            MASK,
            f"--admin-api-key={MASK}",
            "--hf-tok",
            MASK,
            "--my-service-token",
            MASK,
            "--max-num-tokens",
            "8192",
            "--kv-cache-dtype",
            "fp8",
        ]
    # SGLang whose parser the config says cannot be read: names only, still masked.
    assert argv_secrets([*SGLANG, "--api-k", "x"], parser_known=False).options is None
    assert argv_secrets([*SGLANG], parser_known=False).is_secret("--api-k")


def test_view_masks_abbreviated_args_and_flags_inside_command(tmp_path: Path) -> None:
    for name, cfg in {
        "k": {
            "command": [*STANDIN, "--admin-api-key=adm-in-command-1"],
            "args": {
                "api-k": "sk-abbrev-2",
                "kv-cache-dtype": "fp8_e5m2",
                "speculative-token-map": "/maps/t.pt",
                "model-path": "/m",
            },
        },
        "raw": {"command": ["myserver", "--token", "tok-raw-3"], "preflight": {"argv": False}},
    }.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    store = ConfigStore(tmp_path)
    view = store.load("k").view()
    text = json.dumps(view)
    assert "adm-in-command-1" not in text and "sk-abbrev-2" not in text
    assert view["config"]["command"][-1] == f"--admin-api-key={MASK}"
    assert view["config"]["args"]["api-k"] == MASK
    assert view["config"]["args"]["kv-cache-dtype"] == "fp8_e5m2"
    assert view["config"]["args"]["speculative-token-map"] == "/maps/t.pt"
    assert "--api-k" in view["argv"]
    assert "tok-raw-3" not in json.dumps(store.load("raw").view())
    assert set(store.load("k").secret_values()) == {"adm-in-command-1", "sk-abbrev-2"}


@pytest.mark.timeout(120)
def test_abbreviated_and_command_secrets_never_leave_the_daemon(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    abbrev, embedded = "sk-abbrev-secret-7f3a", "adm-embedded-secret-91c2"
    cfg = standin_config(f"--api-k={abbrev}", "--standin-crash-after=0.3")
    cfg["command"] = [*STANDIN, f"--admin-api-key={embedded}"]
    receiver = Receiver()
    try:
        d = start_daemon(
            procs,
            tmp_path,
            fake_gpu,
            {"guarded": cfg},
            default="guarded",
            restart={"initial_delay_s": 60},
            chat={"webhooks": [{"url": receiver.url, "format": "generic"}]},
        )
        d.wait_state("ready")
        d.wait_state("backoff")
        d.wait_event("server.notify_sent", notice="crash")
        launch = next(
            e
            for e in d.http.get("/events", params={"limit": 200}).json()["events"]
            if e["event"] == "launch"
        )
        header = [
            line
            for line in Path(launch["log_file"]).read_text().splitlines()
            if line.startswith("# ")
        ]
        assert any(line.startswith("# argv: ") for line in header)
        views = {
            "config": json.dumps(d.http.get("/configs/guarded").json()),
            "events": json.dumps(d.http.get("/events", params={"limit": 200}).json()),
            "events.jsonl": (tmp_path / "state" / "events.jsonl").read_text(),
            "log header": "\n".join(header),
            "dump json": json.dumps(
                d.http.get("/dump", headers={"Accept": "application/json"}).json()
            ),
            "dump": d.http.get("/dump").text,
            "status": json.dumps(d.status()),
            "chat": json.dumps(d.http.post("/chat", json={"text": "server crashed"}).json()),
            "webhook": json.dumps(receiver.posts),
            "daemon log": d.proc.text(),
        }
    finally:
        receiver.close()
    assert receiver.posts
    for where, text in views.items():
        assert abbrev not in text, where
        assert embedded not in text, where
    assert f"--api-k {MASK}" in views["log header"]
    assert f"--admin-api-key={MASK}" in views["config"]
