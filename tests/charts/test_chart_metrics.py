"""Every metric the dashboards and alert rules query is one the code defines, with labels it has; promtool
checks the rules, unit-tests the alerts, and parses every dashboard query."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from chart_tools import CHART, tool
from cpuserve.operator.metrics import build_operator_metrics
from cpuserve.serving.metrics import build_serving_metrics

HERE = Path(__file__).parent
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}
PROMQL_WORDS = {"by", "without", "le", "rate", "sum", "max", "min", "avg", "histogram_quantile", "absent", "on",
                "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, from the real metric definitions."""
    registry = CollectorRegistry()
    build_serving_metrics(registry)
    build_operator_metrics(registry)
    out: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):
        labels = set(getattr(collector, "_labelnames", ()))
        for family in collector.describe():
            for suffix in SUFFIXES[family.type]:
                out[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    out = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            out += [(f"{path.name}: {panel['title']}", t["expr"]) for t in panel["targets"]]
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"]).groups()
                out.append((f"{path.name}: ${var['name']}", f"group by ({label}) ({metric})"))
    return out


def alert_queries() -> list[tuple[str, str]]:
    groups = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"]
    return [(f"alerts: {r['alert']}", r["expr"]) for g in groups for r in g["rules"]]


QUERIES = dashboard_queries() + alert_queries()


def test_serving_metric_names_are_the_agreed_ones():
    names = exported()
    for name in ("cpuserve_requests_total", "cpuserve_prompt_tokens_total", "cpuserve_generation_tokens_total",
                 "cpuserve_time_to_first_token_seconds_bucket", "cpuserve_inter_token_latency_seconds_bucket",
                 "cpuserve_e2e_request_latency_seconds_bucket", "cpuserve_request_queue_time_seconds_bucket",
                 "cpuserve_num_requests_running", "cpuserve_num_requests_waiting", "cpuserve_kv_cache_usage_ratio",
                 "cpuserve_preemptions_total", "cpuserve_engine_step_seconds_bucket",
                 "cpuserve_operator_reconciles_total", "cpuserve_operator_reconcile_duration_seconds_bucket",
                 "cpuserve_operator_errors_total", "cpuserve_operator_managed_llmservices"):
        assert name in names, name
    assert names["cpuserve_requests_total"] == {"model", "finish_reason"}
    assert names["cpuserve_engine_step_seconds_bucket"] == {"model", "rank", "le"}
    assert names["cpuserve_operator_managed_llmservices"] == {"condition"}


@pytest.mark.parametrize("where,expr", QUERIES, ids=[q[0] for q in QUERIES])
def test_query_uses_exported_metrics_and_labels(where, expr):
    names = exported()
    used = set(re.findall(r"\bcpuserve_[a-z0-9_]+", expr))
    assert used, f"{where}: queries no cpuserve metric"
    assert used <= names.keys(), f"{where}: not exported: {sorted(used - names.keys())}"
    known = set().union(*(names[m] for m in used))
    labels = set(re.findall(r"([a-z_]+)\s*(?:=~|!=|!~|=)\s*\"", expr))
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    assert labels <= known, f"{where}: labels {sorted(labels - known)} are on none of {sorted(used)}"


def test_every_serving_metric_is_on_the_dashboard():
    queried = set(re.findall(r"\bcpuserve_[a-z0-9_]+", " ".join(e for _, e in dashboard_queries())))
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in exported()}
    missing = {f for f in families if not any(q.startswith(f) for q in queried)}
    assert missing == set()


def test_promtool_checks_and_unit_tests_the_alert_rules():
    promtool = tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(CHART / "files" / "alerts.yaml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 9 rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=HERE, capture_output=True,
                          text=True, timeout=60)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each dashboard query, with Grafana's variables filled in, as a recording rule: promtool parses it."""
    rules = [{"record": f"cpuserve:dashboard_query:{i}",
              "expr": expr.replace("$__rate_interval", "5m").replace("$model", ".*")}
             for i, (_, expr) in enumerate(dashboard_queries())]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    check = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and f"SUCCESS: {len(rules)} rules found" in check.stdout, check.stdout + check.stderr
