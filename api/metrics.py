"""The daemon's Prometheus metrics, read from the supervisor at scrape time (``GET /metrics``).

Names follow Prometheus's conventions: base units (bytes, seconds), counters end in `_total`,
and everything about the server carries a `config` label. README's "Monitoring" lists them; the
Grafana board and the alert rules in `monitoring/` use them (tests/test_monitoring.py checks
that every name they use is served). This module is imported on the first scrape only.

Where the running config turns on SGLang's own metrics (`--enable-metrics`), a scrape of the
daemon first reads the server's `/metrics` (bounded by `SERVER_SCRAPE_TIMEOUT_S`) and posts the
figures to the supervisor, so `/status` and this answer show them for this launch only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gpuwarden.daemon.logring import LogFeed
from gpuwarden.daemon.messages import ServerFiguresRead
from gpuwarden.daemon.policy import REASONS
from gpuwarden.daemon.states import ServerState
from gpuwarden.daemon.supervisor import Supervisor
from gpuwarden.daemon.views import Snapshot

MIB = 1024 * 1024
SERVER_SCRAPE_TIMEOUT_S = 2.0
HOLDERS = ("ours", "orphan", "foreign")

# SGLang's gauge -> the server_metrics key, and how samples of several ranks combine.
SGLANG_FIGURES: dict[str, tuple[str, str]] = {
    "sglang:gen_throughput": ("gen_throughput_tok_s", "sum"),
    "sglang:num_running_reqs": ("running_req", "sum"),
    "sglang:num_queue_reqs": ("queue_req", "sum"),
    "sglang:token_usage": ("token_usage", "mean"),
    "sglang:spec_accept_length": ("accept_len", "mean"),
}
# server_metrics key -> (metric name, help).
SERVER_FIGURES = (
    (
        "gen_throughput_tok_s",
        "gpuwarden_server_gen_throughput_tokens_per_second",
        "The server's generation throughput (its Decode batch line, or sglang:gen_throughput)",
    ),
    ("accept_len", "gpuwarden_server_accept_length", "Speculative decoding's accept length"),
    ("accept_rate", "gpuwarden_server_accept_rate", "Speculative decoding's accept rate"),
    ("running_req", "gpuwarden_server_running_requests", "Requests running (#running-req)"),
    ("queue_req", "gpuwarden_server_queued_requests", "Requests queued (#queue-req)"),
    ("token_usage", "gpuwarden_server_token_usage_ratio", "KV cache token usage, 0 to 1"),
)


def build_version() -> str:
    try:
        return version("gpuwarden")
    except PackageNotFoundError:
        return "unknown"


def parse_sglang_metrics(text: str) -> dict[str, Any]:
    """The server_metrics fields found in SGLang's Prometheus text (ranks combined)."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SGLANG_FIGURES:
                values.setdefault(sample.name, []).append(float(sample.value))
    out: dict[str, Any] = {}
    for name, samples in values.items():
        key, how = SGLANG_FIGURES[name]
        value = sum(samples) if how == "sum" else sum(samples) / len(samples)
        out[key] = int(value) if key in ("running_req", "queue_req") else round(value, 4)
    return out


class SupervisorCollector(Collector):
    """Reads the supervisor's state at scrape time; nothing is updated on the hot path."""

    def __init__(self, supervisor: Supervisor, feed: LogFeed | None = None) -> None:
        self.sup = supervisor
        self.feed = feed
        self.version = build_version()
        self.scrape_failures = 0

    def collect(self) -> Iterator[Metric]:
        snap = self.sup.snapshot()
        status = self.sup.status()
        cfg = snap.current_config or ""

        yield _gauge("gpuwarden_build_info", "The daemon's version", 1, {"version": self.version})
        if cfg:
            yield _gauge(
                "gpuwarden_config_info", "The config serving or on its way", 1, {"config": cfg}
            )
        state = GaugeMetricFamily(
            "gpuwarden_state", "1 for the server's current state", labels=["state", "config"]
        )
        for st in ServerState:
            state.add_metric([str(st), cfg], 1.0 if snap.state == st else 0.0)
        yield state
        since = max(0.0, self.sup.clock.time() - snap.state_since)
        yield _gauge("gpuwarden_state_seconds", "Time in the current state", since, {"config": cfg})
        yield _gauge(
            "gpuwarden_supervising",
            "1 while supervision works; 0 when stuck (the systemd watchdog is not fed)",
            1.0 if status["supervising"] else 0.0,
        )
        yield CounterMetricFamily(
            "gpuwarden_restarts_total",
            "Relaunches of the same config (retries after a failure, requested restarts)",
            snap.restarts,
        )
        yield CounterMetricFamily(
            "gpuwarden_swaps_total", "Swaps to another config, begun", snap.swaps
        )
        yield CounterMetricFamily(
            "gpuwarden_rollbacks_total", "Failed swaps rolled back", snap.rollbacks
        )
        failures = CounterMetricFamily(
            "gpuwarden_failures_total", "Failed launches by reason", labels=["reason"]
        )
        for reason in sorted({*REASONS, *snap.exits_by_reason}):
            failures.add_metric([reason], snap.exits_by_reason.get(reason, 0))
        yield failures
        yield _gauge(
            "gpuwarden_consecutive_failures", "Failures in a row", snap.failures, {"config": cfg}
        )
        yield _gauge(
            "gpuwarden_crash_loop",
            "1 while in a crash loop",
            1.0 if snap.crash_loop else 0.0,
            {"config": cfg},
        )
        yield _gauge(
            "gpuwarden_probe_failures",
            "Consecutive failed liveness probes of the serving launch",
            snap.probe_failures,
            {"config": cfg},
        )
        if snap.rolled_back_from:
            yield _gauge(
                "gpuwarden_last_rollback_info",
                "The last swap that rolled back: the config that failed, the one that serves",
                1,
                {"from_config": snap.rolled_back_from, "to_config": cfg},
            )
        writes = CounterMetricFamily(
            "gpuwarden_write_failures_total",
            "Times a file the daemon writes began failing (disk full, file too large)",
            labels=["target"],
        )
        for target in ("state", "events", "launch_log"):
            writes.add_metric([target], snap.write_failures.get(target, 0))
        yield writes
        yield CounterMetricFamily(
            "gpuwarden_internal_errors_total",
            "Failures of the daemon's own tasks, each recorded and recovered from",
            snap.internal_errors,
        )
        yield CounterMetricFamily(
            "gpuwarden_server_scrape_failures_total",
            "Failed reads of the server's own /metrics (with --enable-metrics)",
            self.scrape_failures,
        )
        if self.feed is not None:
            yield _gauge(
                "gpuwarden_log_streams", "/logs/stream clients open now", self.feed.readers
            )
        yield from self._launch(snap, status, cfg)
        yield from self._gpus(snap, status)
        if status.get("proxy"):
            yield from _proxy(status["proxy"])

    def _launch(self, snap: Snapshot, status: dict[str, Any], cfg: str) -> Iterator[Metric]:
        label = {"config": cfg}
        if status["uptime_s"] is not None:
            yield _gauge(
                "gpuwarden_server_uptime_seconds", "Time since ready", status["uptime_s"], label
            )
        if snap.state == ServerState.STARTING and snap.started_at is not None:
            took = max(0.0, self.sup.clock.time() - snap.started_at)
            yield _gauge(
                "gpuwarden_starting_seconds",
                "Time since the launch started, while it starts",
                took,
                label,
            )
            if snap.startup_timeout_s is not None:
                yield _gauge(
                    "gpuwarden_startup_timeout_seconds",
                    "The config's startup_timeout_s",
                    snap.startup_timeout_s,
                    label,
                )
        ready = GaugeMetricFamily(
            "gpuwarden_time_to_ready_seconds",
            "Launch to ready, each config's last launch",
            labels=["config"],
        )
        for name, took in sorted(snap.ready_by_config.items()):
            ready.add_metric([name], took)
        yield ready
        last = snap.last_exit or {}
        if last.get("code") is not None or last.get("signal") is not None:
            code = int(last["code"]) if last.get("code") is not None else -int(last["signal"])
            yield _gauge(
                "gpuwarden_last_exit_code", "The last exit's code (negative: the signal)", code
            )
        figures = status.get("server_metrics") or {}
        if figures:
            # Only the running launch's own figures exist: none before it reports, none after.
            label = {"config": str(figures.get("config") or cfg)}
            for key, name, doc in SERVER_FIGURES:
                if key in figures:
                    yield _gauge(name, doc, float(figures[key]), label)
            yield _gauge(
                "gpuwarden_server_metrics_age_seconds",
                "Age of the server's figures above (source: log or sglang_metrics)",
                float(figures["age_s"]),
                {**label, "source": str(figures.get("source", "log"))},
            )

    def _gpus(self, snap: Snapshot, status: dict[str, Any]) -> Iterator[Metric]:
        labels = ["gpu", "uuid"]
        used = GaugeMetricFamily(
            "gpuwarden_gpu_memory_used_bytes", "GPU memory used", labels=labels
        )
        total = GaugeMetricFamily("gpuwarden_gpu_memory_total_bytes", "GPU memory", labels=labels)
        held = GaugeMetricFamily(
            "gpuwarden_gpu_memory_held_bytes",
            "GPU memory held by processes: ours (the running launch), orphan (of an earlier "
            "launch), foreign (not ours: never killed)",
            labels=[*labels, "holder"],
        )
        for g in status["gpus"]:
            key = [str(g["index"]), g["uuid"]]
            used.add_metric(key, g["used_mib"] * MIB)
            total.add_metric(key, g["total_mib"] * MIB)
            by_holder = dict.fromkeys(HOLDERS, 0)
            for p in g["processes"]:
                by_holder[p["holder"]] += p["used_mib"] * MIB
            for holder, n in by_holder.items():
                held.add_metric([*key, holder], n)
        yield used
        yield total
        yield held
        yield _gauge(
            "gpuwarden_gpu_snapshot_age_seconds",
            "Age of the last GPU snapshot",
            status["gpu_snapshot_age_s"],
        )


PROXY_COUNTERS = {
    "requests": "Requests that reached the front proxy",
    "released": "Requests held while the server was on its way back, then sent on",
    "rejected": "Requests answered 503 (failed or stopped, past hold_timeout_s or the bounds)",
    "retried": "Requests whose server died before answering, sent again to the next one",
    "continued": "Streams cut by a dead server, continued on the next one",
    "cut": "Responses cut by a dead server (a stream ends with an error event)",
    "client_gone": "Clients that left before their answer",
    "failed": "Requests answered 502 (the server's answer could not be passed on)",
}


def _proxy(view: dict[str, Any]) -> Iterator[Metric]:
    """The front proxy's figures, as it last said them (twice a second)."""
    up = 1.0 if view.get("connected") else 0.0
    yield _gauge("gpuwarden_proxy_up", "1 while the daemon is connected to its proxy", up)
    for key, doc in (
        ("held", "Requests held now"),
        ("held_bytes", "Bytes of the requests held now"),
        ("active", "Requests under way through the proxy (held or sent on)"),
    ):
        yield _gauge(f"gpuwarden_proxy_{key}", doc, float(view.get(key) or 0))
    for key, doc in PROXY_COUNTERS.items():
        name = "gpuwarden_proxy_cut_streams" if key == "cut" else f"gpuwarden_proxy_{key}"
        yield CounterMetricFamily(name, doc, float(view.get(key) or 0))
    hist = view.get("hold_seconds") or {}
    bounds, counts = list(hist.get("buckets") or []), list(hist.get("counts") or [])
    if counts and len(counts) == len(bounds) + 1:
        total, buckets = 0, []
        for bound, count in zip([*map(str, bounds), "+Inf"], counts, strict=True):
            total += int(count)
            buckets.append((bound, total))
        family = HistogramMetricFamily(
            "gpuwarden_proxy_hold_seconds", "How long requests were held before their answer"
        )
        family.add_metric([], buckets, float(hist.get("sum") or 0.0))
        yield family


def _gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    """One gauge sample (labels in order)."""
    family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


class Metrics:
    """What `GET /metrics` answers: the server's own figures read first (where it has them)."""

    def __init__(self, supervisor: Supervisor, feed: LogFeed | None = None) -> None:
        self.sup = supervisor
        self.collector = SupervisorCollector(supervisor, feed)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    async def render(self) -> bytes:
        await self.read_server()
        return generate_latest(self.registry)

    async def read_server(self) -> None:
        """SGLang's /metrics, when the ready launch serves it: its figures go to the supervisor
        (and so to /status). A failure is counted and leaves the older figures to age."""
        snap = self.sup.snapshot()
        if snap.metrics_url is None or snap.state != ServerState.READY:
            return
        import httpx  # noqa: PLC0415 (only where a server's metrics are read)

        try:
            async with httpx.AsyncClient(timeout=SERVER_SCRAPE_TIMEOUT_S, trust_env=False) as c:
                res = await c.get(snap.metrics_url)
                res.raise_for_status()
            figures = parse_sglang_metrics(res.text)
        except (httpx.HTTPError, ValueError):
            self.collector.scrape_failures += 1
            return
        if not figures:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SERVER_SCRAPE_TIMEOUT_S):
                await self.sup.request(ServerFiguresRead(snap.gen, figures))
