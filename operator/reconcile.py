"""One reconcile pass of one LLMService: validate -> children -> status. Level-based and idempotent:
it compares what exists with what the CR asks for, never what changed."""
from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass, field
from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.children import build_children, rank_pod_revision
from cpuserve.operator.conditions import (DEGRADED, ChildError, Observed, build_status, is_pod_failing, observe_pods,
                                          status_changed)
from cpuserve.operator.kube import Kube, KubeError
from cpuserve.operator.memory import plan_memory
from cpuserve.operator.rollout import plan_groups
from cpuserve.operator.security import build_ray_token_secret, ray_token_secret_name
from cpuserve.operator.serve_api import ServeApi, ServeState, dashboard_url, read_token, sync
from cpuserve.operator.serve_document import build_serve_document
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import Finding, validate


@dataclass(slots=True)
class Outcome:
    status: dict[str, Any]
    status_changed: bool
    findings: list[Finding] = field(default_factory=list)
    changes: int = 0
    new_findings: bool = False
    """The spec is invalid and the status did not say so yet for this generation: post an Event."""
    child_errors: tuple[ChildError, ...] = ()
    """Child writes the API server refused this pass: the caller retries with backoff."""
    new_child_errors: bool = False
    """The refusal differs from what the status already said: post an Event."""
    serve_error: str = ""
    """The head runs but its Serve REST API could not be used (it is starting): retry soon."""

    @property
    def result(self) -> str:
        return "invalid" if self.findings else "retry" if self.child_errors else "success"


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Writes:
    """Child writes of one pass: each refusal is kept (with the API's reason) and the pass goes on."""

    def __init__(self) -> None:
        self.changes, self.errors = 0, []

    def do(self, verb: str, kind: str, name: str, call, *args: Any) -> None:
        """One write; a create that finds the child already there (another pass got there first) is no change."""
        try:
            out = call(*args)
        except KubeError as err:
            self.errors.append(ChildError(verb, kind, name, err.reason, err.message))
            return
        self.changes += verb != "create" or out is not None


def apply_children(kube: Kube, body: dict[str, Any], desired: list[dict[str, Any]], kinds: list[str],
                   create_only: list[dict[str, Any]] = (), keep: frozenset[str] = frozenset(),
                   existing_pods: list[dict[str, Any]] | None = None) -> tuple[int, tuple[ChildError, ...]]:
    """Make the children of `body` equal `desired`; returns how many were created, changed or deleted, and
    the writes the API server refused (the others still happen: one refused pod does not stop the Services).

    `create_only` children (the generated Ray token Secret) are created first when missing and never compared
    or patched. A pod whose spec hash differs is deleted and recreated on a later pass (pods are immutable and a
    deleted pod keeps its name while it terminates): the head, or a rank pod edited by hand; a change of the rank
    pods gives new groups instead (rollout.py). Other kinds are merge-patched in place. Pods named in `keep` are
    not desired but stay (a Ray actor still runs on them).
    """
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    selector = f"{naming.LABEL_SERVICE}={name}"
    writes = _Writes()
    for manifest in create_only:  # 409 (exists) is no change
        writes.do("create", manifest["kind"], manifest["metadata"]["name"], kube.create, manifest)
    existing = {(kind, obj["metadata"]["name"]): obj for kind in kinds
                for obj in (existing_pods if kind == "Pod" and existing_pods is not None else kube.list(kind, ns, selector))}
    for manifest in desired:
        kind, child = key = (manifest["kind"], manifest["metadata"]["name"])
        current = existing.pop(key, None)
        if current is None:
            writes.do("create", kind, child, kube.create, manifest)
            continue
        if current["metadata"].get("deletionTimestamp"):
            writes.changes += 1  # still terminating: recreate when it is gone
            continue
        if (current["metadata"].get("annotations") or {}).get(naming.ANNOTATION_HASH) == \
                manifest["metadata"]["annotations"][naming.ANNOTATION_HASH]:
            continue
        if kind == "Pod":
            writes.do("delete", "Pod", child, kube.delete, "Pod", ns, child)
        else:
            meta = {k: manifest["metadata"][k] for k in ("labels", "annotations", "ownerReferences")}
            writes.do("patch", kind, child, kube.merge_patch, kind, ns, child, {"metadata": meta, "spec": manifest["spec"]})
    uid = body["metadata"]["uid"]
    for (kind, child), obj in existing.items():  # e.g. rank pods of an old revision, or after a scale-down
        owners = obj["metadata"].get("ownerReferences") or []
        if kind == "Pod" and child in keep:
            writes.changes += 1  # a rollout or scale-down in progress
        elif any(o.get("uid") == uid for o in owners) and not obj["metadata"].get("deletionTimestamp"):
            writes.do("delete", kind, child, kube.delete, kind, ns, child)
    return writes.changes, tuple(writes.errors)


def reconcile(body: dict[str, Any], kube: Kube, settings: OperatorSettings, with_service_monitor: bool,
              now: str | None = None) -> Outcome:
    """Validate, converge the children, compute the status. The caller writes the status if changed."""
    now = now or now_iso()
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    old_status = body.get("status") or {}
    spec, findings = validate(body, settings)
    pods = kube.list("Pod", ns, f"{naming.LABEL_SERVICE}={name}")
    if findings:
        failing = tuple(sorted(p["metadata"]["name"] for p in pods if is_pod_failing(p)))
        status = build_status(body, None, None, Observed(failing=failing), findings, now)
        old = {c.get("type"): c for c in old_status.get("conditions") or []}.get("ValidationFailed") or {}
        new = status["conditions"][-1]
        is_new = (old.get("status"), old.get("message"), old.get("observedGeneration")) != \
            (new["status"], new["message"], new["observedGeneration"])
        return Outcome(status, status_changed(old_status, status), findings, 0, is_new)
    assert spec is not None
    kinds = ["Service", "Pod", "PodDisruptionBudget", "NetworkPolicy"] + (["ServiceMonitor"] if with_service_monitor else [])
    create_only = [] if spec.security.ray_auth_token_secret else \
        [naming.finish(build_ray_token_secret(name, secrets.token_urlsafe(32)), body)]
    revision = rank_pod_revision(name, spec, settings)
    serve = _sync_serve(kube, body, spec, settings, pods, revision)
    ranks = [p for p in pods if naming.LABEL_GROUP in (p["metadata"].get("labels") or {})]
    # no head, no Ray cluster: no actor runs anywhere
    busy = serve.busy if serve is not None else frozenset()
    plan = plan_groups(spec.replicas, revision, ranks, None if busy is None else set(busy))
    changes, errors = apply_children(kube, body, build_children(body, spec, settings, with_service_monitor, plan.groups),
                                     kinds, create_only, plan.keep, pods)
    if changes:
        pods = kube.list("Pod", ns, f"{naming.LABEL_SERVICE}={name}")
    # the old groups still serving count as ready groups while a change rolls: the service answers meanwhile
    draining = {int(p["metadata"]["labels"][naming.LABEL_GROUP]) for p in ranks if p["metadata"]["name"] in plan.keep}
    observed = observe_pods(name, spec, pods, changes, errors, serve, plan.groups + sorted(draining))
    status = build_status(body, spec, plan_memory(spec), observed, [], now)
    return Outcome(status, status_changed(old_status, status), [], changes, child_errors=errors,
                   new_child_errors=bool(errors) and _said(old_status, DEGRADED) != _said(status, DEGRADED),
                   serve_error=serve.error if serve is not None else "")


def _sync_serve(kube: Kube, body: dict[str, Any], spec: Any, settings: OperatorSettings,
                pods: list[dict[str, Any]], revision: str) -> ServeState | None:
    """Apply the Serve config to a running head through Ray Serve's REST API; None while no head runs."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    head = next((p for p in pods if p["metadata"]["name"] == naming.head_name(name)), None)
    if head is None or head["metadata"].get("deletionTimestamp") or (head.get("status") or {}).get("phase") != "Running":
        return None
    try:
        token = read_token(kube, ns, name, spec)
    except KubeError as err:
        return ServeState(error=f"reading the Ray token Secret: {err.message}")
    if token is None:
        return ServeState(error=f"the Ray token Secret {ray_token_secret_name(name, spec)} has no key token yet")
    return sync(ServeApi(dashboard_url(settings, name, ns), token), build_serve_document(spec, revision))


def _said(status: dict[str, Any], ctype: str) -> tuple[Any, ...]:
    """(status, reason, message) of one condition: whether a refusal is news (one Event per distinct one)."""
    cond = next((c for c in status.get("conditions") or [] if c.get("type") == ctype), {})
    return cond.get("status"), cond.get("reason"), cond.get("message")
