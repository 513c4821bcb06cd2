"""kopf handlers: one idempotent reconcile, run on resume/create/update, on a drift timer and on child pod
events. Import this module to register them (cli.py does); nothing here runs at import but reading settings."""
from __future__ import annotations

import copy
import threading
import time
from typing import Any

import kopf
from prometheus_client import start_http_server

from cpuserve.operator.backoff import Backoff
from cpuserve.operator.conditions import describe_child_errors
from cpuserve.operator.crd import GROUP, KIND, PLURAL, VERSION
from cpuserve.operator.kube import Kube, KubeError
from cpuserve.operator.metrics import OperatorMetrics, build_operator_metrics
from cpuserve.operator.reconcile import Outcome, reconcile
from cpuserve.operator.settings import OperatorSettings

SETTINGS = OperatorSettings()  # read once: the timer's interval is fixed at registration
RETRY_DELAY_SECONDS = 10.0  # after a failed read (list, get): the API server itself is in trouble


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Storage under our own prefix, the API client, the ServiceMonitor probe and the metrics endpoint."""
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.reporting_component = "cpuserve-operator"
    settings.scanning.disabled = True  # no cluster-wide watch of namespaces and CRDs: less RBAC
    settings.execution.max_workers = 4
    memo.settings = SETTINGS
    memo.kube = Kube.from_environment()
    memo.locks = {}
    memo.backoff = Backoff(SETTINGS.retry_base_seconds, SETTINGS.retry_max_seconds)
    memo.change_retries = set()  # LLMServices whose change handler retries refused child writes itself
    mode = SETTINGS.service_monitors
    memo.with_service_monitor = mode == "always" or (mode == "auto" and memo.kube.has_api("monitoring.coreos.com/v1"))
    memo.metrics = build_operator_metrics()
    if SETTINGS.metrics_port:
        start_http_server(SETTINGS.metrics_port, registry=memo.metrics.registry)
    logger.info(f"cpuserve operator: image {SETTINGS.image}, ServiceMonitors {memo.with_service_monitor}, "
                f"metrics on :{SETTINGS.metrics_port or 'off'}")


def _run(body: Any, memo: kopf.Memo) -> Outcome:
    """One locked, measured reconcile of one LLMService."""
    raw = copy.deepcopy(dict(body))
    key = f"{raw['metadata']['namespace']}/{raw['metadata']['name']}"
    metrics: OperatorMetrics = memo.metrics
    with memo.locks.setdefault(key, threading.Lock()), metrics.reconcile_duration.time():
        try:
            outcome = reconcile(raw, memo.kube, memo.settings, memo.with_service_monitor)
        except KubeError as err:
            metrics.errors.inc()
            metrics.reconciles.labels(result="retry").inc()
            raise kopf.TemporaryError(f"Kubernetes API: {err}", delay=RETRY_DELAY_SECONDS) from err
        except Exception:
            metrics.errors.inc()
            metrics.reconciles.labels(result="error").inc()
            raise
    metrics.reconciles.labels(result=outcome.result).inc()
    metrics.set_conditions(key, outcome.status["conditions"])
    if outcome.new_findings:
        kopf.warn(raw, reason="ValidationFailed", message="; ".join(str(f) for f in outcome.findings))
    if outcome.new_child_errors:
        kopf.warn(raw, reason=outcome.child_errors[0].reason, message=describe_child_errors(outcome.child_errors))
    return outcome


def _key(body: Any) -> str:
    return f"{body['metadata']['namespace']}/{body['metadata']['name']}"


def _held_back(body: Any, memo: kopf.Memo) -> bool:
    """The timer and pod events skip a pass inside the backoff window, or while the change handler's own retry
    is pending (two passes at the window's end would double the backoff)."""
    key = _key(body)
    return key in memo.change_retries or bool(memo.backoff.remaining(key, time.monotonic(), _generation(body)))


def _generation(body: Any) -> int:
    return int(body["metadata"].get("generation") or 1)


def _note_refusals(outcome: Outcome, body: Any, memo: kopf.Memo) -> float:
    """After a pass: the backoff delay when the API server refused child writes (the status says so by now), else 0."""
    if not outcome.child_errors:
        memo.backoff.succeeded(_key(body))
        return 0.0
    return memo.backoff.refused(_key(body), time.monotonic(), _generation(body))


def _write(patch: kopf.Patch, outcome: Outcome) -> None:
    if outcome.status_changed:
        patch.status.update(outcome.status)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """Reconcile on every spec change; an invalid spec fails permanently (no retries until the next change)."""
    if wait := memo.backoff.remaining(_key(body), time.monotonic(), _generation(body)):
        raise kopf.TemporaryError("backing off after refused child writes", delay=wait)
    memo.change_retries.discard(_key(body))
    outcome = _run(body, memo)
    _write(patch, outcome)
    if outcome.findings:
        raise kopf.PermanentError("invalid spec: " + "; ".join(str(f) for f in outcome.findings))
    if delay := _note_refusals(outcome, body, memo):
        memo.change_retries.add(_key(body))  # this handler's retry is the next pass: the timer waits for it
        raise kopf.TemporaryError("the API server refused child writes: "
                                  + describe_child_errors(outcome.child_errors), delay=delay)
    if outcome.serve_error:  # the head runs but its dashboard is not up yet: look again soon, no backoff window
        raise kopf.TemporaryError(outcome.serve_error, delay=memo.settings.retry_base_seconds)


@kopf.timer(GROUP, VERSION, PLURAL, interval=SETTINGS.resync_seconds, initial_delay=SETTINGS.resync_seconds)
def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """Drift correction: the same reconcile, quietly (an invalid spec posts no new Event)."""
    if body.metadata.get("deletionTimestamp") or _held_back(body, memo):
        return
    outcome = _run(body, memo)
    _write(patch, outcome)
    _note_refusals(outcome, body, memo)


@kopf.on.event("", "v1", "pods", labels={"app.kubernetes.io/managed-by": "cpuserve-operator"})
def on_pod_event(event: dict[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child pod changed (ready, failed, deleted): reconcile its LLMService at once."""
    if event.get("type") is None:  # the initial listing; on_change's resume covers it
        return
    owner = next((o for o in body.metadata.get("ownerReferences") or [] if o.get("kind") == KIND), None)
    if owner is None:
        return
    ns = body.metadata["namespace"]
    try:
        parent = memo.kube.get(KIND, ns, owner["name"])
    except KubeError as err:
        raise kopf.TemporaryError(f"reading {KIND} {ns}/{owner['name']}: {err}", delay=RETRY_DELAY_SECONDS)
    if parent is None or parent["metadata"].get("uid") != owner.get("uid") or parent["metadata"].get("deletionTimestamp"):
        return
    if _held_back(parent, memo):
        return  # the pending retry sees this pod too
    outcome = _run(parent, memo)
    if outcome.status_changed:
        memo.kube.merge_patch(KIND, ns, owner["name"], {"status": outcome.status}, sub="status")
    _note_refusals(outcome, parent, memo)  # event handlers are not retried: the timer (or a change) retries


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_llmservice_event(event: dict[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Forget a deleted LLMService in the managed gauge; its children go by owner reference (GC)."""
    if event.get("type") == "DELETED":
        memo.metrics.forget(f"{body.metadata['namespace']}/{body.metadata['name']}")

