"""bench/serve_budget.py's accounting: CPU deltas per process and per replica thread, named the way docs/serving.md
reads them, per output token and per core. Given snapshots, no measurement."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
REPLICA, INGRESS = 4242, 4343  # pids of the snapshots below; this process is os.getpid()


@pytest.fixture(scope="module")
def budget_module():
    sys.path.insert(0, BENCH)  # its own imports: serve_client, serve_servers, serving, workload
    spec = importlib.util.spec_from_file_location("cpuserve_bench_serve_budget", os.path.join(BENCH, "serve_budget.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_budget_splits_the_replica_by_thread_and_the_rest_by_process(budget_module):
    me = os.getpid()
    before = {(REPLICA, REPLICA, "ray::ServeRepli"): 1.0, (REPLICA, 11, "ray::IDLE"): 5.0,
              (REPLICA, 12, "openmp_worker"): 2.0, (REPLICA, 13, "grpc_global_tim"): 0.5,
              (INGRESS, 0, "Ingress replica"): 3.0, (me, 0, "client (bench process)"): 7.0}
    after = {(REPLICA, REPLICA, "ray::ServeRepli"): 1.1, (REPLICA, 11, "ray::IDLE"): 7.0,
             (REPLICA, 12, "openmp_worker"): 3.0, (REPLICA, 13, "grpc_global_tim"): 0.7,
             (REPLICA, 14, "grpc_global_tim"): 0.1,  # a thread started during the level counts from zero
             (INGRESS, 0, "Ingress replica"): 3.4, (me, 0, "client (bench process)"): 7.2}
    rows = budget_module.budget(before, after, tokens=1000, wall=4.0)
    expected = {"replica: engine thread": 2.0, "replica: engine's OpenMP workers": 1.0,
                "replica: Ray's and grpc's threads": 0.3, "Ingress replica": 0.4,
                "client (bench process)": 0.2, "replica: main thread (event loop)": 0.1}
    assert list(rows) == sorted(expected, key=lambda k: -expected[k])  # largest first
    for kind, cpu in expected.items():
        assert rows[kind]["us_per_token"] == pytest.approx(cpu * 1e6 / 1000)
        assert rows[kind]["core_share"] == pytest.approx(cpu / 4.0)


def test_budget_of_the_engine_alone_names_this_process(budget_module):
    me = os.getpid()
    before = {(me, me, "python"): 1.0, (me, me + 1, "python"): 1.0, (me, me + 2, "openmp_worker"): 1.0}
    after = {(me, me, "python"): 1.5, (me, me + 1, "python"): 4.0, (me, me + 2, "openmp_worker"): 2.0}
    rows = budget_module.budget(before, after, tokens=100, wall=3.0)
    assert set(rows) == {"bench process: engine thread", "bench process: engine's OpenMP workers",
                         "bench process: main thread (event loop)"}
    assert rows["bench process: engine thread"]["us_per_token"] == pytest.approx(30_000)
