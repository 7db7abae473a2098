"""Argument specs: a server's argparse options as data.

One representation (`OptionSpec`) serves two purposes:

* rebuilding a server's option set from its ``--help`` text (argparse's own format; types are
  then unknown);
* building an equivalent parser from a list of specs, so that a config's argv can be checked
  with the server's own rules (abbreviations, nargs, choices) without starting the server.

Stdlib only: the stand-in imports this in its main process, and the daemon's preflight and
redactor take it from the stand-in, the layer below them.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# nargs as argparse spells it: None (one value), an int, or one of '?', '*', '+'.
Nargs = int | str | None

KIND_STORE = "store"
KIND_FLAG = "store_true"
KIND_BOOL_PAIR = "boolean_optional"  # argparse.BooleanOptionalAction: --x / --no-x
KIND_HELP = "help"

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class OptionSpec:
    """One optional argument: its option strings (primary first) and how it takes values."""

    strings: tuple[str, ...]
    kind: str = KIND_STORE
    nargs: Nargs = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    type: str | None = None  # "int" | "float" | "str" | None (unknown)
    dest: str = ""
    default: Any = None
    help: str | None = None
    required: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def primary(self) -> str:
        return self.strings[0]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["strings"] = list(self.strings)
        data["choices"] = list(self.choices) if self.choices is not None else None
        return {k: v for k, v in data.items() if v not in (None, {}, "", False) or k == "strings"}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OptionSpec:
        choices = data.get("choices")
        return cls(
            strings=tuple(data["strings"]),
            kind=data.get("kind", KIND_STORE),
            nargs=data.get("nargs"),
            choices=tuple(choices) if choices is not None else None,
            metavar=data.get("metavar"),
            type=data.get("type"),
            dest=data.get("dest", ""),
            default=data.get("default"),
            help=data.get("help"),
            required=bool(data.get("required", False)),
        )


def default_dest(strings: Sequence[str]) -> str:
    """argparse's rule: the first long option string, dashes to underscores."""
    longs = [s for s in strings if s.startswith("--")]
    name = (longs or list(strings))[0].lstrip("-")
    return name.replace("-", "_")


# --------------------------------------------------------------------------------------------
# From --help text
# --------------------------------------------------------------------------------------------

_OPTION_LINE = re.compile(r"^  (-\S.*)$")
_SPLIT_HELP = re.compile(r"\s{2,}")


def _split_top_level(invocation: str) -> list[str]:
    """Split 'a X, --b X' on ', -' outside braces (choices contain commas)."""
    parts: list[str] = []
    depth = 0
    start = 0
    i = 0
    while i < len(invocation):
        ch = invocation[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0 and invocation.startswith(", -", i):
            parts.append(invocation[start:i])
            start = i + 2
            i += 2
            continue
        i += 1
    parts.append(invocation[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_arg_format(fmt: str) -> tuple[Nargs, tuple[str, ...] | None, str | None]:
    """Return (nargs, choices, metavar) for the text after an option string in --help."""
    fmt = fmt.strip()
    if not fmt:
        return 0, None, None
    choices: tuple[str, ...] | None = None
    brace = re.search(r"\{([^}]*)\}", fmt)
    if brace:
        choices = tuple(brace.group(1).split(","))
    # Normalise the metavar to a token so that the shapes are easy to recognise.
    token = re.sub(r"\{[^}]*\}", "M", fmt)
    shape = re.sub(r"[^\s\[\].]+", "M", token)
    metavar = None if brace else fmt.split()[0].strip("[]")
    if shape == "M":
        return None, choices, metavar
    if shape == "[M]":
        return "?", choices, metavar
    if shape == "[M ...]":
        return "*", choices, metavar
    if shape == "M [M ...]":
        return "+", choices, metavar
    words = shape.split()
    if all(w == "M" for w in words):
        return len(words), choices, metavar
    return None, choices, metavar


def _required_in_usage(text: str) -> set[str]:
    """Option strings the usage block shows outside brackets: the required ones."""
    if "usage:" not in text:
        return set()
    usage = text.split("usage:", 1)[1].split("\n\n", 1)[0]
    required: set[str] = set()
    depth = 0
    for token in re.findall(r"[\[\]{}]|[^\s\[\]{}]+", usage):
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
        elif depth == 0 and token.startswith("-"):
            required.add(token)
    return required


def parse_help(text: str) -> list[OptionSpec]:
    """Rebuild the optional arguments from argparse's --help output.

    The option listing gives names, aliases, nargs and choices (lines indented by two spaces
    that begin with '-'); the usage block tells which are required. Types are unknown.
    """
    required = _required_in_usage(text)
    specs: list[OptionSpec] = []
    for line in text.splitlines():
        m = _OPTION_LINE.match(line)
        if not m:
            continue
        invocation = _SPLIT_HELP.split(m.group(1), maxsplit=1)[0]
        parts = _split_top_level(invocation)
        strings: list[str] = []
        formats: list[str] = []
        for part in parts:
            name, _, fmt = part.partition(" ")
            strings.append(name)
            formats.append(fmt)
        if "--help" in strings or "-h" in strings:
            specs.append(OptionSpec(strings=tuple(strings), kind=KIND_HELP, nargs=0))
            continue
        nargs, choices, metavar = _parse_arg_format(formats[0])
        kind = KIND_FLAG if nargs == 0 else KIND_STORE
        if nargs == 0 and len(strings) == 2 and strings[1] == "--no-" + strings[0][2:]:
            kind = KIND_BOOL_PAIR
            strings = [strings[0]]
        specs.append(
            OptionSpec(
                strings=tuple(strings),
                kind=kind,
                nargs=nargs,
                choices=choices,
                metavar=metavar,
                dest=default_dest(strings),
                required=bool(required & set(strings)),
            )
        )
    return specs


# --------------------------------------------------------------------------------------------
# Specs to a parser
# --------------------------------------------------------------------------------------------


def add_specs(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    specs: Iterable[OptionSpec],
    types: dict[str, type] | None = None,
    defaults: dict[str, Any] | None = None,
    helps: dict[str, str] | None = None,
) -> None:
    """Add `specs` to `parser`. `types` and `defaults` are keyed by dest and win over the spec."""
    types = types or {}
    defaults = defaults or {}
    helps = helps or {}
    for spec in specs:
        if spec.kind == KIND_HELP:
            continue
        dest = spec.dest or default_dest(spec.strings)
        kwargs: dict[str, Any] = {"dest": dest}
        if dest in defaults:
            kwargs["default"] = defaults[dest]
        if spec.required:
            kwargs["required"] = True
        if dest in helps:
            kwargs["help"] = helps[dest]
        elif spec.help:
            kwargs["help"] = spec.help
        if spec.kind == KIND_FLAG:
            parser.add_argument(*spec.strings, action="store_true", **kwargs)
            continue
        if spec.kind == KIND_BOOL_PAIR:
            parser.add_argument(*spec.strings, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        py_type = types.get(dest) or (_TYPES.get(spec.type) if spec.type else None)
        if py_type is not None:
            kwargs["type"] = py_type
        if spec.nargs is not None:
            kwargs["nargs"] = spec.nargs
        if spec.choices is not None:
            choices: list[Any] = list(spec.choices)
            if py_type in (int, float):
                choices = [py_type(c) for c in choices]
            kwargs["choices"] = choices
        if spec.metavar and spec.choices is None:
            kwargs["metavar"] = spec.metavar
        parser.add_argument(*spec.strings, **kwargs)


def option_strings(specs: Iterable[OptionSpec]) -> set[str]:
    """Every option string the specs accept (the --no- forms of boolean pairs included)."""
    out: set[str] = set()
    for spec in specs:
        out.update(spec.strings)
        if spec.kind == KIND_BOOL_PAIR:
            out.update("--no-" + s[2:] for s in spec.strings if s.startswith("--"))
    return out


# --------------------------------------------------------------------------------------------
# Where a command's program ends and its arguments begin
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerCli:
    """Where a config's server program ends and its arguments begin."""

    interpreter: str | None  # for `python -m module` commands
    module: str | None
    program: list[str]  # the argv prefix that runs the server
    args: list[str]


def split_command(argv: Sequence[str]) -> ServerCli:
    argv = list(argv)
    exe = Path(argv[0]).name
    if exe.startswith("python") and len(argv) >= 3 and argv[1] == "-m":
        return ServerCli(argv[0], argv[2], argv[:3], argv[3:])
    if exe == "sglang" and len(argv) >= 2 and argv[1] == "serve":
        return ServerCli(None, "sglang.launch_server", argv[:2], argv[2:])
    if exe.startswith("python") and len(argv) >= 2 and not argv[1].startswith("-"):
        return ServerCli(None, None, argv[:2], argv[2:])  # python script.py ...
    return ServerCli(None, None, argv[:1], argv[1:])
