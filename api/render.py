"""What the CLI prints for people: aligned tables, human durations, colour on a terminal.

Standard library only (the CLI starts in milliseconds): colour is ANSI, and only where the
stream is a terminal, `NO_COLOR` is unset and `TERM` is not `dumb`; piped output is plain.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import IO, Any

RESET = "\x1b[0m"
# C0 controls but the tab, DEL, and C1 controls (U+0080-U+009F: U+009B is a CSI on its own)
CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")
STYLES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}
STATE_STYLE = {
    "ready": "green",
    "starting": "yellow",
    "waiting_gpu": "yellow",
    "stopping": "yellow",
    "backoff": "yellow",
    "unhealthy": "red",
    "failed": "red",
    "stopped": "dim",
}


def colour_on(stream: IO[str]) -> bool:
    """Colour for `stream`: a terminal, and the user has not asked for none."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except ValueError:  # a closed stream
        return False


def paint(text: str, style: str | None, on: bool) -> str:
    if not on or not style:
        return text
    codes = ";".join(STYLES[s] for s in style.split())
    return f"\x1b[{codes}m{text}{RESET}"


def state_text(state: str, on: bool) -> str:
    return paint(state, STATE_STYLE.get(state), on)


def visible_len(text: str) -> int:
    """The width of `text` on screen: its length without the colour codes."""
    n, i = 0, 0
    while i < len(text):
        if text[i] == "\x1b":
            end = text.find("m", i)
            i = len(text) if end < 0 else end + 1
            continue
        n += 1
        i += 1
    return n


def table(rows: Sequence[Sequence[str]], headers: Sequence[str] = (), on: bool = False) -> str:
    """Rows as aligned columns two spaces apart; the last column is never padded. Headers,
    when given and not all empty, come first in bold."""
    all_rows = [list(r) for r in rows]
    if any(headers):
        all_rows.insert(0, [paint(h, "bold", on) for h in headers])
    if not all_rows:
        return ""
    ncols = max(len(r) for r in all_rows)
    widths = [0] * ncols
    for r in all_rows:
        for i, cell in enumerate(r[:-1]):
            widths[i] = max(widths[i], visible_len(cell))
    lines = []
    for r in all_rows:
        cells = [c + " " * (widths[i] - visible_len(c)) for i, c in enumerate(r[:-1])]
        lines.append("  ".join([*cells, r[-1]] if r else []).rstrip())
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """`8s`, `4m 05s`, `3h 12m`, `2d 4h`: the two largest units, as uptime shows them."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def seconds_until(iso: str | None, now: datetime | None = None) -> float | None:
    """Seconds from now to an ISO time the daemon sent (negative: in the past)."""
    if not iso:
        return None
    try:
        at = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return (at - (now or datetime.now(UTC))).total_seconds()


def ago(iso: str | None) -> str:
    """`12m 03s ago` for a past ISO time; `-` when there is none."""
    left = seconds_until(iso)
    return "-" if left is None else f"{duration(-left)} ago"


def fit(text: str, width: int | None = None) -> str:
    """One line no wider than the terminal (for a line rewritten in place)."""
    width = width or shutil.get_terminal_size((100, 24)).columns
    text = text.replace("\r", " ").replace("\n", " ")
    return text if len(text) < width else text[: max(0, width - 2)] + "…"


def safe(text: str) -> str:
    """`text` with its control characters (all but the tab) written out as `\\xNN`: a server's
    line can carry escape sequences that would rewrite the terminal (its title, the screen,
    the clipboard), and printed raw they would. Applied to every line of a log, an event or a
    dump the CLI prints as text, terminal or not (`--json` escapes them already)."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


# A start's phases (`/status` `phase` and `startup`), as people say them.
PHASE_LABELS = {
    "init": "initialising",
    "weights": "loading weights",
    "kv_cache": "allocating the KV cache",
    "cuda_graphs": "capturing CUDA graphs",
    "warmup": "warming up",
}


def phase_text(phase: dict[str, Any] | None) -> str | None:
    """`loading weights 12s · ready in ~40s` (no ETA before a launch of the config was ready)."""
    if not phase:
        return None
    name = str(phase.get("name"))
    elapsed = phase.get("elapsed_s")
    elapsed = float(elapsed) if isinstance(elapsed, int | float) else 0.0
    text = f"{PHASE_LABELS.get(name, safe(name))} {short(elapsed)}"
    eta = phase.get("eta_s")
    if isinstance(eta, int | float):
        text += f" · ready in ~{short(eta)}"
    return text


def size(n: float) -> str:
    """`48 MiB`, `3.4 GiB`."""
    mib = n / 1024**2
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def prewarm_text(prewarm: Any) -> str | None:
    """`pre-warm 1.2 GiB/3.4 GiB read · 512 MiB cached` (a swap's read of the next weights),
    with how it ended once it has."""
    if not isinstance(prewarm, dict):
        return None
    read, total, cached = (prewarm.get(k) for k in ("read_bytes", "total_bytes", "cached_bytes"))
    if not (isinstance(read, int) and isinstance(total, int) and isinstance(cached, int)):
        return None
    text = f"pre-warm {size(read)}/{size(max(0, total - cached))} read"
    if cached:
        text += f" · {size(cached)} cached"
    state = prewarm.get("state")
    if state != "reading":
        text += f" · {safe(str(state))}"
    return text


def short(seconds: float) -> str:
    """`0.8s`, `42.1s`, then as `duration` from a minute on."""
    return f"{max(0.0, seconds):.1f}s" if seconds < 60 else duration(seconds)


def startup_text(startup: dict[str, Any] | None) -> str | None:
    """`3.1s: init 1.2s, weights 0.8s, ...` (where a launch's start went)."""
    if not startup or not isinstance(startup.get("ready_s"), int | float):
        return None
    phases = startup.get("phases")
    phases = phases if isinstance(phases, dict) else {}
    parts = [
        f"{safe(str(k))} {short(float(v))}" for k, v in phases.items() if isinstance(v, int | float)
    ]
    return short(float(startup["ready_s"])) + (f": {', '.join(parts)}" if parts else "")


def proxy_text(proxy: Any) -> str | None:
    """The front proxy in a line: its address, what it does now, held requests, counts."""
    if not isinstance(proxy, dict):
        return None
    mode = {"open": "passing", "hold": "holding", "reject": "rejecting"}.get(
        str(proxy.get("mode")), str(proxy.get("mode"))
    )
    parts = [
        f"{proxy.get('listen')} {mode}" + ("" if proxy.get("connected") else " (not connected)")
    ]
    if proxy.get("held"):
        oldest = proxy.get("oldest_held_s")
        parts.append(f"{proxy['held']} held" + (f", oldest {short(oldest)}" if oldest else ""))
    counts = [
        f"{proxy.get(key)} {label}"
        for key, label in (
            ("released", "released"),
            ("rejected", "rejected"),
            ("retried", "retried"),
            ("continued", "continued"),
            ("cut", "cut"),
        )
        if proxy.get(key)
    ]
    if counts:
        parts.append(", ".join(counts))
    return safe(" · ".join(parts))
