"""A launch's secrets: which values of its argv and its environment are secrets.

Secrets are the values of flags and environment variables with secret names (`secretnames`), the
password of any URL's userinfo (``https://user:PASS@host``), and webhook URLs.

A flag is judged by the option the server's parser resolves it to, since that is what the
server acts on: argparse accepts ``--api-k sk-...`` and ``--api-k=sk-...`` as ``--api-key``.
For SGLang and the stand-in the parser is known (the bundled table of SGLang 0.5.23's options);
for any other program, flags are matched by name and by prefix of well-known secret options.
Wrapped commands are looked into: ``sh -c "..."`` strings, ``NAME=VALUE`` arguments (``env``,
``docker run -e``) and ``--env=NAME=VALUE``. How text that holds them is masked: `redact`.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import PurePath

from gpuwarden.standin.argspec import Nargs, OptionSpec, option_strings, split_command

from .redact import MASK, Redactor, longest_first, mask_url_passwords, url_passwords
from .secretnames import is_secret_name, is_secret_option

# With no parser to resolve abbreviations, a flag that abbreviates one of these is a secret.
_WELL_KNOWN_SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password", "--hf-token")
# Programs whose parser is SGLang's (the stand-in copies SGLang's options).
PARSER_KNOWN_MODULES = frozenset({"sglang.launch_server", "gpuwarden.standin"})
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash"})
_ENV_ASSIGNMENT = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<val>.*)$", re.DOTALL)
_SHELL_OPERATOR = re.compile(r"^[;&|()<>]+$")


@cache
def _sglang_specs() -> tuple[OptionSpec, ...]:
    table = resources.files("gpuwarden.standin").joinpath("data/options-0.5.23.json")
    return tuple(OptionSpec.from_json(o) for o in json.loads(table.read_text())["options"])


@cache
def sglang_option_strings() -> frozenset[str]:
    """Every option string of SGLang 0.5.23's parser (the stand-in's bundled table)."""
    return frozenset(option_strings(_sglang_specs()))


@cache
def sglang_option_nargs() -> Mapping[str, Nargs]:
    """The nargs of each option string of SGLang 0.5.23's parser that takes values."""
    return {s: spec.nargs for spec in _sglang_specs() if spec.kind == "store" for s in spec.strings}


def _assignment(arg: str) -> tuple[str, str] | None:
    """``NAME=VALUE`` when NAME is a secret name (``env HF_TOKEN=x``, ``docker run -e ...``)."""
    m = _ENV_ASSIGNMENT.match(arg)
    if m is None or not is_secret_name(m.group("name")):
        return None
    return m.group("name"), m.group("val")


@dataclass(frozen=True)
class ArgvSecrets:
    """Which flags of a program's argv carry secrets.

    `options` are the option strings of the program's parser (None: unknown). With a parser, a
    flag is what argparse resolves it to: an exact option string, else (with `allow_abbrev`)
    the options it is a prefix of. An ambiguous prefix, which argparse refuses, is a secret if
    any option it may stand for is: the value was meant for that option. A flag the parser does
    not know, and every flag of an unknown parser, is judged by its name and by whether it
    abbreviates a well-known secret option. How many args after a secret flag are its values:
    the option's nargs (`nargs`, with a parser), else every arg up to the next flag.
    """

    options: frozenset[str] | None = None
    allow_abbrev: bool = True
    nargs: Mapping[str, Nargs] | None = None

    def resolve(self, flag: str) -> list[str]:
        """The options `flag` may stand for (argparse's rules); empty when none."""
        if self.options is None:
            return []
        if flag in self.options:
            return [flag]
        if self.allow_abbrev and flag.startswith("--") and len(flag) > 2:
            return sorted(o for o in self.options if o.startswith(flag))
        return []

    def is_secret(self, flag: str) -> bool:
        if not flag.startswith("-") or flag in ("-", "--"):
            return False
        candidates = self.resolve(flag)
        if candidates:
            return any(is_secret_option(c) for c in candidates)
        return is_secret_option(flag) or (
            flag.startswith("--")
            and len(flag) > 2
            and any(s.startswith(flag) for s in _WELL_KNOWN_SECRET_FLAGS)
        )

    def _arity(self, flag: str) -> tuple[float, bool]:
        """(how many args at most are the values of a secret `flag`, whether a flag ends them)."""
        candidates = self.resolve(flag)
        if self.nargs is None or len(candidates) != 1 or candidates[0] not in self.nargs:
            return float("inf"), True
        nargs = self.nargs[candidates[0]]
        if nargs is None:
            return 1, False
        if isinstance(nargs, int):
            return nargs, False
        return (1, True) if nargs == "?" else (float("inf"), True)

    def _walk(self, argv: Sequence[str]) -> Iterator[tuple[str, list[str]]]:
        """Each arg as shown, with the secret values it holds."""
        owed, flag_ends = 0.0, False  # values still owed to a secret flag
        script_next = False
        shell = bool(argv) and PurePath(argv[0]).name in SHELLS
        for i, arg in enumerate(argv):
            is_flag = arg.startswith("-") and len(arg) > 1
            if owed and not (flag_ends and is_flag):
                owed -= 1
                yield MASK, [arg]
                continue
            owed = 0
            if script_next:
                script_next = False
                yield shell_script(arg)
                continue
            if shell and i > 0 and is_flag and not arg.startswith("--") and "c" in arg[1:]:
                script_next = True  # sh -c 'SCRIPT', bash -lc 'SCRIPT'
                yield arg, []
                continue
            flag, eq, rest = arg.partition("=")
            if is_flag and self.is_secret(flag):
                if eq:
                    yield f"{flag}={MASK}", [rest]
                else:
                    owed, flag_ends = self._arity(flag)
                    yield arg, []
                continue
            assigned = (
                _assignment(rest)
                if is_flag and eq
                else _assignment(arg[2:])
                if is_flag and not arg.startswith("--")
                else _assignment(arg)
            )
            if assigned is not None:
                name, value = assigned
                shown = arg[: len(arg) - len(value) - len(name) - 1]
                yield f"{shown}{name}={MASK}", [value]
                continue
            yield mask_url_passwords(arg), url_passwords(arg)

    def redact(self, argv: Sequence[str]) -> list[str]:
        """Mask the values of secret flags (``--api-key X``, ``--api-key=X``), of secret
        ``NAME=VALUE`` args, of URLs' passwords, and inside ``sh -c`` scripts."""
        return [shown for shown, _ in self._walk(argv)]

    def values(self, argv: Sequence[str]) -> list[str]:
        """The secret values of an argv."""
        return [v for _, values in self._walk(argv) for v in values if v]


def shell_script(script: str) -> tuple[str, list[str]]:
    """A ``sh -c`` script with its secrets masked, and the secrets: each simple command in it
    judged as an argv of its own."""
    try:
        lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: the shell refuses it too; mask what text would
        return Redactor().text(script), []
    shown: list[str] = []
    values: list[str] = []
    command: list[str] = []
    for token in [*tokens, ";"]:
        if _SHELL_OPERATOR.match(token):
            if command:
                policy = argv_secrets(command)
                shown += [_quoted(t) for t in policy.redact(command)]
                values += policy.values(command)
                command = []
            shown.append(token)
            continue
        command.append(token)
    masked = script
    for value in sorted({v for v in values if v}, key=len, reverse=True):
        # Quoted in a way no replacement finds, or too short to replace safely: re-quoted.
        if len(value) < 4 or value not in masked:
            return " ".join(shown[:-1]), values
        masked = masked.replace(value, MASK)
    return masked, values


def _quoted(word: str) -> str:
    """A word as the shell would need it, a mask in it left bare."""
    placeholder = "GPUWARDENMASKED"
    return shlex.quote(word.replace(MASK, placeholder)).replace(placeholder, MASK)


def argv_secrets(argv: Sequence[str], parser_known: bool = True) -> ArgvSecrets:
    """The policy for a server's argv: SGLang's parser for SGLang and the stand-in (unless the
    config says the parser cannot be read), else names only."""
    if parser_known and argv and split_command(argv).module in PARSER_KNOWN_MODULES:
        return ArgvSecrets(sglang_option_strings(), nargs=sglang_option_nargs())
    return ArgvSecrets(None)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) else mask_url_passwords(v)) for k, v in env.items()}


def secret_values(argv: Sequence[str], env: Mapping[str, str], policy: ArgvSecrets) -> list[str]:
    """The literal secret strings of a launch, to be masked wherever they appear."""
    values = policy.values(argv)
    for k, v in env.items():
        values += [v] if is_secret_name(k) else url_passwords(v)
    return longest_first(values)
