"""Masking secrets in text: known values, an earlier launch's secrets by digest, URLs' passwords.

Secrets are masked wherever they appear inside text (SGLang prints
``server_args=ServerArgs(... api_key='sk-...')`` in its first line), and so are URLs' passwords
(``https://user:PASS@host``), ``Bearer`` tokens and the values of secret-looking ``key=value`` /
``key: value`` pairs (their keys judged by `secretnames`). Which values of a launch are secrets:
`launchsecrets`.

An earlier launch's log is masked with what that launch ran with, though its config may since
have changed: each launch records keyed digests of its secrets (`fingerprints`), never the
secrets, and `Redactor` masks any word-bounded stretch of text whose digest is one of them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from .secretnames import is_secret_name

MASK = "***"
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
