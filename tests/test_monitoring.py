"""The Grafana board and the alert rules in monitoring/: promtool checks the rules and runs their
unit tests, the board's queries are checked as PromQL, and a real daemon's /metrics serves every
metric that either names. The server's figures belong to one launch: none carries over."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .support.configs import standin_config
from .support.daemon import Daemon, start_daemon, until
from .support.procs import Proc, free_port, require_tool

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts_test.yml"
BOARD = MONITORING / "grafana-dashboard.json"
NAME = re.compile(r"\bgpuwarden_[a-z0-9_]+")


def spec(draft: Path) -> tuple[str, str]:
    """Flags of a speculative config (its Decode batch lines carry accept len and rate)."""
    return "--speculative-algorithm=EAGLE3", f"--speculative-draft-model-path={draft}"


def board() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(BOARD.read_text())
    return data


def board_queries() -> list[str]:
    exprs = [t["expr"] for p in board()["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board()["annotations"]["list"] if "expr" in a]
    exprs += [v["definition"] for v in board()["templating"]["list"] if v.get("definition")]
    return exprs


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def used_names() -> set[str]:
    names = {n for q in board_queries() for n in NAME.findall(q)}
    return names | {n for r in rules() for n in NAME.findall(r["expr"])}


def test_alert_rules_pass_promtool_check() -> None:
    promtool = require_tool("promtool")
    res = subprocess.run(
        [promtool, "check", "rules", str(RULES)], check=False, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(rules())} rules found" in res.stdout


def test_alert_rules_unit_tests_pass() -> None:
    promtool = require_tool("promtool")
    res = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name],
        check=False,
        capture_output=True,
        text=True,
        cwd=MONITORING,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_has_its_parts_and_is_tested_firing_and_quiet() -> None:
    alerts = {r["alert"]: r for r in rules()}
    assert len(alerts) >= 8
    for needed in ("DaemonDown", "ServerFailed", "CrashLoop", "Rollback", "GpuMemoryHeldByOthers",
                   "ServerMetricsStale", "StartupSlow", "LivenessFailing"):  # fmt: skip
        assert f"Gpuwarden{needed}" in alerts
    for name, rule in alerts.items():
        assert "for" in rule and rule["labels"]["severity"] in ("warning", "critical"), name
        text = rule["annotations"]["summary"] + rule["annotations"]["description"]
        assert "config" in text, name
    fired: dict[str, set[bool]] = {}
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            fired.setdefault(check["alertname"], set()).add(bool(check["exp_alerts"]))
    assert {name: {True, False} for name in alerts} == fired


def test_the_board_is_importable_and_its_queries_are_promql(tmp_path: Path) -> None:
    data = board()
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "config" in variables and "instance" in variables
    for panel in data["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    promtool = require_tool("promtool")
    # Each query as a recording rule, Grafana's variables given values: promtool parses it.
    subst = {"$__rate_interval": "5m", "$__range": "1h", "$instance": ".*", "$config": ".*"}
    exprs = []
    for query in board_queries():
        q = query[len("label_values(") : query.rindex(",")] if "label_values(" in query else query
        for var, value in subst.items():
            q = q.replace(var, value)
        exprs.append(q)
    recorded = [{"record": f"board:query_{i}", "expr": q} for i, q in enumerate(exprs)]
    path = tmp_path / "board-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "board", "rules": recorded}]}))
    res = subprocess.run(
        [promtool, "check", "rules", str(path)], check=False, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def scrape(d: Daemon) -> dict[str, Any]:
    res = d.http.get("/metrics")
    assert res.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(res.text)}


def served(families: dict[str, Any]) -> set[str]:
    return {s.name for f in families.values() for s in f.samples}


def chat(port: int, tokens: int = 24) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    res = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
    assert res.status_code == 200


def sample(families: dict[str, Any], name: str) -> Any:
    [found] = [s for f in families.values() for s in f.samples if s.name == name]
    return found


def test_every_metric_the_board_and_the_alerts_name_is_served(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    port = free_port()
    configs = {
        "spec": standin_config(*spec(tmp_path), "--decode-log-interval=1", port=port),
        "scraped": standin_config("--enable-metrics", port=port),
        "slow": standin_config(port=port, scale=0.3),
        "oom": standin_config("--standin-crash-on-load=cuda_oom", port=port),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="spec")
    d.wait_state("ready")
    seen: set[str] = set()
    chat(port)
    until(lambda: (d.status()["server_metrics"] or {}).get("accept_len") is not None, 20, "figures")
    families = scrape(d)
    seen |= served(families)
    figure = sample(families, "gpuwarden_server_gen_throughput_tokens_per_second")
    assert figure.labels["config"] == "spec" and figure.value > 0
    assert sample(families, "gpuwarden_server_metrics_age_seconds").labels["source"] == "log"
    assert sample(families, "gpuwarden_build_info").labels["version"]
    failures = {s.labels["reason"]: s.value for s in families["gpuwarden_failures"].samples}
    assert failures["cuda_oom"] == 0 and failures["liveness_failed"] == 0  # every reason, from 0
    # A swap that crashes on load rolls back: the rollback, the failure and the exit show.
    res = d.http.post("/restart", params={"config": "oom", "wait": "true"})
    assert res.json()["outcome"] == "rolled_back"
    families = scrape(d)
    seen |= served(families)
    assert sample(families, "gpuwarden_rollbacks_total").value == 1
    assert sample(families, "gpuwarden_swaps_total").value == 1
    assert sample(families, "gpuwarden_restarts_total").value == 0  # a swap is no restart
    info = sample(families, "gpuwarden_last_rollback_info").labels
    assert info["from_config"] == "oom" and info["to_config"] == "spec"
    # A slow start: how long it has been starting, beside its timeout.
    mark = d.mark()
    assert d.http.post("/restart", params={"config": "slow"}).status_code == 202
    d.wait_state("starting", after=mark)
    seen |= served(scrape(d))
    d.wait_state("ready", after=mark)
    # SGLang's own /metrics, read on a scrape of the daemon.
    assert (
        d.http.post(
            "/restart", params={"config": "scraped", "wait": "true", "probation": "false"}
        ).json()["outcome"]
        == "ready"
    )
    families = scrape(d)
    seen |= served(families)
    age = sample(families, "gpuwarden_server_metrics_age_seconds")
    assert age.labels == {"config": "scraped", "source": "sglang_metrics"}
    assert d.status()["server_metrics"]["source"] == "sglang_metrics"
    missing = sorted(used_names() - {n.removesuffix("_total") for n in seen} - seen)
    assert not missing, f"named by the board or the alerts, never served: {missing}"


def test_a_new_launch_never_shows_the_previous_launchs_figures(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    port = free_port()
    configs = {
        "busy": standin_config(*spec(tmp_path), "--decode-log-interval=1", port=port),
        "idle": standin_config(port=port),
    }
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="busy")
    d.wait_state("ready")
    chat(port)
    until(lambda: d.status()["server_metrics"] is not None, 20, "a Decode batch line read")
    first = d.status()
    figures = first["server_metrics"]
    assert figures["gen_throughput_tok_s"] > 0
    for how in ({}, {"config": "idle"}):  # a restart of the same config, then a swap
        res = d.http.post("/restart", params={**how, "wait": "true", "probation": "false"})
        assert res.json()["outcome"] == "ready"
        st = d.status()
        now = st["server_metrics"]  # none yet, or the new launch's own (its warm-up)
        assert now is None or now.get("launch_id") == st["launch_id"], now
        for family in scrape(d).values():
            for s in family.samples:
                if s.name.startswith("gpuwarden_server_"):  # this launch's figures only
                    assert s.labels.get("config", st["config"]) == st["config"], s
                if s.name.startswith("gpuwarden_server_") and now is None:
                    assert s.name.startswith(("gpuwarden_server_uptime", "gpuwarden_server_scrape"))
    assert d.status()["server_metrics"] is None  # "idle" logged no Decode batch line yet
    # The figures said whose they were, and how old.
    assert figures.get("config") == "busy" and figures.get("launch_id") == first["launch_id"]
    assert figures.get("age_s", -1) >= 0
