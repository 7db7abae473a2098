"""SGLang's own account of a start: 0.5.23's `startup_time` in `GET /server_info` (seconds of
the slowest rank in each phase, and the whole start as its front end saw it), read once the
server serves. A server without it (an older SGLang, another program) answers otherwise: None.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import httpx

from .load import AnswerError, get_json
from .phases import seconds

if TYPE_CHECKING:
    from .resolvedconfig import ResolvedConfig

MAX_ANSWER_BYTES = 1 << 20  # SGLang's answer is a few KiB (its server_args)
TIMEOUT_S = 10.0
_FIELDS = ("load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e")


async def read(config: ResolvedConfig) -> dict[str, Any] | None:
    url = config.server_url("/server_info")
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
    out: dict[str, Any] = {
        k: round(s, 3) for k in _FIELDS if (s := seconds(value.get(k))) is not None
    }
    graphs = value.get("cuda_graph")
    if isinstance(graphs, dict):
        kept = {str(k)[:64]: round(s, 3) for k, v in graphs.items() if (s := seconds(v))}
        if kept:
            out["cuda_graph"] = dict(list(kept.items())[:16])
    return out or None
