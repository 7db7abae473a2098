"""The daemon's Prometheus metrics, read from the supervisor at scrape time (``GET /metrics``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwarden.daemon.launchlog import LogFeed
from gpuwarden.daemon.states import ServerState
from gpuwarden.daemon.supervisor import Supervisor


class SupervisorCollector(Collector):
    """Reads the supervisor's state at scrape time; nothing is updated on the hot path."""

    def __init__(self, supervisor: Supervisor, feed: LogFeed | None = None) -> None:
        self.sup = supervisor
        self.feed = feed

    def collect(self) -> Iterator[Metric]:
        sup = self.sup.snapshot()
        state = GaugeMetricFamily(
            "gpuwarden_state", "1 for the server's current state", labels=["state"]
        )
        for st in ServerState:
            state.add_metric([str(st)], 1.0 if sup.state == st else 0.0)
        yield state
        restarts = CounterMetricFamily("gpuwarden_restarts", "Relaunches by the supervisor")
        restarts.add_metric([], sup.restarts)
        yield restarts
        exits = CounterMetricFamily(
            "gpuwarden_failures_by_reason", "Failed launches by reason", labels=["reason"]
        )
        for reason, n in sorted(sup.exits_by_reason.items()):
            exits.add_metric([reason], n)
        yield exits
        writes = CounterMetricFamily(
            "gpuwarden_write_failures",
            "Times a file the daemon writes began failing (disk full, file too large)",
            labels=["target"],
        )
        for target in ("state", "events", "launch_log"):
            writes.add_metric([target], sup.write_failures.get(target, 0))
        yield writes
        yield CounterMetricFamily(
            "gpuwarden_internal_errors",
            "Failures of the daemon's own tasks, each recorded and recovered from",
            value=sup.internal_errors,
        )
        yield GaugeMetricFamily(
            "gpuwarden_supervising",
            "1 while supervision works; 0 when stuck (the systemd watchdog is not fed)",
            value=1.0 if self.sup.stuck() is None else 0.0,
        )
        yield GaugeMetricFamily(
            "gpuwarden_consecutive_failures", "Failures in a row", value=sup.failures
        )
        yield GaugeMetricFamily(
            "gpuwarden_crash_loop", "1 while in a crash loop", value=1.0 if sup.crash_loop else 0.0
        )
        if self.feed is not None:
            yield GaugeMetricFamily(
                "gpuwarden_log_streams", "/logs/stream clients open now", value=self.feed.readers
            )
        status = self.sup.status()
        if status["uptime_s"] is not None:
            yield GaugeMetricFamily(
                "gpuwarden_server_uptime_seconds", "Time since ready", value=status["uptime_s"]
            )
        if sup.ready_times:
            ready = GaugeMetricFamily(
                "gpuwarden_time_to_ready_seconds", "Launch to ready, the last launch"
            )
            ready.add_metric([], sup.ready_times[-1])
            yield ready
        last = sup.last_exit or {}
        if last.get("code") is not None or last.get("signal") is not None:
            code = last.get("code") if last.get("code") is not None else -int(last["signal"])
            yield GaugeMetricFamily(
                "gpuwarden_last_exit_code",
                "The last exit's code (negative: the signal)",
                value=code,
            )
        metrics = status.get("server_metrics") or {}
        for key, name, doc in (
            (
                "gen_throughput_tok_s",
                "gpuwarden_server_gen_throughput_tokens_per_second",
                "The server's gen throughput from its last Decode batch line",
            ),
            (
                "accept_len",
                "gpuwarden_server_accept_length",
                "Speculative accept length from the last Decode batch line",
            ),
            ("running_req", "gpuwarden_server_running_requests", "#running-req"),
            ("queue_req", "gpuwarden_server_queued_requests", "#queue-req"),
        ):
            if key in metrics:
                yield GaugeMetricFamily(name, doc, value=float(metrics[key]))
        used = GaugeMetricFamily(
            "gpuwarden_gpu_memory_used_mib", "GPU memory used", labels=["gpu", "uuid"]
        )
        total = GaugeMetricFamily(
            "gpuwarden_gpu_memory_total_mib", "GPU memory", labels=["gpu", "uuid"]
        )
        for g in status["gpus"]:
            used.add_metric([str(g["index"]), g["uuid"]], g["used_mib"])
            total.add_metric([str(g["index"]), g["uuid"]], g["total_mib"])
        yield used
        yield total


def metrics_registry(supervisor: Supervisor, feed: LogFeed | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SupervisorCollector(supervisor, feed))
    return registry
