"""Secret redaction: one place decides what is a secret and how it is masked.

Secrets are the values of ``--api-key``-like flags, of environment variables whose names
contain TOKEN, KEY, SECRET or PASSWORD, webhook URLs, and the same values wherever they appear
inside text (SGLang prints ``server_args=ServerArgs(... api_key='sk-...')`` in its first line).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
# Whole segments of a flag's name: --api-key, --admin-api-key, --hf-token, --ssl-keyfile-password
# (not --speculative-num-draft-tokens or --max-total-tokens).
_SECRET_FLAGS = re.compile(
    r"^--?(?:[\w]+-)*(?:api-key|apikey|token|secret|password|passwd)(?:-[\w]+)*$", re.I
)
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


def is_secret_flag(flag: str) -> bool:
    return bool(_SECRET_FLAGS.match(flag))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (MASK if is_secret_name(k) else v) for k, v in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Mask the value after a secret flag (``--api-key X``) and in ``--api-key=X``."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag.startswith("-") and is_secret_flag(flag):
            if eq:
                out.append(f"{flag}={MASK}")
            else:
                out.append(arg)
                mask_next = True
            continue
        out.append(arg)
    return out


def secret_values(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The literal secret strings of a launch, to be masked wherever they appear."""
    values: list[str] = []
    for i, arg in enumerate(argv):
        flag, eq, val = arg.partition("=")
        if flag.startswith("-") and is_secret_flag(flag):
            if eq and val:
                values.append(val)
            elif i + 1 < len(argv):
                values.append(argv[i + 1])
    values += [v for k, v in env.items() if is_secret_name(k) and v]
    # Longest first, so a secret that contains another is masked whole.
    return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)


class Redactor:
    """Masks known secret values and secret-looking ``key=value`` pairs in text."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

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
