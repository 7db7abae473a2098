"""The CLI's parsers: the global flags and the commands that talk to a daemon.

Apart from the commands themselves (`client`), so that building the parser, and so `serve`,
imports no HTTP client: the daemon's memory holds only what it runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8600"
# `func` of a command that `client.run` runs, by its name (`args.command`).
CLIENT = "client"


def global_flags(on_subcommand: bool) -> argparse.ArgumentParser:
    """--url, --token-file, --settings and --json, accepted before or after the subcommand.

    The main parser holds the defaults; each subcommand repeats the flags with SUPPRESS as
    default, so a flag given before the subcommand is not reset by the subcommand's parser,
    and one given after it wins."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if on_subcommand else value

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--url",
        default=default(None),
        help=f"the daemon (default $GPUWARDEN_URL, else the --settings listen address, "
        f"else {DEFAULT_URL})",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        default=default(None),
        help="bearer token file (default $GPUWARDEN_TOKEN, else the --settings token_file)",
    )
    p.add_argument(
        "--settings",
        type=Path,
        default=default(None),
        help="settings YAML: the daemon's (serve), the configs (check --offline), the "
        "daemon's address and token (the other commands)",
    )
    p.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON for scripts"
    )
    return p


def add_client_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands that talk to a daemon (`client.run` runs them, by name)."""
    common = global_flags(on_subcommand=True)
    p = sub.add_parser(
        "status", parents=[common], help="the server's state, config, last exit and GPUs"
    )
    p.set_defaults(func=CLIENT)

    p = sub.add_parser(
        "restart", parents=[common], help="restart the current config, or swap to CONFIG"
    )
    p.add_argument("config", nargs="?")
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait for the outcome, showing progress (1 on a rollback or failure), through the "
        "probation of the config brought up",
    )
    p.add_argument(
        "--no-probation",
        dest="probation",
        action="store_false",
        help="with --wait: stop waiting at ready, before the probation is over",
    )
    p.set_defaults(func=CLIENT)

    p = sub.add_parser("start", parents=[common], help="start CONFIG (or the saved one)")
    p.add_argument("config", nargs="?")
    p.set_defaults(func=CLIENT)

    p = sub.add_parser("stop", parents=[common], help="stop the server and leave it stopped")
    p.add_argument(
        "--no-wait",
        dest="wait",
        action="store_false",
        help="return once the stop is accepted, not once the server is stopped",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="give up waiting after S seconds (1; the stop goes on in the daemon); "
        "default: the daemon's stop.grace_s plus 60",
    )
    p.set_defaults(func=CLIENT)

    p = sub.add_parser("logs", parents=[common], help="the server's log")
    p.add_argument("-n", "--lines", type=int, default=100)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("--launch", default=None, help="a launch id, or `previous`")
    p.set_defaults(func=CLIENT)

    p = sub.add_parser("events", parents=[common], help="recent events")
    p.add_argument("-n", "--limit", type=int, default=30)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    p.set_defaults(func=CLIENT)

    p = sub.add_parser("configs", parents=[common], help="the named configs")
    p.set_defaults(func=CLIENT)

    p = sub.add_parser(
        "check", parents=[common], help="preflight CONFIG without touching the running server"
    )
    p.add_argument("config")
    p.add_argument("--offline", action="store_true", help="check here, without a daemon")
    p.set_defaults(func=CLIENT)

    p = sub.add_parser(
        "sweep", parents=[common], help="benchmark configs in turn: table, CSV, chart"
    )
    p.add_argument("configs", nargs="+", metavar="CONFIG")
    p.add_argument("--baseline", default=None, help="the reference config (default: the first)")
    p.add_argument("--end-on", default=None, help="the config to serve at the end")
    p.add_argument("--requests", type=int, default=32, help="measured requests per config")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests, not counted")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end answers"
    )
    p.add_argument("--backend", choices=("openai", "sglang-bench"), default="openai")
    p.add_argument("--input-len", type=int, default=128, help="sglang-bench: prompt tokens")
    p.set_defaults(func=CLIENT)

    p = sub.add_parser("dump", parents=[common], help="the diagnostic dump")
    p.set_defaults(func=CLIENT)
