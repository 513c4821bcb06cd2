"""Services, PodDisruptionBudget and ServiceMonitor of an LLMService: pure functions of the CR."""
from __future__ import annotations

from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.spec import LLMServiceSpec


def _service(name: str, svc_name: str, selector: dict[str, str], ports: list[dict[str, Any]],
             headless: bool = False, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "ClusterIP", "selector": selector, "ports": ports}
    if headless:  # DNS names for every pod, ready or not: ranks reach the head before it serves
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    labels = {**naming.base_labels(name), **(extra_labels or {})}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": svc_name, "labels": labels}, "spec": spec}


def _port(port_name: str, port: int, app_protocol: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}
    if app_protocol:
        out["appProtocol"] = app_protocol
    return out


def build_services(name: str, spec: LLMServiceSpec) -> list[dict[str, Any]]:
    """The serving Service (gRPC + HTTP), the metrics Services (the head's service-wide `cpuserve_*`, and every rank
    pod's own engine gauges: a ServiceMonitor scrapes each of its endpoints, i.e. each pod) and the headless rendezvous
    Service."""
    head = {naming.LABEL_SERVICE: name, naming.LABEL_COMPONENT: "head"}
    ranks = {naming.LABEL_SERVICE: name, naming.LABEL_COMPONENT: "rank"}
    everyone = {naming.LABEL_SERVICE: name}
    p = spec.ports
    return [
        _service(name, name, head, [_port("grpc", p.grpc, "grpc"), _port("http", p.http, "http")]),
        _service(name, naming.metrics_name(name), head, [_port("metrics", p.metrics, "http")],
                 extra_labels={naming.LABEL_COMPONENT: "metrics"}),
        _service(name, naming.engine_metrics_name(name), ranks,
                 [_port("engine-metrics", p.engine_metrics, "http")],
                 extra_labels={naming.LABEL_COMPONENT: "metrics"}),
        _service(name, naming.headless_name(name), everyone, [_port("gcs", naming.RAY_GCS_PORT)], headless=True),
    ]


def build_pdb(name: str) -> dict[str, Any]:
    """Voluntary disruptions take at most one rank pod at a time, i.e. at most one replica group."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": naming.base_labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {naming.LABEL_SERVICE: name,
                                                                   naming.LABEL_COMPONENT: "rank"}}},
    }


def build_service_monitor(name: str) -> dict[str, Any]:
    """Prometheus Operator ServiceMonitor scraping the metrics Service."""
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": name, "labels": naming.base_labels(name)},
        "spec": {
            "selector": {"matchLabels": {naming.LABEL_SERVICE: name, naming.LABEL_COMPONENT: "metrics"}},
            # each endpoint scrapes the Services that have its port: the head's, and every rank pod's
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"},
                          {"port": "engine-metrics", "path": "/metrics", "interval": "15s"}],
        },
    }
