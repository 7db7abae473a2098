"""SGLang's own account of a start: 0.5.23's `startup_time` in `GET /server_info` (seconds of
the slowest rank in each phase, and the whole start as its front end saw it), read once the
server serves. A server without it (an older SGLang, another program) answers otherwise: None.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from .load import AnswerError, get_json

if TYPE_CHECKING:
    from .resolvedconfig import ResolvedConfig

MAX_ANSWER_BYTES = 1 << 20  # SGLang's answer is a few KiB (its server_args)
TIMEOUT_S = 10.0
_FIELDS = ("load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e")


async def read(config: ResolvedConfig) -> dict[str, Any] | None:
    parts = urlsplit(config.health_url)
    url = urlunsplit((parts.scheme, parts.netloc, "/server_info", "", ""))
    key = config.server_option("--api-key")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with contextlib.suppress(httpx.HTTPError, AnswerError, OSError, ValueError):
        async with httpx.AsyncClient(trust_env=False, headers=headers) as client:
            info = await get_json(client, url, limit=MAX_ANSWER_BYTES, timeout_s=TIMEOUT_S)
        return checked(info.get("startup_time") if isinstance(info, dict) else None)
    return None


def checked(value: Any) -> dict[str, Any] | None:
    """The figures of a `startup_time` answer that are figures (a server's answer is input:
    anything else is left out), or None where it has none."""
    if not isinstance(value, dict):
        return None
    out: dict[str, Any] = {k: round(float(value[k]), 3) for k in _FIELDS if _seconds(value.get(k))}
    graphs = value.get("cuda_graph")
    if isinstance(graphs, dict):
        kept = {str(k)[:64]: round(float(v), 3) for k, v in graphs.items() if _seconds(v) and v}
        if kept:
            out["cuda_graph"] = dict(list(kept.items())[:16])
    return out or None


def _seconds(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value < 1e7
    )
