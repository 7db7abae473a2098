"""A sweep's record and its answer: the rows, the winner, and the files a user reads
(`table.md`, `table.csv`, `chart.png`, `result.json` under `state_dir/sweeps/ID/`).

`result.json` is the record: a later life of the daemon reads it back (`Sweep.from_record`), so
`GET /sweeps` lists the sweeps of earlier lives. The chart needs matplotlib, an optional extra
(`pip install 'gpuwarden[charts]'`); without it the other files are written and the chart's
absence names the extra.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import logsetup
from .load import LoadSpec
from .safefile import read_regular
from .store import atomic_write

if TYPE_CHECKING:
    from .configs import ConfigStore

CHARTS_EXTRA = "charts"
# A sweep's record is tens of KiB (64 configs at most, a row each).
RECORD_MAX_BYTES = 16 * 1024 * 1024
log = logsetup.get_logger("gpuwarden.sweep")


def charts_missing() -> str | None:
    """Why no chart can be drawn here (matplotlib, the `charts` extra, is not installed)."""
    import importlib.util  # noqa: PLC0415

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return (
        "charts need matplotlib, an optional extra: pip install 'gpuwarden[charts]' "
        "(the table and CSV need nothing more)"
    )


@dataclass
class Sweep:
    id: str
    configs: list[str]
    baseline: str
    end_on: str | None
    load: LoadSpec
    folder: Path
    state: str = "running"  # running | done | cancelled | failed | interrupted
    current: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    original: str | None = None
    restored: str | bool | None = None  # the config back, False when it is not (why: below)
    restore_error: str | None = None
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    task: asyncio.Task[None] | None = None
    winner: str | None = None
    chart: str | None = None  # why there is no chart, when there is none

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "configs": self.configs,
            "done": len(self.rows),
            "total": len(self.configs),
            "current": self.current,
            "baseline": self.baseline,
            "end_on": self.end_on,
            "original": self.original,
            "restored": self.restored,
            "restore_error": self.restore_error,
            "winner": self.winner,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "load": {k: v for k, v in asdict(self.load).items() if k != "prompts"},
            "rows": self.rows,
            "folder": str(self.folder),
            "chart_missing": self.chart,
        }

    def summary(self) -> dict[str, Any]:
        """The sweep in `GET /sweeps`: what ran, how it ended, and the best config."""
        best = next((r for r in self.rows if r["config"] == self.winner), None)
        return {
            "id": self.id,
            "configs": self.configs,
            "state": self.state,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "best": self.winner,
            "best_tok_s": best.get("tok_s") if best else None,
            "done": len(self.rows),
            "total": len(self.configs),
        }

    @classmethod
    def from_record(cls, data: dict[str, Any], folder: Path) -> Sweep:
        """A sweep read back from its `result.json`; one recorded as running ended with the
        daemon's earlier life: it is `interrupted`."""
        load = data.get("load") or {}
        known = set(LoadSpec.__dataclass_fields__) - {"prompts"}
        sweep = cls(
            id=str(data["id"]),
            configs=[str(c) for c in data.get("configs") or []],
            baseline=str(data.get("baseline") or ""),
            end_on=data.get("end_on"),
            load=LoadSpec(**{k: v for k, v in load.items() if k in known}),
            folder=folder,
            state=str(data.get("state") or "interrupted"),
            rows=list(data.get("rows") or []),
            original=data.get("original"),
            restored=data.get("restored"),
            restore_error=data.get("restore_error"),
            started_at=float(data.get("started_at") or folder.stat().st_mtime),
            ended_at=data.get("ended_at"),
            winner=data.get("winner"),
            chart=data.get("chart_missing"),
        )
        if sweep.state == "running":
            sweep.state = "interrupted"
        return sweep


def read_sweeps(root: Path) -> dict[str, Sweep]:
    """Every sweep recorded under `root` (state_dir/sweeps), oldest first; a folder whose
    record is missing or unreadable (not a regular file, over RECORD_MAX_BYTES, not a record)
    is skipped (and kept), and said in the daemon's log. Blocking: call it off the loop."""
    found: list[Sweep] = []
    try:
        folders = [p for p in root.iterdir() if p.is_dir()]
    except OSError:
        return {}
    for folder in folders:
        try:
            data = json.loads(read_regular(folder / "result.json", RECORD_MAX_BYTES))
            found.append(Sweep.from_record(data, folder))
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning(
                "sweep.record_unreadable", folder=str(folder), error=exc.strerror or str(exc)
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("sweep.record_unreadable", folder=str(folder), error=repr(exc))
    found.sort(key=lambda s: (s.started_at, s.id))
    return {s.id: s for s in found}


# -- the answer -------------------------------------------------------------------------


def write_report(sweep: Sweep, configs: ConfigStore, chart: bool = True) -> None:
    """table.md, table.csv, result.json and (with `chart`) chart.png in the sweep's folder."""
    sweep.folder.mkdir(parents=True, exist_ok=True)
    diff = _flags(sweep, configs)
    for r in sweep.rows:
        r["flags"] = diff.get(r["config"], "")
    ok = [r for r in sweep.rows if r.get("status") == "ok" and r.get("tok_s")]
    sweep.winner = max(ok, key=lambda r: r["tok_s"])["config"] if ok else None
    (sweep.folder / "table.md").write_text(render_markdown(sweep))
    (sweep.folder / "table.csv").write_text(render_csv(sweep))
    sweep.chart = charts_missing()
    if sweep.chart is None and chart:
        try:
            render_chart(sweep, baseline_tok_s(sweep), sweep.folder / "chart.png")
        except Exception as exc:
            sweep.chart = f"the chart could not be drawn: {exc!r}"
    record = json.dumps(sweep.view(), indent=1, default=str).encode()
    atomic_write(sweep.folder / "result.json", record)


def baseline_tok_s(sweep: Sweep | dict[str, Any]) -> float | None:
    view = sweep.view() if isinstance(sweep, Sweep) else sweep
    return next(
        (
            r["tok_s"]
            for r in view["rows"]
            if r["config"] == view["baseline"] and r.get("status") == "ok" and r.get("tok_s")
        ),
        None,
    )


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


def _num(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "" if x is None else f"{x * scale:.{digits}f}"


def _status(r: dict[str, Any]) -> str:
    status = str(r.get("status", ""))
    return status if status == "ok" else f"{status}: {r.get('reason')}"


# One column: (header with its unit, the cell as a number for CSV or "" when unknown).
Column = tuple[str, Callable[[dict[str, Any], float | None], str]]

NUMBERS: tuple[Column, ...] = (
    ("tok/s (p50)", lambda r, b: _num(r.get("tok_s"))),
    ("tok/s min", lambda r, b: _num(r.get("tok_s_min"))),
    ("tok/s max", lambda r, b: _num(r.get("tok_s_max"))),
    (
        "vs baseline (x)",
        lambda r, b: f"{r['tok_s'] / b:.2f}" if b and r.get("tok_s") else "",
    ),
    (
        "accept len",
        lambda r, b: _num(r.get("server_accept_len") or r.get("avg_spec_accept_length"), 1, 2),
    ),
    ("TTFT p50 (ms)", lambda r, b: _num(r.get("ttft_p50_s"), 1000)),
    ("TTFT p99 (ms)", lambda r, b: _num(r.get("ttft_p99_s"), 1000)),
    ("ITL p50 (ms)", lambda r, b: _num(r.get("itl_p50_s"), 1000, 2)),
    ("ITL p99 (ms)", lambda r, b: _num(r.get("itl_p99_s"), 1000, 2)),
    ("total tok/s", lambda r, b: _num(r.get("total_tok_s"))),
    (
        "output tokens",
        lambda r, b: "" if r.get("output_tokens") is None else str(r["output_tokens"]),
    ),
    ("ready (s)", lambda r, b: _num((r.get("startup") or {}).get("ready_s"))),
    ("requests ok", lambda r, b: str(r.get("requests_ok", 0))),
    ("requests failed", lambda r, b: str(r.get("requests_failed", 0))),
)


def table(view: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows of cells): the table every rendering shares."""
    base = baseline_tok_s(view)
    headers = ["config", "flags vs baseline", *(h for h, _ in NUMBERS), "status"]
    rows = [
        [r["config"], r.get("flags", ""), *(f(r, base) or "-" for _, f in NUMBERS), _status(r)]
        for r in view["rows"]
    ]
    return headers, rows


def _notes(view: dict[str, Any]) -> list[str]:
    lines = [f"winner: {view.get('winner') or '-'}"]
    for r in view["rows"]:
        if r.get("status") != "ok":
            lines.append(
                f"- {r['config']}: {r.get('reason')}: {r.get('evidence')}"
                + (f" (log: {r['log']})" if r.get("log") else "")
            )
    if view.get("restored"):
        lines.append(f"restored: {view['restored']}")
    elif view.get("restored") is False:
        lines.append(f"not restored: {view.get('restore_error')}")
    return lines


def _load_line(view: dict[str, Any]) -> str:
    load = view.get("load") or {}
    spec = LoadSpec(**{k: v for k, v in load.items() if k in LoadSpec.__dataclass_fields__})
    return f"baseline: {view.get('baseline')}; load: {spec.describe()}"


def render_markdown(sweep: Sweep) -> str:
    view = sweep.view()
    headers, rows = table(view)
    lines = [
        f"# {sweep.id} ({sweep.state})",
        "",
        _load_line(view),
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
    ]
    for cells in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines.append("")
    lines.extend(_notes(view))
    return "\n".join(lines) + "\n"


def render_text(view: dict[str, Any]) -> str:
    """The table as plain aligned text, for a terminal."""
    headers, rows = table(view)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    numeric = {
        i for i, h in enumerate(headers) if h not in ("config", "flags vs baseline", "status")
    }

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [f"{view['id']} ({view['state']})", _load_line(view), "", line(headers)]
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(cells) for cells in rows)
    out.append("")
    out.extend(_notes(view))
    return "\n".join(out) + "\n"


def render_csv(sweep: Sweep) -> str:
    """Numbers in the number columns (empty when unknown), units in the header."""
    view = sweep.view()
    base = baseline_tok_s(view)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        ["config", "flags vs baseline", "status", "reason", *(h for h, _ in NUMBERS), "evidence"]
    )
    for r in view["rows"]:
        w.writerow(
            [
                r["config"],
                r.get("flags", ""),
                r.get("status", ""),
                r.get("reason") or "",
                *(f(r, base) for _, f in NUMBERS),
                r.get("evidence") or "",
            ]
        )
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
