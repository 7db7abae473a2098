"""A server's own options, learned before its config is checked against them (preflight).

Exact when possible: a small script run by the *server's* interpreter builds the server's own
argparse parser (SGLang: ``ServerArgs.add_cli_args``; the stand-in: its ``add_cli_args``) and
dumps its options (strings, nargs, type, choices). Otherwise the options are rebuilt from the
server's ``--help`` (types unknown: a warning says so). Results are cached per interpreter,
package version and version-selecting flags. Only SGLang and the stand-in are ever run to learn
their options: any other command (vLLM, a script) is not executed, since ``--help`` may mean
anything to it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.standin.argspec import (
    KIND_HELP,
    OptionSpec,
    ServerCli,
    parse_help,
    split_command,
)

from .resolvedconfig import ResolvedConfig
from .server.helpers import run_helper

INTROSPECT_TIMEOUT_S = 120.0
# Server interpreters run at once to learn options. Each SGLang one imports torch (about half a
# GiB): twelve preflights at once built twelve parsers (5.8 GiB); now they queue here.
MAX_INTROSPECTIONS = 2

# Each known server: how its interpreter builds the parser. The script prints one JSON object.
_DUMP_ACTIONS = r"""
def _dump(parser, prog, version):
    import argparse, json
    out = []
    for a in parser._actions:
        if not a.option_strings:
            continue
        if isinstance(a, argparse._HelpAction):
            kind = "help"
        elif isinstance(a, getattr(argparse, "BooleanOptionalAction", ())):
            kind = "boolean_optional"
        elif a.nargs == 0:
            kind = "store_true"
        else:
            kind = "store"
        t = a.type
        tname = {int: "int", float: "float", str: "str"}.get(t, None if t is None else "callable")
        strings = [s for s in a.option_strings
                   if not (kind == "boolean_optional" and s.startswith("--no-"))]
        out.append({"strings": strings, "kind": kind, "nargs": a.nargs if kind == "store" else 0,
                    "choices": None if a.choices is None else [str(c) for c in a.choices],
                    "type": tname, "dest": a.dest, "required": bool(a.required)})
    print(json.dumps({"prog": prog, "version": version, "options": out}))
"""

_SCRIPTS = {
    "sglang.launch_server": _DUMP_ACTIONS
    + r"""
import argparse, importlib.metadata as md
from sglang.srt.server_args import ServerArgs
v = md.version("sglang")
num = tuple(int(x) for x in v.split(".")[:3] if x.isdigit())
prog = "sglang serve" if num >= (0, 5, 12) else "launch_server.py"
p = argparse.ArgumentParser(prog=prog)
ServerArgs.add_cli_args(p)
_dump(p, prog, v)
""",
    "gpuwarden.standin": _DUMP_ACTIONS
    + r"""
import argparse, sys, importlib.metadata as md
from gpuwarden.standin import cli
from gpuwarden.standin.versions import PROFILES
version = sys.argv[1]
p = cli.build_parser(version)
_dump(p, PROFILES[version].prog, md.version("gpuwarden") + "+sglang-" + version)
""",
}


_PACKAGES = {"sglang.launch_server": "sglang", "gpuwarden.standin": "gpuwarden"}


def known_server(module: str | None) -> bool:
    """SGLang or the stand-in: a server whose parser can be built and whose port is known."""
    return module in _SCRIPTS


@dataclass
class ParserSpec:
    prog: str
    version: str
    options: list[OptionSpec]
    exact: bool


@dataclass
class _Flight:
    """One parser being learned, and how many callers wait for it."""

    task: asyncio.Task[tuple[ParserSpec | None, list[str]]]
    waiters: int = 0


class ServerParsers:
    """Builds (and caches) server parsers: callers asking for the same server at once share one
    build, and at most `max_running` introspections run at a time (the rest wait their turn)."""

    def __init__(self, max_running: int = MAX_INTROSPECTIONS) -> None:
        self._cache: dict[tuple[Any, ...], ParserSpec] = {}
        self._flights: dict[tuple[Any, ...], _Flight] = {}
        self._turns = asyncio.Semaphore(max_running)

    async def _run(
        self, argv: list[str], timeout_s: float, env: dict[str, str]
    ) -> tuple[int, str, str]:
        async with self._turns:
            return await self._run_now(argv, timeout_s, env)

    async def _run_now(
        self, argv: list[str], timeout_s: float, env: dict[str, str]
    ) -> tuple[int, str, str]:
        # Cancelled (a stop, the daemon's shutdown): its group is killed before this raises.
        result = await run_helper(argv, env=env, timeout_s=timeout_s)
        if result.timed_out:
            return -1, "", f"no answer within {timeout_s:g} s"
        return result.returncode, result.stdout, result.stderr

    async def parser_for(self, cfg: ResolvedConfig) -> tuple[ParserSpec | None, list[str]]:
        """The server's options, and warnings about how they were obtained.

        Callers that ask while the same server's options are being learned wait for that one
        build. A caller cancelled (a stop, the shutdown) stops waiting; the build is cancelled,
        its process group killed, once nobody waits for it."""
        cli = split_command(cfg.argv)
        env = cfg.process_env(os.environ)
        key = (tuple(cli.program), _version_flags(cli.args), frozenset(env.items()))
        flight = self._flights.get(key)
        if flight is None:
            flight = _Flight(asyncio.ensure_future(self._learn(cli, env)))
            self._flights[key] = flight
            flight.task.add_done_callback(lambda _: self._landed(key, flight))
        flight.waiters += 1
        try:
            spec, warnings = await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                self._landed(key, flight)  # a caller from now on starts afresh
                flight.task.cancel()
                await asyncio.wait([flight.task])  # its process is gone before we go on
            raise
        flight.waiters -= 1
        return spec, list(warnings)

    def _landed(self, key: tuple[Any, ...], flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]

    async def _learn(
        self, cli: ServerCli, env: dict[str, str]
    ) -> tuple[ParserSpec | None, list[str]]:
        warnings: list[str] = []
        interp = server_interpreter(cli, env.get("PATH"))
        if cli.module in _SCRIPTS and interp is not None:
            vflags = _version_flags(cli.args)
            try:
                stamp = Path(interp).resolve().stat().st_mtime_ns  # noqa: ASYNC240 - one stat
            except OSError:
                stamp = 0
            # The package version is part of the key: ask the interpreter (cheap), then cache.
            probe = f"import importlib.metadata as m; print(m.version({_PACKAGES[cli.module]!r}))"
            code, ver, _ = await self._run([interp, "-c", probe], 30, env)
            key: tuple[Any, ...] = (interp, stamp, cli.module, ver.strip(), vflags)
            if code == 0 and key in self._cache:
                return self._cache[key], warnings
            version_arg = list(vflags[-1:])
            if cli.module == "gpuwarden.standin" and not version_arg:
                version_arg = ["0.5.23"]
            code, out, err = await self._run(
                [interp, "-c", _SCRIPTS[cli.module], *version_arg], INTROSPECT_TIMEOUT_S, env
            )
            if code == 0:
                try:
                    data = json.loads(out.strip().splitlines()[-1])
                    spec = ParserSpec(
                        prog=data["prog"],
                        version=data["version"],
                        options=[OptionSpec.from_json(o) for o in data["options"]],
                        exact=True,
                    )
                    self._cache[key] = spec
                    return spec, warnings
                except (ValueError, KeyError, IndexError) as exc:
                    warnings.append(
                        f"could not read the server's parser dump ({exc}); using --help"
                    )
            else:
                last = (err.strip().splitlines() or ["(no output)"])[-1]
                warnings.append(
                    f"{interp} cannot build {cli.module}'s parser ({last}); using --help"
                )
        if cli.module not in _SCRIPTS:
            program = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(cli.program))
            return None, [
                f"`{program}` is neither SGLang nor the stand-in: preflight does not run it, "
                "so its argv was not checked"
            ]
        # Rebuild from the server's --help.
        key = ("help", *cli.program, _version_flags(cli.args))
        if key in self._cache:
            spec = self._cache[key]
            return spec, [*warnings, "options rebuilt from --help: value types are not checked"]
        code, out, err = await self._run(
            [*cli.program, *_help_extra(cli.args), "--help"], INTROSPECT_TIMEOUT_S, env
        )
        options = [o for o in parse_help(out) if o.kind != KIND_HELP]
        if code != 0 or not options:
            program = " ".join(cli.program)
            why = (err.strip().splitlines() or [f"exit {code}"])[-1]
            return None, [
                *warnings,
                f"`{program} --help` gave no options ({why}); the argv was not checked",
            ]
        prog = cli.program[-1]
        if "usage: " in out:
            prog = out.split("usage: ", 1)[1].split(" [", 1)[0].strip()
        spec = ParserSpec(prog=prog, version="", options=options, exact=False)
        self._cache[key] = spec
        return spec, [*warnings, "options rebuilt from --help: value types are not checked"]


def server_interpreter(cli: ServerCli, path: str | None) -> str | None:
    """The Python that runs a server command, found on `path`: `python -m MODULE`'s, a
    `sglang serve` console script's (its own Python builds the same parser), `python
    script.py`'s. None for any other program."""
    interp = cli.interpreter
    if interp is None and cli.module == "sglang.launch_server":
        interp = script_interpreter(cli.program[0], path)
    elif interp is None and Path(cli.program[0]).name.startswith("python"):
        interp = cli.program[0]
    return (shutil.which(interp, path=path) or interp) if interp else None


def interpreter_of(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The Python that runs the server argv `argv` in `env` (see `server_interpreter`)."""
    return server_interpreter(split_command(argv), env.get("PATH"))


def script_interpreter(program: str, path: str | None) -> str | None:
    """The Python of a console script (`#!/venv/bin/python3.11`), or None."""
    found = shutil.which(program, path=path) or program
    try:
        with open(found, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if words and Path(words[0]).name == "env" and len(words) > 1:
        words = words[1:]  # #!/usr/bin/env python3
    return words[0] if words and Path(words[0]).name.startswith("python") else None


def _version_flags(args: Sequence[str]) -> tuple[str, ...]:
    """Flags that select the parser itself (the stand-in's --standin-version)."""
    out: list[str] = []
    for i, a in enumerate(args):
        if a == "--standin-version" and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith("--standin-version="):
            out.append(a.split("=", 1)[1])
    return tuple(out)


def _help_extra(args: Sequence[str]) -> list[str]:
    flags = _version_flags(args)
    return ["--standin-version", flags[-1]] if flags else []
