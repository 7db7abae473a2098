"""Config sweeps: swap to each config in turn, load it, record, move on, and return.

For each config: a swap (preflight and rollback rules as for any swap), `ready`, a load against
its OpenAI-compatible endpoint, and the server's own `Decode batch` figures during the load
window. A config that is refused or crashes is recorded with its reason and log reference and
the sweep goes on. At the end (or on cancel) the config that was serving before (or `end_on`)
is restored. Results: `table.md`, `table.csv`, `chart.png`, `result.json` under
`state_dir/sweeps/ID/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from gpuwarden.daemon import history
from gpuwarden.daemon.errors import CommandError, config_refusal
from gpuwarden.daemon.load import LoadSpec, run_load
from gpuwarden.daemon.supervisor import Supervisor

from .sglanglines import parse_line

log = structlog.get_logger("gpuwarden.sweep")


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


class SweepManager:
    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor
        self.sweeps: dict[str, Sweep] = {}
        self.active: Sweep | None = None

    def start(
        self,
        configs: list[str],
        baseline: str | None = None,
        end_on: str | None = None,
        load: LoadSpec | None = None,
    ) -> Sweep:
        if not configs:
            raise CommandError("bad_request", "a sweep needs at least one config")
        if self.active is not None and self.active.state == "running":
            raise CommandError("conflict", f"sweep {self.active.id} is under way")
        swap = self.sup.snapshot().swap
        if swap is not None:
            raise CommandError("conflict", f"swap {swap['id']} is under way")
        for name in {*configs, *(x for x in (baseline, end_on) if x)}:
            self._exists(name)
        sweep_id = time.strftime("sweep-%Y%m%dT%H%M%S", time.gmtime())
        n = 1
        while sweep_id in self.sweeps:
            n += 1
            sweep_id = f"{sweep_id.split('.')[0]}.{n}"
        sweep = Sweep(
            id=sweep_id,
            configs=list(configs),
            baseline=baseline or configs[0],
            end_on=end_on,
            load=load or LoadSpec(),
            folder=self.sup.settings.state_dir / "sweeps" / sweep_id,
        )
        self.sweeps[sweep_id] = sweep
        self.active = sweep
        self.sup.sweep_began(sweep_id, sweep.view, self.cancel_for_stop)
        sweep.task = asyncio.get_running_loop().create_task(self._run(sweep))
        self.sup.post_event("sweep_started", sweep_id=sweep_id, configs=configs)
        return sweep

    def _exists(self, name: str) -> None:
        from gpuwarden.daemon.configs import ConfigError  # noqa: PLC0415

        try:
            self.sup.configs.path_of(name)
        except ConfigError as exc:
            raise config_refusal(exc) from exc

    async def cancel(self, sweep_id: str, restore: bool = True) -> Sweep:
        sweep = self.sweeps.get(sweep_id)
        if sweep is None:
            raise CommandError("not_found", f"unknown sweep {sweep_id!r}")
        if sweep.state == "running" and sweep.task is not None:
            sweep.state = "cancelled"
            sweep.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweep.task
            if restore:
                asyncio.get_running_loop().create_task(self._restore(sweep))
        return sweep

    async def cancel_for_stop(self) -> None:
        """`stop` wins: the running sweep ends without restoring anything."""
        if self.active is not None and self.active.state == "running":
            await self.cancel(self.active.id, restore=False)

    # -- the run ----------------------------------------------------------------------------

    async def _run(self, sweep: Sweep) -> None:
        sup = self.sup
        snap = sup.snapshot()
        sweep.original = snap.intent_config if snap.intent_running else None
        try:
            for name in sweep.configs:
                sweep.current = name
                sup.post_event(
                    "sweep_progress",
                    sweep_id=sweep.id,
                    config=name,
                    done=len(sweep.rows),
                    total=len(sweep.configs),
                )
                sweep.rows.append(await self._one(sweep, name))
            sweep.state = "done"
        except asyncio.CancelledError:
            sweep.state = "cancelled"
            raise
        except Exception as exc:
            sweep.state = "failed"
            log.exception("sweep.failed", sweep_id=sweep.id)
            sweep.rows.append({"config": sweep.current, "status": "error", "reason": repr(exc)})
        finally:
            sweep.current = None
            self._write(sweep)
            if sweep.state == "done":
                await self._restore(sweep)
                self._write(sweep)
            sup.post_event(
                "sweep_finished", sweep_id=sweep.id, state=sweep.state, winner=sweep.winner
            )
            if self.active is sweep:
                sup.sweep_ended(sweep.id)

    async def _one(self, sweep: Sweep, name: str) -> dict[str, Any]:
        sup = self.sup
        row: dict[str, Any] = {"config": name}
        try:
            outcome = await sup.restart(name, wait=True, sweep_id=sweep.id, ensure=True)
            if outcome["outcome"] != "ready":
                return {
                    **row,
                    "status": outcome["outcome"],
                    "reason": outcome["reason"],
                    "evidence": outcome["evidence"],
                    # The row's own launch's log, not the rollback's that followed it.
                    "log": history.log_of(
                        sup.snapshot().history, outcome.get("launch_ids") or [], name
                    ),
                }
        except CommandError as exc:
            reason = exc.error if exc.error != "invalid_config" else "config_error"
            return {
                **row,
                "status": "refused",
                "reason": reason,
                "evidence": exc.detail,
                "problems": exc.extra.get("problems"),
            }
        cfg = sup.configs.load(name)
        base = f"http://{cfg.host}:{cfg.port}"
        decode: list[dict[str, float]] = []

        def listener(lines: list[str]) -> None:
            for line in lines:
                if "Decode batch" in line:
                    values = parse_line(line).decode
                    if values:
                        decode.append(values)

        sup.line_listeners.add(listener)
        try:
            result = await run_load(base, sweep.load)
        finally:
            sup.line_listeners.discard(listener)
        info_accept = None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
                info = (await c.get(base + "/get_server_info")).json()
                info_accept = info["internal_states"][0].get("avg_spec_accept_length")
        gen = [d["gen_throughput_tok_s"] for d in decode if "gen_throughput_tok_s" in d]
        acc = [d["accept_len"] for d in decode if "accept_len" in d]
        return {
            **row,
            "status": "ok" if result["requests_ok"] else "failed",
            **result,
            "server_gen_tok_s": statistics.median(gen) if gen else None,
            "server_accept_len": statistics.fmean(acc) if acc else None,
            "avg_spec_accept_length": info_accept,
            "launch_id": sup.snapshot().launch_id,
        }

    async def _restore(self, sweep: Sweep) -> None:
        target = sweep.end_on or sweep.original
        if not target:
            return
        with contextlib.suppress(CommandError):
            await self.sup.restart(target, wait=True, sweep_id=sweep.id, ensure=True)
            sweep.restored = target
        self.sup.post_event("sweep_restored", sweep_id=sweep.id, config=target)

    # -- the answer -------------------------------------------------------------------------

    def _write(self, sweep: Sweep) -> None:
        sweep.folder.mkdir(parents=True, exist_ok=True)
        diff = self._flags(sweep)
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

    def _flags(self, sweep: Sweep) -> dict[str, str]:
        out: dict[str, str] = {}
        try:
            base = self.sup.configs.load(sweep.baseline).view()["config"]["args"]
        except Exception:
            return out
        for name in sweep.configs:
            try:
                args = self.sup.configs.load(name).view()["config"]["args"]
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
