"""Secret redaction: one place decides what is a secret and how it is masked.

Secrets are the values of ``--api-key``-like flags, of environment variables whose names
contain TOKEN, KEY, SECRET or PASSWORD, webhook URLs, and the same values wherever they appear
inside text (SGLang prints ``server_args=ServerArgs(... api_key='sk-...')`` in its first line).

A flag is judged by the option the server's parser resolves it to, since that is what the
server acts on: argparse accepts ``--api-k sk-...`` and ``--api-k=sk-...`` as ``--api-key``.
For SGLang and the stand-in the parser is known (the bundled table of SGLang 0.5.23's options);
for any other program, flags are matched by name and by prefix of well-known secret options.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from gpuwarden.standin.argspec import OptionSpec, option_strings, split_command

MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
# The last segment of a flag's name says what its value is: --api-key, --admin-api-key,
# --hf-token, --ssl-keyfile-password carry credentials; --speculative-token-map (a path),
# --ssl-keyfile (a path) and --max-total-tokens (a count) do not.
_SECRET_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "passphrase", "credentials"}
)
# "token" also counts tokens: --kt-max-deferred-experts-per-token, --bucket-time-to-first-token.
_COUNTING = frozenset({"per", "first", "last", "each", "next", "max", "min", "num"})
# With no parser to resolve abbreviations, a flag that abbreviates one of these is a secret.
_WELL_KNOWN_SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password", "--hf-token")
# Programs whose parser is SGLang's (the stand-in copies SGLang's options).
PARSER_KNOWN_MODULES = frozenset({"sglang.launch_server", "gpuwarden.standin"})
# key='value' / key="value" / key=value inside text, for secret-looking keys (api_key, hf_token,
# ...). `=` only: `#token: 86` in SGLang's batch lines is a count, and `num_tokens` is no secret.
_INLINE = re.compile(
    r"""(?P<key>(?<![\w#-])(?:[\w-]*[_-])?(?:api[_-]?key|token|secret|password|passwd))"""
    r"""(?P<sep>\s*=\s*)(?P<q>['"]?)(?P<val>[^'"\s,)]+)(?P=q)""",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def is_secret_option(option: str) -> bool:
    """Whether a full option name (not an abbreviation) names a credential."""
    segments = [s for s in option.lstrip("-").lower().replace("_", "-").split("-") if s]
    if not segments or segments[-1] not in _SECRET_WORDS:
        return False
    return not (segments[-1] == "token" and len(segments) > 1 and segments[-2] in _COUNTING)


@cache
def sglang_option_strings() -> frozenset[str]:
    """Every option string of SGLang 0.5.23's parser (the stand-in's bundled table)."""
    table = resources.files("gpuwarden.standin").joinpath("data/options-0.5.23.json")
    options = json.loads(table.read_text())["options"]
    return frozenset(option_strings(OptionSpec.from_json(o) for o in options))


@dataclass(frozen=True)
class ArgvSecrets:
    """Which flags of a program's argv carry secrets.

    `options` are the option strings of the program's parser (None: unknown). With a parser, a
    flag is what argparse resolves it to: an exact option string, else (with `allow_abbrev`)
    the options it is a prefix of. An ambiguous prefix, which argparse refuses, is a secret if
    any option it may stand for is: the value was meant for that option. A flag the parser does
    not know, and every flag of an unknown parser, is judged by its name and by whether it
    abbreviates a well-known secret option.
    """

    options: frozenset[str] | None = None
    allow_abbrev: bool = True

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

    def _walk(self, argv: Sequence[str]) -> Iterator[tuple[str, str | None]]:
        """Each arg with the flag whose value it holds: the arg after a secret flag comes with
        "" (all of it is the secret), ``--flag=secret`` with its flag; others with None."""
        after_flag = False
        for arg in argv:
            if after_flag:
                after_flag = False
                yield arg, ""
                continue
            flag, eq, _ = arg.partition("=")
            if self.is_secret(flag):
                after_flag = not eq
                yield arg, (flag if eq else None)
                continue
            yield arg, None

    def redact(self, argv: Sequence[str]) -> list[str]:
        """Mask the value after a secret flag (``--api-key X``) and in ``--api-key=X``."""
        return [
            arg if flag is None else f"{flag}={MASK}" if flag else MASK
            for arg, flag in self._walk(argv)
        ]

    def values(self, argv: Sequence[str]) -> list[str]:
        """The secret values of an argv."""
        return [
            arg[len(flag) + 1 :] if flag else arg
            for arg, flag in self._walk(argv)
            if flag is not None
        ]


def argv_secrets(argv: Sequence[str], parser_known: bool = True) -> ArgvSecrets:
    """The policy for a server's argv: SGLang's parser for SGLang and the stand-in (unless the
    config says the parser cannot be read), else names only."""
    if parser_known and argv and split_command(argv).module in PARSER_KNOWN_MODULES:
        return ArgvSecrets(sglang_option_strings())
    return ArgvSecrets(None)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) else v) for k, v in env.items()}


def secret_values(argv: Sequence[str], env: Mapping[str, str], policy: ArgvSecrets) -> list[str]:
    """The literal secret strings of a launch, to be masked wherever they appear."""
    values = policy.values(argv)
    values += [v for k, v in env.items() if v and is_secret_name(k)]
    # Longest first, so a secret that contains another is masked whole.
    return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)


class Redactor:
    """Masks known secret values and secret-looking ``key=value`` pairs in text."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    @property
    def secrets(self) -> list[str]:
        return list(self._secrets)

    def add(self, secrets: Iterable[str]) -> None:
        self._secrets = sorted({*self._secrets, *(s for s in secrets if s)}, key=len, reverse=True)

    def text(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        # Each pattern needs a literal the line rarely has; a substring test is some 50 times
        # cheaper than the scan (every streamed line is redacted, once per client).
        if "=" in text:
            text = _INLINE.sub(self._mask_inline, text)
        if "bearer" in text.lower():
            text = _BEARER.sub(r"\1" + MASK, text)
        return text

    @staticmethod
    def _mask_inline(m: re.Match[str]) -> str:
        if m.group("val") in (MASK, "None", "null"):
            return m.group(0)
        return f"{m.group('key')}{m.group('sep')}{m.group('q')}{MASK}{m.group('q')}"
