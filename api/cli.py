"""The ``gpuwarden`` command line.

Starting it imports the parsers only: a client command imports the HTTP client, and `serve`
and `demo` the control plane and the supervisor (fastapi, uvicorn, pydantic), when one runs."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import completion, fakegpu_cli, parsers

DEMO_DEFAULT_LISTEN = "127.0.0.1:8600"


def _daemon_imports() -> None:
    """Before the daemon's imports. FastAPI imports `pydantic.v1` (1.4 MiB resident for the
    daemon's life) when it registers a route, only to refuse pydantic v1 models; the daemon
    has none, so that import is turned down here and FastAPI's check answers "not v1"."""
    sys.modules.setdefault("pydantic.v1", None)  # type: ignore[arg-type]


def _serve(args: argparse.Namespace) -> int:
    _daemon_imports()
    from .serve import run  # noqa: PLC0415 - the daemon, only when it runs

    return run(args)


def _demo(args: argparse.Namespace) -> int:
    _daemon_imports()
    from .demo import run  # noqa: PLC0415 - the daemon, only when it runs

    return run(args)


def _shim(args: argparse.Namespace) -> int:
    """Become the shim of the settings' state directory (`gpuwarden-shim.service` runs this):
    the bare interpreter on the shim's file, in this process, so its pid is the unit's."""
    from gpuwarden.daemon.server import shimstart  # noqa: PLC0415
    from gpuwarden.daemon.settings import SettingsError, load_settings  # noqa: PLC0415

    try:
        settings = load_settings(getattr(args, "settings", None))
    except SettingsError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return 1
    argv = shimstart.command(settings.state_dir / "shim")
    os.execve(argv[0], argv, {**os.environ, **shimstart.environment()})


def _proxy(args: argparse.Namespace) -> int:
    """Become the front proxy of the settings (`gpuwarden-proxy.service` runs this), in this
    process, so its pid is the unit's; the daemon connects to it."""
    from gpuwarden.daemon import frontproxy  # noqa: PLC0415
    from gpuwarden.daemon.settings import SettingsError, load_settings  # noqa: PLC0415

    try:
        settings = load_settings(getattr(args, "settings", None))
    except SettingsError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return 1
    if settings.proxy is None:
        print("gpuwarden: the settings have no proxy: section; no proxy runs", file=sys.stderr)
        return 0
    argv = frontproxy.command(settings.proxy, frontproxy.socket_path(settings.state_dir))
    os.execv(argv[0], argv)


def add_serve_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    # SUPPRESS: `gpuwarden --settings FILE serve` keeps the main parser's value.
    p.add_argument("--settings", type=Path, default=argparse.SUPPRESS, help="settings YAML")
    p.add_argument("--listen", default=None, help="control plane HOST:PORT (overrides settings)")
    p.set_defaults(func=_serve)

    p = sub.add_parser(
        "shim",
        help="run the shim of the settings' state directory in the foreground (live_restore's "
        "servers' parent; gpuwarden-shim.service)",
    )
    p.add_argument("--settings", type=Path, default=argparse.SUPPRESS, help="settings YAML")
    p.set_defaults(func=_shim)

    p = sub.add_parser(
        "proxy",
        help="run the front proxy of the settings in the foreground (gpuwarden-proxy.service)",
    )
    p.add_argument("--settings", type=Path, default=argparse.SUPPRESS, help="settings YAML")
    p.set_defaults(func=_proxy)

    p = sub.add_parser("demo", help="run the daemon on the bundled SGLang stand-in")
    p.add_argument(
        "--listen",
        default=os.environ.get("GPUWARDEN_LISTEN", DEMO_DEFAULT_LISTEN),
        help=f"control plane HOST:PORT (default $GPUWARDEN_LISTEN, else {DEMO_DEFAULT_LISTEN}; "
        "port 0 picks a free one)",
    )
    p.add_argument("--dir", type=Path, default=None, help="demo folder (default: a temp dir)")
    p.set_defaults(func=_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuwarden",
        description="Supervise an SGLang inference server on a GPU host.",
        parents=[parsers.global_flags(on_subcommand=False)],
    )
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parsers(sub)
    parsers.add_client_parsers(sub)
    fakegpu_cli.add_parser(sub)
    completion.add_parser(sub)
    return parser


class _Version(argparse.Action):
    """`--version`, the installed version read only when asked for: reading the package's
    metadata costs every other command ~30 ms and the daemon its memory."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"gpuwarden {_version()}")
        parser.exit()


def _version() -> str:
    """The installed package's version (what `pip show gpuwarden` says)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("gpuwarden")
    except PackageNotFoundError:
        return "unknown (not installed)"


# A reader that stopped reading (`gpuwarden dump | head`): the status of a process killed by
# SIGPIPE, as cat, grep or git report it, so `set -o pipefail` scripts see what they would
# see with those; the output was not all delivered, so it is not 0.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.func == parsers.CLIENT:
            from . import client  # noqa: PLC0415 - not in `serve`'s memory

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
