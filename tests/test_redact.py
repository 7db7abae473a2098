"""Secrets under every spelling the server's parser accepts: abbreviations, ``--opt=value``,
flags inside ``command:``; and no false alarms on flags that merely mention keys or tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.launchsecrets import argv_secrets, secret_values, sglang_option_strings
from gpuwarden.daemon.redact import MASK, Fingerprints, Redactor, fingerprints
from gpuwarden.daemon.resolvedconfig import redacted_header_lines
from gpuwarden.daemon.secretnames import is_secret_name, is_secret_option
from gpuwarden.standin.argspec import OptionSpec, add_specs

from .support.configs import standin_config
from .support.daemon import Daemon, start_daemon
from .support.http import Receiver
from .support.procs import PY, Proc

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


def _crashed_once(
    procs: list[Proc],
    tmp_path: Path,
    fake_gpu: Path,
    name: str,
    cfg: dict[str, Any],
    receiver: Receiver,
) -> tuple[Daemon, dict[str, Any]]:
    """A daemon serving `cfg` until its first crash has been posted to `receiver`; with the
    launch's event."""
    d = start_daemon(
        procs,
        tmp_path,
        fake_gpu,
        {name: cfg},
        default=name,
        restart={"initial_delay_s": 60},
        chat={"webhooks": [{"url": receiver.url, "format": "generic"}]},
    )
    d.wait_state("ready")
    d.wait_state("backoff")
    d.wait_event("server.notify_sent", notice="crash")
    events = d.http.get("/events", params={"limit": 200}).json()["events"]
    return d, next(e for e in events if e["event"] == "launch")


@pytest.mark.timeout(120)
def test_abbreviated_and_command_secrets_never_leave_the_daemon(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    abbrev, embedded = "sk-abbrev-secret-7f3a", "adm-embedded-secret-91c2"
    cfg = standin_config(f"--api-k={abbrev}", "--standin-crash-after=0.3")
    cfg["command"] = [*STANDIN, f"--admin-api-key={embedded}"]
    receiver = Receiver()
    try:
        d, launch = _crashed_once(procs, tmp_path, fake_gpu, "guarded", cfg, receiver)
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


def test_one_rule_names_secrets_for_flags_and_variables_alike() -> None:
    for name in (
        "HF_TOKEN",
        "GITHUB_PAT",
        "AWS_CREDENTIALS",
        "AUTH",
        "HTTP_AUTH_HEADER",
        "SLACK_WEBHOOK_URL",
        "OPENAI_API_KEY",
        "API_KEYS",
        "HFTOKEN",
        "DB_PASSWORD",
        "--api-key",
        "--hf-token",
        "--client-credentials",
        "--auth",
    ):
        assert is_secret_name(name), name
        assert is_secret_name(name.lower().replace("_", "-")), name
    for name in (
        "TOKENIZERS_PARALLELISM",
        "CUDA_VISIBLE_DEVICES",
        "SSL_KEYFILE",
        "--ssl-keyfile",
        "--max-total-tokens",
        "--speculative-token-map",
        "--kt-max-deferred-experts-per-token",
        "MAX_NUM_TOKEN",
        "OAUTH_SCOPE_PATH",
    ):
        assert not is_secret_name(name), name


def test_text_masks_colon_pairs_url_passwords_but_not_counts() -> None:
    r = Redactor()
    batch = "Decode batch. #running-req: 1, #token: 86, token usage: 0.00, #new-token: 5"
    assert r.text(batch) == batch
    assert r.text("token: tok-colon-1") == f"token: {MASK}"
    assert (
        r.text("{'github_pat': 'p-2', 'max_tokens': 5}")
        == f"{{'github_pat': '{MASK}', 'max_tokens': 5}}"
    )
    assert r.text('"AWS_CREDENTIALS": "c-3"') == f'"AWS_CREDENTIALS": "{MASK}"'
    assert r.text("tokenizer_path='/t', hf_token=None") == "tokenizer_path='/t', hf_token=None"
    assert (
        r.text("model_path='https://u:pw-4@hub/m' via http://h:80/x")
        == f"model_path='https://u:{MASK}@hub/m' via http://h:80/x"
    )


def test_wrapped_commands_and_lists_are_masked() -> None:
    sh = ["sh", "-c", "cd /m && HF_TOKEN=t-11 exec python -m sglang.launch_server --api-k 'k-22'"]
    policy = argv_secrets(sh)
    assert policy.redact(sh) == [
        "sh",
        "-c",
        f"cd /m && HF_TOKEN={MASK} exec python -m sglang.launch_server --api-k '{MASK}'",
    ]
    assert set(policy.values(sh)) == {"t-11", "k-22"}
    # A value too short to replace safely, or quoted apart: the script is shown re-quoted.
    short = ["bash", "-lc", "serve --token ab --name 'my model' && echo done"]
    assert (
        argv_secrets(short).redact(short)[2]
        == f"serve --token {MASK} --name 'my model' && echo done"
    )
    env = ["env", "-u", "X", "GITHUB_PAT=p-3", "OTHER=1", *STANDIN, "--api-key=k-4"]
    assert argv_secrets(env).redact(env) == [
        "env",
        "-u",
        "X",
        f"GITHUB_PAT={MASK}",
        "OTHER=1",
        *STANDIN,
        f"--api-key={MASK}",
    ]
    docker = ["docker", "run", "-e", "HF_TOKEN=t-5", "--env=AUTH=a-6", "-eAPI_KEY=k-7", "img"]
    assert argv_secrets(docker).redact(docker) == [
        "docker",
        "run",
        "-e",
        f"HF_TOKEN={MASK}",
        f"--env=AUTH={MASK}",
        f"-eAPI_KEY={MASK}",
        "img",
    ]
    # Every value a secret flag takes: without a parser, all up to the next flag.
    raw = ["myserver", "--token", "t-8", "t-9", "--port", "1"]
    assert argv_secrets(raw).redact(raw) == ["myserver", "--token", MASK, MASK, "--port", "1"]


def test_a_secret_list_and_url_passwords_in_a_config(tmp_path: Path) -> None:
    cfg = {
        "command": STANDIN,
        "args": {
            "api-key": ["list-key-1a2b", "list-key-3c4d"],
            "model-path": "https://hf-user:urlpass-9d2e@hub.example/m",
        },
        "env": {"HTTPS_PROXY": "http://me:proxypw-77@proxy:3128", "GITHUB_PAT": "pat-55ee"},
        "health": {"url": "http://probe:healthpw-31@127.0.0.1:1/health"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    resolved = ConfigStore(tmp_path).load("c")
    text = json.dumps(resolved.view()) + "\n".join(redacted_header_lines(resolved))
    for secret in ("list-key-1a2b", "list-key-3c4d", "urlpass-9d2e", "proxypw-77", "pat-55ee"):
        assert secret not in text, secret
        assert secret in resolved.secret_values()
    assert "healthpw-31" not in text and "healthpw-31" in resolved.secret_values()
    assert "https://hf-user:***@hub.example/m" in resolved.redacted_argv()


@pytest.mark.timeout(120)
def test_url_passwords_variables_and_wrapped_secrets_never_leave_the_daemon(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    secrets = {
        "url": "urlpass-9d2e51",
        "in sh": "adm-in-sh-4f1a07",
        "pat": "pat-var-55ee93",
        "proxy": "proxypw-77c3d1",
        "flag": "sk-plain-77aa02",
    }
    cfg = standin_config("--standin-crash-after=0.3", env={"GITHUB_PAT": secrets["pat"]})
    cfg["args"]["model-path"] = f"https://hf-user:{secrets['url']}@hub.example/m"
    cfg["args"]["api-key"] = secrets["flag"]
    cfg["env"]["HTTPS_PROXY"] = f"http://me:{secrets['proxy']}@proxy.example:3128"
    script = (
        'echo "pat: $GITHUB_PAT; proxy at $HTTPS_PROXY"; '
        f'exec "$0" -m gpuwarden.standin --admin-api-key={secrets["in sh"]} "$@"'
    )
    cfg["command"] = ["sh", "-c", script, PY]
    receiver = Receiver()
    try:
        d, launch = _crashed_once(procs, tmp_path, fake_gpu, "wrapped", cfg, receiver)
        log_text = Path(launch["log_file"]).read_text()
        # The server did print them: the masking is the daemon's.
        assert secrets["pat"] in log_text and secrets["url"] in log_text
        header = [line for line in log_text.splitlines() if line.startswith("# ")]
        views = {
            "config": json.dumps(d.http.get("/configs/wrapped").json()),
            "events": json.dumps(d.http.get("/events", params={"limit": 200}).json()),
            "events.jsonl": (tmp_path / "state" / "events.jsonl").read_text(),
            "log header": "\n".join(header),
            "logs": json.dumps(d.http.get("/logs", params={"lines": 500}).json()),
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
        for what, secret in secrets.items():
            assert secret not in text, (where, what)
    assert f"pat: {MASK}" in views["logs"]
    assert f"hf-user:{MASK}@hub.example" in views["config"]


def _echoing_config(key: str) -> dict[str, Any]:
    """The stand-in behind a shell that first echoes its argv: `--api-key KEY` with a space,
    which no key=value rule finds."""
    cfg = standin_config()
    cfg["args"]["api-key"] = key
    cfg["command"] = [
        "sh",
        "-c",
        'echo "starting with $*"; exec "$0" -m gpuwarden.standin "$@"',
        PY,
    ]
    return cfg


@pytest.mark.timeout(120)
def test_an_earlier_launch_is_masked_with_the_secrets_it_ran_with(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    old, new = "sk-rotated-away-5b1c9e", "sk-current-key-0d7a44"
    d = start_daemon(procs, tmp_path, fake_gpu, {"svc": _echoing_config(old)}, default="svc")
    d.wait_state("ready")
    first = d.status()["launch_id"]
    first_log = Path(d.status()["log_file"])
    assert f"--api-key {old}" in first_log.read_text()  # the server printed it in clear
    # The key is rotated: the config now says another one, and the server restarts on it.
    (tmp_path / "configs" / "svc.yaml").write_text(yaml.safe_dump(_echoing_config(new)))
    res = d.http.post("/restart", params={"config": "svc", "wait": "true", "probation": "false"})
    assert res.status_code == 200 and res.json()["outcome"] == "ready"
    assert d.status()["launch_id"] != first
    assert d.status()["last_exit"]["launch_id"] == first
    views = {
        "logs": json.dumps(d.http.get("/logs", params={"launch": first, "lines": 500}).json()),
        "previous": json.dumps(d.http.get("/logs", params={"launch": "previous"}).json()),
        "dump": d.http.get("/dump").text,
        "chat": json.dumps(d.http.post("/chat", json={"text": "server crashed"}).json()),
    }
    assert "starting with" in views["logs"] and f"--api-key {MASK}" in views["logs"]
    for where, text in views.items():
        assert old not in text, where
    # The record keeps a digest of the old key, never the key.
    for path in (tmp_path / "state").rglob("*"):
        if path.is_file():
            assert old.encode() not in path.read_bytes(), path
    assert (tmp_path / "state" / "secret-salt").stat().st_mode & 0o077 == 0
    # A later life of the daemon, with the config gone, still masks it.
    d.proc.popen.terminate()
    d.proc.popen.wait(30)
    (tmp_path / "configs" / "svc.yaml").unlink()
    d2 = start_daemon(procs, tmp_path, fake_gpu, {})
    text = json.dumps(d2.http.get("/logs", params={"launch": first, "lines": 500}).json())
    assert "starting with" in text and old not in text


def test_digests_mask_a_secret_where_it_stands_as_a_word() -> None:
    salt = b"s" * 32
    recorded = fingerprints(salt, ["sk-old-1234", "pw_9x"])
    assert all(len(item) == 2 and "sk-old" not in str(item) for item in recorded)
    found = Fingerprints.of(salt, json.loads(json.dumps(recorded)))
    assert found is not None
    r = Redactor(fingerprints=found)
    assert r.text("--api-key sk-old-1234 and 'sk-old-1234'.") == f"--api-key {MASK} and '{MASK}'."
    assert r.text("user=pw_9x;") == f"user={MASK};"
    assert r.text("xsk-old-1234 sk-old-12345") == "xsk-old-1234 sk-old-12345"  # inside words
    assert Fingerprints.of(salt, [["x", 1], "junk", [2, "ab"]]) is None
    assert Fingerprints.of(b"other" * 8, recorded) is not None
    assert (
        Redactor(fingerprints=Fingerprints.of(b"other" * 8, recorded)).text("sk-old-1234")
        == "sk-old-1234"
    )
