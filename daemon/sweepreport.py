"""A sweep's record and its answer: the rows, the winner, and the files a user reads
(`table.md`, `table.csv`, `chart.png`, `result.json` under `state_dir/sweeps/ID/`).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden.daemon import logsetup

from .configs import ConfigStore
from .load import LoadSpec

log = logsetup.get_logger("gpuwarden.sweep")


@dataclass
class Sweep:
    id: str
    configs: list[str]
    baseline: str
    end_on: str | None
    load: LoadSpec
    folder: Path
    state: str = "running"  # running | done | cancelled | failed
    current: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    original: str | None = None
    restored: str | None = None
    started_at: float = field(default_factory=time.time)
    task: asyncio.Task[None] | None = None
    winner: str | None = None

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "done": len(self.rows),
            "total": len(self.configs),
            "current": self.current,
            "baseline": self.baseline,
            "original": self.original,
            "restored": self.restored,
            "winner": self.winner,
            "rows": self.rows,
            "folder": str(self.folder),
        }


# -- the answer -------------------------------------------------------------------------


def write_report(sweep: Sweep, configs: ConfigStore) -> None:
    """table.md, table.csv, result.json and chart.png in the sweep's folder."""
    sweep.folder.mkdir(parents=True, exist_ok=True)
    diff = _flags(sweep, configs)
    ok = [r for r in sweep.rows if r.get("status") == "ok" and r.get("tok_s")]
    sweep.winner = max(ok, key=lambda r: r["tok_s"])["config"] if ok else None
    base = next((r["tok_s"] for r in ok if r["config"] == sweep.baseline), None)
    (sweep.folder / "table.md").write_text(render_markdown(sweep, diff, base))
    (sweep.folder / "table.csv").write_text(render_csv(sweep, diff, base))
    (sweep.folder / "result.json").write_text(json.dumps(sweep.view(), indent=1, default=str))
    try:
        render_chart(sweep, base, sweep.folder / "chart.png")
    except Exception:
        log.exception("sweep.chart_failed", sweep_id=sweep.id)


def _flags(sweep: Sweep, configs: ConfigStore) -> dict[str, str]:
    """Each config's flags that differ from the baseline's."""
    out: dict[str, str] = {}
    try:
        base = configs.load(sweep.baseline).view()["config"]["args"]
    except Exception:
        return out
    for name in sweep.configs:
        try:
            args = configs.load(name).view()["config"]["args"]
        except Exception:
            out[name] = "(invalid config)"
            continue
        changed = [
            f"{k}={args.get(k, '-')}"
            for k in sorted(set(base) | set(args))
            if base.get(k) != args.get(k) and k not in ("port",)
        ]
        out[name] = " ".join(changed) if name != sweep.baseline else "(baseline)"
    return out


def _fmt(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


COLUMNS = (
    "config",
    "flags vs baseline",
    "tok/s",
    "vs baseline",
    "accept len",
    "TTFT p50 ms",
    "ITL p50 ms",
    "ok/failed",
    "status",
)


def _row_cells(r: dict[str, Any], diff: dict[str, str], base: float | None) -> list[str]:
    ratio = f"{r['tok_s'] / base:.2f}x" if base and r.get("tok_s") else "-"
    accept = r.get("server_accept_len") or r.get("avg_spec_accept_length")
    status = r.get("status", "")
    if status != "ok":
        status = f"{status}: {r.get('reason')}"
    return [
        r["config"],
        diff.get(r["config"], ""),
        _fmt(r.get("tok_s")),
        ratio,
        _fmt(accept, digits=2),
        _fmt(r.get("ttft_p50_s"), 1000),
        _fmt(r.get("itl_p50_s"), 1000, 2),
        f"{r.get('requests_ok', 0)}/{r.get('requests_failed', 0)}",
        status,
    ]


def render_markdown(sweep: Sweep, diff: dict[str, str], base: float | None) -> str:
    lines = [
        f"# {sweep.id} ({sweep.state})",
        "",
        f"baseline: {sweep.baseline}; load: {sweep.load.requests} requests x "
        f"{sweep.load.max_tokens} tokens, concurrency {sweep.load.concurrency}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in sweep.rows:
        lines.append(
            "| " + " | ".join(c.replace("|", "/") for c in _row_cells(r, diff, base)) + " |"
        )
    lines.append("")
    lines.append(f"winner: {sweep.winner or '-'}")
    failed = [r for r in sweep.rows if r.get("status") != "ok"]
    for r in failed:
        lines.append(
            f"- {r['config']}: {r.get('reason')}: {r.get('evidence')}"
            + (f" (log: {r['log']})" if r.get("log") else "")
        )
    if sweep.restored:
        lines.append(f"restored: {sweep.restored}")
    return "\n".join(lines) + "\n"


def render_csv(sweep: Sweep, diff: dict[str, str], base: float | None) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([*COLUMNS, "reason", "evidence"])
    for r in sweep.rows:
        w.writerow([*_row_cells(r, diff, base), r.get("reason") or "", r.get("evidence") or ""])
    return buf.getvalue()


def render_chart(sweep: Sweep, base: float | None, path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only sweeps draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [r["config"] for r in sweep.rows]
    values = [r.get("tok_s") or 0.0 for r in sweep.rows]
    colors = ["#4c72b0" if r.get("status") == "ok" else "#c44e52" for r in sweep.rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4.2), dpi=110)
    bars = ax.bar(names, values, color=colors)
    for bar, r in zip(bars, sweep.rows, strict=True):
        label = f"{r['tok_s']:.1f}" if r.get("tok_s") else str(r.get("reason") or r.get("status"))
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(0, max([*values, base or 0.0, 1.0]) * 1.18)  # room for the labels
    if base:
        ax.axhline(base, color="#555555", linestyle="--", linewidth=1)
        ax.annotate(
            f"baseline {base:.1f} tok/s",
            (1.0, base),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 4),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color="#555555",
        )
    ax.set_ylabel("output tok/s (one stream)")
    ax.set_title(f"{sweep.id}: tok/s per config (red: refused or crashed)", fontsize=10)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
