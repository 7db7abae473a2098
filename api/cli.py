"""The ``gpuwarden`` command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from . import client, demo, fakegpu_cli, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuwarden",
        description="Supervise an SGLang inference server on a GPU host.",
        parents=[client.global_flags(on_subcommand=False)],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(sub)
    demo.add_parser(sub)
    client.add_parsers(sub)
    fakegpu_cli.add_parser(sub)
    return parser


# A reader that stopped reading (`gpuwarden dump | head`): the status of a process killed by
# SIGPIPE, as cat, grep or git report it, so `set -o pipefail` scripts see what they would
# see with those; the output was not all delivered, so it is not 0.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.func.__module__ == client.__name__:
            return client.run(args)
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            # Buffered output must meet a closed pipe here, not in the interpreter's exit.
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's own advice: point stdout at /dev/null so that the flush at exit is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
