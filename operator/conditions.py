"""Status of an LLMService as pure functions: pods observed -> conditions -> status (spec = desired, status =
observed). Reasons are CamelCase constants; lastTransitionTime moves only when a condition's status does."""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.memory import MemoryPlan
from cpuserve.operator.spec import LLMServiceSpec
from cpuserve.operator.validation import Finding

READY, PROGRESSING, DEGRADED, VALIDATION_FAILED = "Ready", "Progressing", "Degraded", "ValidationFailed"
REASON_ALL_READY = "AllReplicasReady"
REASON_HEAD_NOT_READY = "HeadNotReady"
REASON_REPLICAS_NOT_READY = "ReplicasNotReady"
REASON_RECONCILING = "Reconciling"
REASON_COMPLETE = "ReconcileComplete"
REASON_PODS_FAILING = "PodsFailing"
REASON_NO_FAILURES = "NoFailures"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_SERVE_PENDING = "ServeConfigPending"
REASON_SERVE_UPDATING = "ServeUpdating"
REASON_SERVE_FAILED = "ServeDeployFailed"
SERVE_RUNNING, SERVE_FAILED = "RUNNING", "DEPLOY_FAILED"
REASON_SPEC_VALID = "SpecValid"
FAILING_WAIT_REASONS = frozenset({"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                                  "CreateContainerConfigError", "CreateContainerError"})


@dataclass(frozen=True, slots=True)
class ChildError:
    """A create, patch or delete of one child that the API server refused (its Status reason and message)."""

    verb: str
    kind: str
    name: str
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.verb} {self.kind} {self.name}: {self.message}"


@dataclass(frozen=True, slots=True)
class Observed:
    """What the operator saw of the pods, plus what this pass changed and which child writes failed."""

    head_ready: bool = False
    ready_groups: int = 0
    failing: tuple[str, ...] = ()
    changes: int = 0
    child_errors: tuple[ChildError, ...] = ()
    serve: Any = None
    """serve_api.ServeState of the head's Serve application, None while no head runs."""


def describe_child_errors(errors: tuple[ChildError, ...]) -> str:
    """The first refused write in full (the API's own message), then how many more there were."""
    more = f" (and {len(errors) - 1} more refused child writes)" if len(errors) > 1 else ""
    return f"{errors[0]}{more}"


def is_pod_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def is_pod_failing(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return True
    statuses = (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])
    return any(((s.get("state") or {}).get("waiting") or {}).get("reason") in FAILING_WAIT_REASONS for s in statuses)


def observe_pods(name: str, spec: LLMServiceSpec, pods: list[dict[str, Any]], changes: int = 0,
                 child_errors: tuple[ChildError, ...] = (), serve: Any = None,
                 groups: list[int] | None = None) -> Observed:
    """Summarise the pods of LLMService `name` (already filtered by its labels); `groups`: the replica groups'
    indexes (rollout.plan_groups; None: 0 .. replicas - 1), of which at most `replicas` count as ready."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    head = by_name.get(naming.head_name(name))
    ready_groups = min(spec.replicas, sum(
        all(is_pod_ready(by_name.get(naming.rank_name(name, g, r), {})) for r in range(spec.ranks_per_replica))
        for g in (range(spec.replicas) if groups is None else groups)))
    failing = tuple(sorted(n for n, p in by_name.items() if is_pod_failing(p)))
    return Observed(head is not None and is_pod_ready(head), ready_groups, failing, changes, child_errors, serve)


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


def _serve_progress(serve: Any) -> tuple[str, str] | None:
    """(reason, message) while the head's Serve application is not yet as the spec says, else None."""
    if serve is None:
        return None
    if serve.error:
        return REASON_SERVE_PENDING, f"applying the Serve config through the head's REST API: {serve.error}"
    if serve.applied:
        return REASON_SERVE_UPDATING, "applied a new Serve config in place"
    if serve.status not in (SERVE_RUNNING, SERVE_FAILED):
        return REASON_SERVE_UPDATING, f"Serve application {serve.status}: {serve.message}".rstrip(": ")
    return None


def _degraded(observed: Observed, generation: int) -> dict[str, Any]:
    """Refused child writes first (the API's reason and message), then a failed Serve deploy, then failing pods."""
    failing = ("failing pods: " + ", ".join(observed.failing)) if observed.failing else ""
    if observed.child_errors:
        message = "; ".join(filter(None, (describe_child_errors(observed.child_errors), failing)))
        return _condition(DEGRADED, True, observed.child_errors[0].reason, message, generation)
    if observed.serve is not None and observed.serve.status == SERVE_FAILED:
        message = "; ".join(filter(None, (f"Serve deploy failed: {observed.serve.message}", failing)))
        return _condition(DEGRADED, True, REASON_SERVE_FAILED, message, generation)
    return _condition(DEGRADED, bool(observed.failing), REASON_PODS_FAILING if observed.failing else REASON_NO_FAILURES,
                      failing, generation)


def calculate_conditions(generation: int, replicas: int, observed: Observed, findings: list[Finding],
                         previous: list[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    """The four conditions, in a fixed order, carrying over lastTransitionTime when the status is unchanged."""
    invalid = bool(findings)
    ready = not invalid and observed.head_ready and observed.ready_groups >= replicas
    if invalid:
        ready_c = _condition(READY, False, REASON_INVALID_SPEC, "the spec is invalid: see ValidationFailed", generation)
        progress_c = _condition(PROGRESSING, False, REASON_INVALID_SPEC, "waiting for a valid spec", generation)
    else:
        if ready:
            ready_c = _condition(READY, True, REASON_ALL_READY, f"{observed.ready_groups}/{replicas} replica "
                                 "groups ready", generation)
        elif not observed.head_ready:
            ready_c = _condition(READY, False, REASON_HEAD_NOT_READY, "the Ray head pod is not ready", generation)
        else:
            ready_c = _condition(READY, False, REASON_REPLICAS_NOT_READY,
                                 f"{observed.ready_groups}/{replicas} replica groups ready", generation)
        busy = observed.changes > 0 or not ready or bool(observed.child_errors)
        if observed.child_errors:  # the API's reason, e.g. Forbidden; retried with backoff
            progress_c = _condition(PROGRESSING, True, observed.child_errors[0].reason,
                                    "retrying with backoff: " + describe_child_errors(observed.child_errors),
                                    generation)
        elif (serving := _serve_progress(observed.serve)) is not None:
            progress_c = _condition(PROGRESSING, True, serving[0], serving[1], generation)
        else:
            progress_c = _condition(PROGRESSING, busy, REASON_RECONCILING if busy else REASON_COMPLETE,
                                    f"{observed.changes} children changed" if observed.changes else
                                    ("waiting for pods to become ready" if busy else "all children up to date"),
                                    generation)
    degraded_c = _degraded(observed, generation)
    invalid_c = _condition(VALIDATION_FAILED, invalid, REASON_INVALID_SPEC if invalid else REASON_SPEC_VALID,
                           "; ".join(str(f) for f in findings), generation)
    before = {c.get("type"): c for c in previous}
    out = []
    for cond in (ready_c, progress_c, degraded_c, invalid_c):
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime")
        cond["lastTransitionTime"] = old["lastTransitionTime"] if same else now
        out.append(cond)
    return out


def model_label(spec: LLMServiceSpec) -> str:
    """Short name of the model for the printer column."""
    m = spec.model
    if m.source == "pvc":
        return posixpath.basename((m.path or "").rstrip("/")) or "pvc"
    if m.source == "url":
        return posixpath.basename((m.url or "").split("?")[0].rstrip("/")) or "url"
    return "SmolLM2-135M-Instruct"


def build_status(body: dict[str, Any], spec: LLMServiceSpec | None, plan: MemoryPlan | None, observed: Observed,
                 findings: list[Finding], now: str) -> dict[str, Any]:
    """The whole .status for this pass."""
    meta = body["metadata"]
    name, ns, generation = meta["name"], meta["namespace"], meta.get("generation", 1)
    previous = (body.get("status") or {}).get("conditions") or []
    replicas = spec.replicas if spec is not None else int((body.get("spec") or {}).get("replicas", 1) or 0)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": calculate_conditions(generation, replicas, observed, findings, previous, now),
        "replicas": replicas, "readyReplicas": observed.ready_groups, "selector": naming.rank_selector(name),
    }
    if spec is not None:
        scheme = "https" if spec.security.tls_secret_name else "http"
        host = f"{name}.{ns}.svc"
        status["model"] = model_label(spec)
        status["endpoints"] = {"grpc": f"{host}:{spec.ports.grpc}", "http": f"{scheme}://{host}:{spec.ports.http}",
                               "metrics": f"http://{naming.metrics_name(name)}.{ns}.svc:{spec.ports.metrics}/metrics"}
    if plan is not None:
        status["memoryPerRank"] = plan.quantity
        status["memoryArithmetic"] = plan.arithmetic
    return status


def status_changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether writing `new` would change anything (rule: write status only if changed)."""
    return {k: v for k, v in (old or {}).items() if k in new} != new
