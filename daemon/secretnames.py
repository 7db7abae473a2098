"""Which names name secrets: one rule for a flag's, an environment variable's and a key's in text.

A name is judged by its segments (split at ``-``, ``_`` and ``.``): the last names what the value
is. The launch's secrets (`launchsecrets`) and the masking of text (`redact`) both ask it.
"""

from __future__ import annotations

import re

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
