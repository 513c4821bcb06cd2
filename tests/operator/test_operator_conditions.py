"""Conditions and status as pure functions of what was observed (table-driven, KubeRay TestCalculateConditions)."""
from __future__ import annotations

import pytest

from cpuserve.operator.conditions import (ChildError, Observed, build_status, calculate_conditions, observe_pods,
                                          status_changed)
from cpuserve.operator.memory import plan_memory
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import Finding, validate
from cpuserve.operator.serve_api import ServeState
from llmservice_factory import make_body

T0, T1 = "2025-01-01T00:00:00Z", "2025-01-01T00:01:00Z"
BAD = [Finding("spec.ranksPerReplica", 9, "too many")]
REFUSED = (ChildError("create", "Pod", "chat-head", "Forbidden", 'pods "chat-head" is forbidden: no sa'),
           ChildError("create", "Pod", "chat-g0-r0", "Forbidden", 'pods "chat-g0-r0" is forbidden: no sa'))


def pod(name, ready=False, waiting=None, phase="Running"):
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if waiting:
        status["containerStatuses"] = [{"name": "c", "state": {"waiting": {"reason": waiting}}}]
    return {"metadata": {"name": name}, "status": status}


def summary(conds):
    return {c["type"]: (c["status"], c["reason"]) for c in conds}


CASES = [  # (replicas, observed, findings, expected {type: (status, reason)})
    (2, Observed(True, 2), [], {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "ReconcileComplete"),
                                "Degraded": ("False", "NoFailures"), "ValidationFailed": ("False", "SpecValid")}),
    (2, Observed(True, 1), [], {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "Reconciling"),
                                "Degraded": ("False", "NoFailures"), "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(False, 1, changes=3), [], {"Ready": ("False", "HeadNotReady"), "Progressing": ("True", "Reconciling"),
                                            "Degraded": ("False", "NoFailures"),
                                            "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(True, 0, ("chat-g0-r0",)), [], {"Ready": ("False", "ReplicasNotReady"),
                                                 "Progressing": ("True", "Reconciling"),
                                                 "Degraded": ("True", "PodsFailing"),
                                                 "ValidationFailed": ("False", "SpecValid")}),
    (0, Observed(True, 0), [], {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "ReconcileComplete"),
                                "Degraded": ("False", "NoFailures"), "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(False, 0, changes=3, child_errors=REFUSED), [], {
        "Ready": ("False", "HeadNotReady"), "Progressing": ("True", "Forbidden"), "Degraded": ("True", "Forbidden"),
        "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(True, 1, ("chat-g0-r0",), child_errors=REFUSED[1:]), [], {
        "Ready": ("True", "AllReplicasReady"), "Progressing": ("True", "Forbidden"), "Degraded": ("True", "Forbidden"),
        "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(True, 1, serve=ServeState("RUNNING")), [], {
        "Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "ReconcileComplete"),
        "Degraded": ("False", "NoFailures"), "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(False, 1, serve=ServeState(error="connection refused")), [], {
        "Ready": ("False", "HeadNotReady"), "Progressing": ("True", "ServeConfigPending"),
        "Degraded": ("False", "NoFailures"), "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(True, 1, serve=ServeState("RUNNING", applied=True)), [], {
        "Ready": ("True", "AllReplicasReady"), "Progressing": ("True", "ServeUpdating"),
        "Degraded": ("False", "NoFailures"), "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(True, 1, serve=ServeState("DEPLOY_FAILED", "the model file is missing")), [], {
        "Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "ReconcileComplete"),
        "Degraded": ("True", "ServeDeployFailed"), "ValidationFailed": ("False", "SpecValid")}),
    (1, Observed(True, 1), BAD, {"Ready": ("False", "InvalidSpec"), "Progressing": ("False", "InvalidSpec"),
                                 "Degraded": ("False", "NoFailures"), "ValidationFailed": ("True", "InvalidSpec")}),
]


@pytest.mark.parametrize("replicas,observed,findings,expected", CASES)
def test_calculate_conditions(replicas, observed, findings, expected):
    conds = calculate_conditions(7, replicas, observed, findings, [], T0)
    assert summary(conds) == expected
    assert all(c["observedGeneration"] == 7 and c["lastTransitionTime"] == T0 for c in conds)


def test_transition_time_moves_only_with_status():
    first = calculate_conditions(1, 1, Observed(True, 0), [], [], T0)
    again = calculate_conditions(1, 1, Observed(True, 0), [], first, T1)
    assert [c["lastTransitionTime"] for c in again] == [T0] * 4
    ready = calculate_conditions(1, 1, Observed(True, 1), [], first, T1)
    assert {c["type"]: c["lastTransitionTime"] for c in ready} == {
        "Ready": T1, "Progressing": T1, "Degraded": T0, "ValidationFailed": T0}


def test_validation_message_names_the_field():
    (invalid,) = [c for c in calculate_conditions(1, 1, Observed(), BAD, [], T0) if c["type"] == "ValidationFailed"]
    assert invalid["message"] == "spec.ranksPerReplica=9: too many"


def test_observe_pods_counts_complete_groups_and_failures():
    spec, _ = validate(make_body(replicas=3, ranksPerReplica=2), OperatorSettings())
    pods = [pod("chat-head", True), pod("chat-g0-r0", True), pod("chat-g0-r1", True), pod("chat-g1-r0", True),
            pod("chat-g1-r1", False, "CrashLoopBackOff"), pod("chat-g2-r0", False, phase="Failed")]
    assert observe_pods("chat", spec, pods) == Observed(True, 1, ("chat-g1-r1", "chat-g2-r0"), 0)


def test_status_shows_arithmetic_endpoints_and_scale_fields():
    body = make_body(namespace="ml", replicas=2, security={"tlsSecretName": "t"})
    spec, _ = validate(body, OperatorSettings())
    status = build_status(body, spec, plan_memory(spec), Observed(True, 2), [], T0)
    assert status["replicas"] == 2 and status["readyReplicas"] == 2 and status["observedGeneration"] == 1
    assert status["selector"] == "cpuserve.dev/llmservice=chat,app.kubernetes.io/component=rank"
    assert status["endpoints"] == {"grpc": "chat.ml.svc:9000", "http": "https://chat.ml.svc:8000",
                                   "metrics": "http://chat-metrics.ml.svc:8080/metrics"}
    # 134515008 x 0.75 B = 96.21 MiB, + 1024 MiB KV + 1024 MiB overhead = 2144.21 -> 2145Mi
    assert status["memoryPerRank"] == "2145Mi" and "134515008 params x 0.75 B int4/g32" in status["memoryArithmetic"]
    assert status["model"] == "SmolLM2-135M-Instruct"
    assert not status_changed({**status, "extra": 1}, status)
    body["status"] = status
    assert not status_changed(status, build_status(body, spec, plan_memory(spec), Observed(True, 2), [], T1))
    assert status_changed(status, build_status(body, spec, plan_memory(spec), Observed(True, 1), [], T1))


def test_refused_child_writes_are_named_with_the_api_message():
    conds = {c["type"]: c for c in calculate_conditions(1, 1, Observed(child_errors=REFUSED, failing=("x",)), [], [], T0)}
    assert conds["Degraded"]["message"] == ('create Pod chat-head: pods "chat-head" is forbidden: no sa '
                                            "(and 1 more refused child writes); failing pods: x")
    assert conds["Progressing"]["message"] == ('retrying with backoff: create Pod chat-head: pods "chat-head" is '
                                               "forbidden: no sa (and 1 more refused child writes)")
