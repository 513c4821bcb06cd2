"""Ray's processes off the engine's cores where the node has cores to spare: one replica of one CPU on this 2-core
machine runs its engine on the first core, and every serving process (GCS, raylet, Serve's controller,
the ingress, the replica's own Ray threads) on the other."""

from __future__ import annotations

import os

import httpx
import psutil
import pytest

from cpuserve.serving.affinity import engine_cores, split_cores

SERVE_CONFIG = dict(replicas=1, cpus_per_rank=1)
CORES = sorted(os.sched_getaffinity(0))


def test_split_cores_leaves_the_spare_cores_to_serving(monkeypatch):
    monkeypatch.delenv("CPUSERVE_SPLIT_CORES", raising=False)
    assert split_cores([3, 1, 2, 0], 3) == ([0, 1, 2], [3])
    assert split_cores([0, 1], 2) is None  # no spare core: everything shares them, as without the split
    assert split_cores([0, 1, 2, 3, 4, 5, 6, 7], 4) == ([0, 1, 2, 3], [4, 5, 6, 7])
    monkeypatch.setenv("CPUSERVE_SPLIT_CORES", "0")
    assert split_cores([0, 1, 2, 3], 2) is None


def test_each_replica_takes_its_slice_by_its_rank_on_the_node(monkeypatch):
    monkeypatch.setenv("CPUSERVE_ENGINE_CORES", "0,1,2,3,4,5")
    assert engine_cores(0, 2) == [0, 1]
    assert engine_cores(2, 2) == [4, 5]
    assert engine_cores(3, 2) is None  # more replicas on the node than cut: this one shares the mask it has
    monkeypatch.delenv("CPUSERVE_ENGINE_CORES")
    assert engine_cores(0, 2) is None


def _ray_processes() -> dict[str, psutil.Process]:
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:  # a worker Ray ended meanwhile (a zombie, seen in CI): not one of these
            continue
        for key in ("LLMServer", "Ingress", "ProxyActor", "ServeController", "gcs_server", "raylet"):
            if key in line:
                found[key] = proc
    return found


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores: one for the engine, one for serving")
def test_engine_and_serving_processes_on_their_own_cores(serving):
    engine, rest = CORES[:1], CORES[1:]
    assert os.sched_getaffinity(0) == set(CORES)  # the process that started serving keeps its own mask
    processes = _ray_processes()
    assert set(processes) == {"LLMServer", "Ingress", "ServeController", "gcs_server", "raylet"}  # no proxy (direct ports)
    replica = processes.pop("LLMServer")
    for name, proc in processes.items():
        assert proc.cpu_affinity() == rest, name
    before = {t.id: t.user_time + t.system_time for t in replica.threads()}
    body = {"prompt": "The history of the bicycle", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"http://127.0.0.1:{serving.http_port}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48
    used = {t.id: t.user_time + t.system_time - before.get(t.id, 0.0) for t in replica.threads()}
    busiest = max(used, key=used.get)  # the engine thread: it ran the 48 decode steps
    assert busiest != replica.pid
    assert sorted(os.sched_getaffinity(busiest)) == engine
    on_engine = {tid for tid in used if sorted(os.sched_getaffinity(tid)) == engine}
    assert sum(used[t] for t in on_engine) > 0.8 * sum(used.values())  # the engine's work, on the engine's core
    assert sorted(os.sched_getaffinity(replica.pid)) == rest  # the replica's main thread serves on the other
