"""The chart's HorizontalPodAutoscalers and InferencePools (values `autoscaling`, `inferencePool`), rendered by a real
helm: each HPA passes the real Kubernetes schemas (kubernetes-validate, offline: its schemas ship in the package),
scales an LLMService through the scale subresource the CRD declares, on metric names the serving replicas export,
with llm-d's default thresholds; each InferencePool selects exactly the rank-0 pods the operator makes, on their
HTTP port.

No Kubernetes API server, HPA controller or endpoint picker runs here: the serving side of both (each replica's
gauges crossing the threshold under load) is tests/serving/test_engine_metrics_protocol.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml

from chart_tools import CHART, K8S_VERSION, render
from cpuserve.engine.llm_engine import EngineStats
from cpuserve.engine.settings import ENGINE_HTTP_PORT
from cpuserve.operator.children import build_children
from cpuserve.operator.crd import API_VERSION, KIND, build_crd
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import PortsSpec
from cpuserve.operator.validation import validate
from cpuserve.serving.engine_metrics import EngineCollector

SERVICES = ["--set", "autoscaling.enabled=true",
            "--set", "autoscaling.llmServices[0].name=smollm2", "--set", "autoscaling.llmServices[0].namespace=ml",
            "--set", "autoscaling.llmServices[1].name=big", "--set", "autoscaling.llmServices[1].maxReplicas=8"]
POOL = ["--set", "inferencePool.enabled=true", "--set", "inferencePool.llmServices[0].name=smollm2",
        "--set", "inferencePool.llmServices[0].namespace=ml"]

# inference.networking.k8s.io/v1 InferencePool, written from the extension's Go types
# (kubernetes-sigs/gateway-api-inference-extension, api/v1/inferencepool_types.go and shared_types.go): spec.selector
# is a LabelSelector of matchLabels only, targetPorts exactly one {number 1-65535}, endpointPickerRef {group, kind
# (default Service), name, port {number} (required for a Service), failureMode FailOpen|FailClose}.
PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_V1 = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"}, "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {"type": "object", "additionalProperties": False,
                 "required": ["selector", "targetPorts", "endpointPickerRef"],
                 "properties": {
                     "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                                  "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                                 "additionalProperties": {"type": "string"}}}},
                     "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": PORT},
                     "endpointPickerRef": {
                         "type": "object", "additionalProperties": False, "required": ["name"],
                         "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                                        "name": {"type": "string", "minLength": 1, "maxLength": 253}, "port": PORT,
                                        "failureMode": {"enum": ["FailOpen", "FailClose"]}},
                         "if": {"properties": {"kind": {"const": "Service"}}}, "then": {"required": ["port"]}}}}},
}


def kinds(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def test_off_by_default():
    docs = render(*SERVICES[2:], *POOL[2:])  # services listed, the switches left off
    assert not kinds(docs, "HorizontalPodAutoscaler") and not kinds(docs, "InferencePool")


def test_one_valid_hpa_per_llmservice_through_the_scale_subresource():
    hpas = kinds(render(*SERVICES), "HorizontalPodAutoscaler")
    for hpa in hpas:
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    assert [(h["metadata"]["namespace"], h["metadata"]["name"]) for h in hpas] == [("ml", "smollm2"), ("ops", "big")]
    assert [(h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) for h in hpas] == [(1, 4), (1, 8)]
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == (API_VERSION, KIND)
    (version,) = build_crd()["spec"]["versions"]
    scale = version["subresources"]["scale"]  # what the HPA's scaleTargetRef goes through
    assert scale["specReplicasPath"] == ".spec.replicas" and scale["labelSelectorPath"] == ".status.selector"


def test_thresholds_are_llm_d_defaults_on_names_the_replicas_export():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["autoscaling"]
    assert (values["queueDepthTarget"], values["kvCacheUsageTarget"]) == (5, 0.8)  # llm-d's defaults, documented
    (hpa, _) = kinds(render(*SERVICES), "HorizontalPodAutoscaler")
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert targets == {"vllm:num_requests_waiting": {"type": "AverageValue", "averageValue": "5"},
                       "vllm:kv_cache_usage_perc": {"type": "AverageValue", "averageValue": "0.8"}}
    stats = EngineStats(num_running=1, num_waiting=2, kv_cache_usage=0.25, num_preemptions=0, last_step_seconds=0.0,
                        num_free_blocks=3, num_blocks=4)
    exported = {m.name for m in EngineCollector(SimpleNamespace(stats=lambda: stats), "m", 16).collect()}
    assert set(targets) <= exported
    custom = render(*SERVICES, "--set", "autoscaling.queueDepthTarget=2", "--set", "autoscaling.kvCacheUsageTarget=0.5")
    (hpa, _) = kinds(custom, "HorizontalPodAutoscaler")
    assert [m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]] == ["2", "0.5"]


def test_inference_pool_selects_the_rank0_pods_the_operator_makes_on_their_http_port():
    """The pool's pods are those holding an engine (a group's rank 0), never the head or another rank; its target
    port is the one they declare, name to their replica (CPUSERVE_ENGINE_HTTP_PORT) and probe for readiness."""
    (pool,) = kinds(render(*POOL), "InferencePool")
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    assert pool["metadata"]["namespace"] == "ml"
    assert pool["spec"]["targetPorts"] == [{"number": PortsSpec().http}]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "smollm2-epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    body = yaml.safe_load((CHART / "examples" / "llmservice-smollm2.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="u1")
    body["spec"].update(replicas=2, ranksPerReplica=2)
    spec, findings = validate(body, OperatorSettings())
    assert findings == []
    pods = [m for m in build_children(body, spec, OperatorSettings(), with_service_monitor=False)
            if m["kind"] == "Pod"]
    wanted = pool["spec"]["selector"]["matchLabels"]
    selected = [p["metadata"]["name"] for p in pods if wanted.items() <= p["metadata"]["labels"].items()]
    assert selected == ["smollm2-g0-r0", "smollm2-g1-r0"], "the rank-0 pods, never the head or rank 1"
    (target,) = pool["spec"]["targetPorts"]
    for pod in (p for p in pods if p["metadata"]["name"] in selected):
        (container,) = pod["spec"]["containers"]
        assert {"name": "http", "containerPort": target["number"]} in container["ports"]
        assert {"name": ENGINE_HTTP_PORT.name, "value": str(target["number"])} in container["env"]
        assert container["readinessProbe"]["httpGet"]["port"] == "http"


@pytest.mark.parametrize("setting", ["inferencePool.endpointPicker.failureMode=Sometimes",
                                     "autoscaling.kvCacheUsageTarget=1.5", "autoscaling.llmServices[0].name=Bad_Name"])
def test_schema_refuses_bad_settings(setting):
    from chart_tools import helm

    result = helm("template", "rel", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0 and setting.split("=")[0].split(".")[-1].split("[")[0] in result.stderr, \
        result.stderr
