"""helm lint and helm template with a real helm; every rendered manifest passes kubernetes-validate --strict."""
from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from chart_tools import CHART, K8S_VERSION, helm, render
from cpuserve.operator.crd import build_crd

CI_VALUES = str(CHART / "ci" / "ci-values.yaml")
# other projects' kinds, checked by hand: here, and the InferencePool in test_chart_autoscaling.py
NOT_IN_K8S = {"ServiceMonitor", "PrometheusRule", "InferencePool"}


@pytest.mark.parametrize("values", [[], ["-f", CI_VALUES]], ids=["defaults", "ci-values"])
def test_helm_lint_strict(values):
    result = helm("lint", "--strict", str(CHART), *values, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("values", [[], ["-f", CI_VALUES]], ids=["defaults", "ci-values"])
def test_rendered_manifests_are_valid_kubernetes(values):
    docs = render(*values)
    kinds = sorted(d["kind"] for d in docs)
    for doc in docs:
        if doc["kind"] not in NOT_IN_K8S:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    expected = {"ClusterRole", "ConfigMap", "CustomResourceDefinition", "Deployment", "Service", "ServiceAccount"}
    assert expected <= set(kinds)
    if values:
        assert kinds.count("RoleBinding") == 2 and "ClusterRoleBinding" not in kinds
        assert {"ServiceMonitor", "PrometheusRule", "InferencePool", "HorizontalPodAutoscaler"} <= set(kinds)
    else:
        assert kinds.count("ClusterRoleBinding") == 1 and "RoleBinding" not in kinds
        assert not (NOT_IN_K8S | {"HorizontalPodAutoscaler"}) & set(kinds)


def test_chart_ships_the_generated_crd():
    (crd,) = [d for d in render() if d["kind"] == "CustomResourceDefinition"]
    assert crd == build_crd()


def test_operator_deployment_is_locked_down_and_configured():
    (dep,) = [d for d in render("-f", CI_VALUES) if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert c["args"] == ["--standalone", "--liveness=http://0.0.0.0:8081/healthz", "--namespace=serving",
                         "--namespace=staging", "--verbose"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["CPUSERVE_OPERATOR_IMAGE"] == "cpuserve-serving:0.1.0"
    assert env["CPUSERVE_OPERATOR_METRICS_PORT"] == "8090"
    assert c["image"] == "cpuserve:0.1.0"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_rbac_is_least_privilege():
    (role,) = [d for d in render() if d["kind"] == "ClusterRole"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert not any("*" in item for item in granted)
    assert not any(r in ("nodes", "namespaces", "customresourcedefinitions") for _, r, _ in granted)
    # Secrets: create the generated Ray token, get it by name for the Serve REST API; never list or watch them
    assert {v for _, r, v in granted if r == "secrets"} == {"create", "get"}
    assert ("", "events", "create") in granted and ("", "events", "list") not in granted
    assert ("cpuserve.dev", "llmservices/status", "patch") in granted and ("", "pods", "patch") not in granted
    assert ("cpuserve.dev", "llmservices", "delete") not in granted and ("cpuserve.dev", "llmservices", "create") not in granted


def test_dashboards_are_configmaps_for_the_grafana_sidecar():
    maps = [d for d in render("-f", CI_VALUES) if d["kind"] == "ConfigMap"]
    assert sorted(m["metadata"]["name"] for m in maps) == ["rel-cpuserve-operator-health", "rel-cpuserve-serving-overview"]
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert m["metadata"]["namespace"] == "monitoring"
        (body,) = m["data"].values()
        dash = json.loads(body)
        assert dash["uid"].startswith("cpuserve-") and dash["panels"]
    assert not [d for d in render("--set", "grafana.dashboards.enabled=false") if d["kind"] == "ConfigMap"]


def test_prometheus_rule_is_the_promtool_tested_file():
    (rule,) = [d for d in render("-f", CI_VALUES) if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    (sm,) = [d for d in render("-f", CI_VALUES) if d["kind"] == "ServiceMonitor"]
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]


@pytest.mark.parametrize("values", [[], ["-f", CI_VALUES]], ids=["defaults", "ci-values"])
def test_network_policies_name_the_operator_pods_the_chart_runs(values):
    """The operator's labels and namespace that LLMServices' NetworkPolicies admit are its pods' own."""
    from cpuserve.operator.settings import OperatorSettings

    (deploy,) = [d for d in render(*values) if d["kind"] == "Deployment"]
    template = deploy["spec"]["template"]
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    assert env["CPUSERVE_OPERATOR_POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    labels = OperatorSettings(pod_labels=env["CPUSERVE_OPERATOR_POD_LABELS"]["value"]).operator_pod_labels()
    assert labels and labels.items() <= template["metadata"]["labels"].items()
