"""The serving dashboard and alert queries against a real Prometheus scraping a real app under a little traffic:
each returns at least one series, so no panel reads "No data" and no alert is blind (the metric names and labels
are checked statically in tests/charts/test_chart_metrics.py; this checks that samples exist).

An alert expression that is a comparison (`... > 5`) returns nothing while the alert would not fire, so its
left-hand side is evaluated instead: the series the threshold is compared with. The operator's queries need a
running operator and are not checked here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cli_checks import free_port
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "charts"))
from chart_tools import tool  # noqa: E402
from test_chart_metrics import alert_queries, dashboard_queries  # noqa: E402

COMPARISON = re.compile(r"\s*(?:>|<|>=|<=|==|!=)\s*[0-9.e+-]+\s*$")
SCRAPE_INTERVAL_S = 1


def serving_queries(model: str) -> list[tuple[str, str]]:
    """(where, PromQL) of every serving dashboard query (Grafana's variables filled in) and alert left-hand side."""
    out = [(where, expr.replace("$__rate_interval", "1m").replace("$model", model))
           for where, expr in dashboard_queries() if where.startswith("serving-")]
    out += [(where, COMPARISON.sub("", expr)) for where, expr in alert_queries() if "cpuserve_operator" not in expr]
    return out


@pytest.fixture(scope="module")
def prometheus(serving, tmp_path_factory):
    """Prometheus (from `make tools`) scraping the app's metrics endpoint every second; yields its API URL."""
    binary = tool("prometheus")
    folder = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "cpuserve",
                                  "static_configs": [{"targets": [f"127.0.0.1:{serving.metrics_port}"]}]}]}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _scraped(url):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "Prometheus did not scrape the app in 60 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _scraped(url: str) -> bool:
    try:
        targets = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return bool(targets) and all(t["health"] == "up" for t in targets)


def test_every_serving_dashboard_and_alert_query_returns_a_series(serving, prometheus, http_url):
    for i in range(3):  # a little traffic: TTFT, inter-token, end-to-end and queue times, tokens, steps
        r = httpx.post(f"{http_url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
    time.sleep(4 * SCRAPE_INTERVAL_S)  # scrapes after the traffic, so rates over it are defined
    queries = serving_queries(serving.model_name)
    assert len(queries) >= 27  # 22 panels' queries + the $model variable + 5 serving alerts
    empty = []
    for where, expr in queries:
        body = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", f"{where}: {body}"
        if not body["data"]["result"]:
            empty.append(f"{where}: {expr}")
    assert empty == [], "queries without a series:\n" + "\n".join(empty)
