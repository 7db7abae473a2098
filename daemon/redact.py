"""Secret redaction: one place decides what is a secret and how it is masked.

Secrets are the values of flags and environment variables with secret names (one rule for both,
`is_secret_name`), the password of any URL's userinfo (``https://user:PASS@host``), webhook
URLs, and the same values wherever they appear inside text (SGLang prints
``server_args=ServerArgs(... api_key='sk-...')`` in its first line).

A flag is judged by the option the server's parser resolves it to, since that is what the
server acts on: argparse accepts ``--api-k sk-...`` and ``--api-k=sk-...`` as ``--api-key``.
For SGLang and the stand-in the parser is known (the bundled table of SGLang 0.5.23's options);
for any other program, flags are matched by name and by prefix of well-known secret options.
Wrapped commands are looked into: ``sh -c "..."`` strings, ``NAME=VALUE`` arguments (``env``,
``docker run -e``) and ``--env=NAME=VALUE``.

An earlier launch's log is masked with what that launch ran with, though its config may since
have changed: each launch records keyed digests of its secrets (`fingerprints`), never the
secrets, and `Redactor` masks any word-bounded stretch of text whose digest is one of them.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import PurePath
from typing import Any
from urllib.parse import unquote

from gpuwarden.standin.argspec import Nargs, OptionSpec, option_strings, split_command

MASK = "***"
# One rule for every name (flag, environment variable, key in text), by its segments
# (split at -, _ and .): the LAST segment names what the value is: --api-key, HF_TOKEN,
# GITHUB_PAT, API_KEYS carry credentials; --speculative-token-map (a path), --ssl-keyfile (a
# path) and --max-total-tokens (a count) do not. A segment that ends in "key" or "token" counts
# (HFTOKEN, APIKEY). Some words make any name a secret wherever they stand: AWS_CREDENTIALS,
# DB_PASSWORD_VALUE, HTTP_AUTH_HEADER, AUTH; and a webhook's URL is its secret.
_LAST_WORDS = frozenset({"key", "keys", "apikey", "token", "pat"})
_ANY_WORDS = frozenset(
    {"secret", "password", "passwd", "passphrase", "credential", "credentials", "auth"}
)
# "token" also counts tokens: --kt-max-deferred-experts-per-token, --bucket-time-to-first-token.
_COUNTING = frozenset({"per", "first", "last", "each", "next", "max", "min", "num"})
_SEGMENT_SPLIT = re.compile(r"[-_.]+")
# With no parser to resolve abbreviations, a flag that abbreviates one of these is a secret.
_WELL_KNOWN_SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password", "--hf-token")
# Programs whose parser is SGLang's (the stand-in copies SGLang's options).
PARSER_KNOWN_MODULES = frozenset({"sglang.launch_server", "gpuwarden.standin"})
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash"})
# key='value', key="value", key=value, key: value inside text, for keys that contain a secret
# word (the callback applies `is_secret_name` to the whole key). `#token: 86` in SGLang's batch
# lines is a count: a key right after `#`, `-` or a word character is no key (`#new-token: 5`).
_INLINE = re.compile(
    r"""(?P<key>(?<![\w#.-])[\w.-]*?(?:key|token|pat|secret|passw|passphrase|credential|auth|"""
    r"""webhook[_-]?url)[\w.-]*)(?P<kq>['"]?)(?P<sep>\s*[=:]\s*)"""
    r"""(?P<q>['"]?)(?P<val>[^'"\s,)}]+)(?P=q)""",
    re.IGNORECASE,
)
# One of these is in every key `_INLINE` matches (most lines have a `:`, few these words).
_INLINE_WORDS = (
    "key",
    "token",
    "pat",
    "secret",
    "passw",
    "phrase",
    "credential",
    "auth",
    "webhook",
)
_BEARER = re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
# scheme://user:PASSWORD@host: the password up to the authority's last `@`.
_URL_PASSWORD = re.compile(
    r"""(?P<pre>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:'"]*:)(?P<pw>[^\s/?#'"]*)(?=@)"""
)
_ENV_ASSIGNMENT = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<val>.*)$", re.DOTALL)
_SHELL_OPERATOR = re.compile(r"^[;&|()<>]+$")
_FLAG_VALUE = object()  # marks an arg that is wholly a secret flag's value


def is_secret_name(name: str) -> bool:
    """Whether a name (a flag's, an environment variable's, a key in text) names a secret."""
    segments = [s for s in _SEGMENT_SPLIT.split(name.lower()) if s]
    if not segments:
        return False
    if any(s in _ANY_WORDS for s in segments):
        return True
    if "webhook" in segments:  # SLACK_WEBHOOK_URL, --webhook
        after = segments[segments.index("webhook") + 1 :]
        if not after or after[0] in ("url", "uri"):
            return True
    last = segments[-1]
    if last in _LAST_WORDS or last.endswith(("key", "token")):
        return not (len(segments) > 1 and segments[-2] in _COUNTING)
    return False


def is_secret_option(option: str) -> bool:
    """Whether a full option name (not an abbreviation) names a credential."""
    return is_secret_name(option.lstrip("-"))


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


def mask_url_passwords(text: str) -> str:
    """``scheme://user:PASS@host`` -> ``scheme://user:***@host``."""
    if "://" not in text:
        return text
    return _URL_PASSWORD.sub(lambda m: m.group("pre") + MASK, text)


def url_passwords(text: str) -> list[str]:
    """The passwords of the URLs in `text`, as written and percent-decoded."""
    if "://" not in text:
        return []
    found = [m.group("pw") for m in _URL_PASSWORD.finditer(text) if m.group("pw")]
    return [*found, *(unquote(p) for p in found)]


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


def longest_first(values: Iterable[str]) -> list[str]:
    """Distinct secrets of 4 characters or more, longest first (a secret that contains another
    is masked whole); shorter ones would mask ordinary words."""
    return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)


# -- An earlier launch's secrets, by keyed digest ---------------------------------------------

_ALNUM_RUN = re.compile(r"[A-Za-z0-9]+")


def digest(salt: bytes, value: str) -> str:
    return hashlib.blake2b(value.encode(), key=salt, digest_size=16).hexdigest()


def fingerprints(salt: bytes, secrets: Iterable[str]) -> list[list[Any]]:
    """What a launch record keeps of its secrets: ``[length, keyed digest]`` each, never the
    secret (the key, `salt`, is the install's own, kept 0600 in the state dir)."""
    return [[len(s), digest(salt, s)] for s in longest_first(secrets)]


@dataclass(frozen=True)
class Fingerprints:
    salt: bytes
    digests: frozenset[tuple[int, str]]

    @classmethod
    def of(cls, salt: bytes, recorded: Any) -> Fingerprints | None:
        """From a launch record's list (None when it has none, or is malformed)."""
        if not isinstance(recorded, list):
            return None
        found = {
            (int(item[0]), str(item[1]))
            for item in recorded
            if isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], int)
            and 4 <= item[0] <= 4096
            and isinstance(item[1], str)
        }
        return cls(salt, frozenset(found)) if found else None

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where a recorded secret stands in `text`: windows of a recorded length that start
        and end at a word's edge (never inside a run of letters and digits) and whose digest
        was recorded."""
        lengths = sorted({n for n, _ in self.digests if n <= len(text)}, reverse=True)
        if not lengths:
            return []
        starts: set[int] = set()
        ends: set[int] = set()
        last = 0
        for m in _ALNUM_RUN.finditer(text):
            # every position between runs is an edge, and the runs' own ends
            starts.update(range(last, m.start() + 1))
            ends.update(range(last, m.start() + 1))
            ends.add(m.end())
            last = m.end()
        starts.update(range(last, len(text) + 1))
        ends.update(range(last, len(text) + 1))
        found: list[tuple[int, int]] = []
        taken_until = -1
        for start in sorted(starts):
            if start < taken_until:
                continue
            for n in lengths:
                end = start + n
                if end in ends and (n, digest(self.salt, text[start:end])) in self.digests:
                    found.append((start, end))
                    taken_until = end
                    break
        return found

    def mask(self, text: str) -> str:
        for start, end in reversed(self.spans(text)):
            text = text[:start] + MASK + text[end:]
        return text


class Redactor:
    """Masks known secret values, an earlier launch's secrets known by their digests, URLs'
    passwords and secret-looking ``key=value`` / ``key: value`` pairs in text."""

    def __init__(
        self, secrets: Iterable[str] = (), fingerprints: Fingerprints | None = None
    ) -> None:
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
        self._fingerprints = fingerprints

    @property
    def secrets(self) -> list[str]:
        return list(self._secrets)

    def add(self, secrets: Iterable[str]) -> None:
        self._secrets = sorted({*self._secrets, *(s for s in secrets if s)}, key=len, reverse=True)

    def text(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        if self._fingerprints is not None:
            text = self._fingerprints.mask(text)
        # Each pattern needs a literal the line rarely has; a substring test is some 50 times
        # cheaper than the scan (every streamed line is redacted, once per client).
        if "://" in text:
            text = mask_url_passwords(text)
        low = text.lower()
        if ("=" in text or ":" in text) and any(w in low for w in _INLINE_WORDS):
            text = _INLINE.sub(self._mask_inline, text)
        if "bearer" in low:
            text = _BEARER.sub(r"\1" + MASK, text)
        return text

    @staticmethod
    def _mask_inline(m: re.Match[str]) -> str:
        if m.group("val") in (MASK, "None", "null") or not is_secret_name(m.group("key")):
            return m.group(0)
        return f"{m.group('key')}{m.group('kq')}{m.group('sep')}{m.group('q')}{MASK}{m.group('q')}"
