"""The ``gpuwarden`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpuwarden.daemon import client, demo, fakegpu_cli, serve


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.func.__module__ == client.__name__:
            return client.run(args)
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
