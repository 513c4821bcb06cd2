"""The operator's own Prometheus metrics (reconciles by result, duration, errors, LLMServices by condition)."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

RESULTS = ("success", "invalid", "retry", "error")
CONDITIONS = ("Ready", "Progressing", "Degraded", "ValidationFailed")
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class OperatorMetrics:
    registry: CollectorRegistry
    reconciles: Counter
    reconcile_duration: Histogram
    errors: Counter
    managed: Gauge
    _conditions: dict[str, set[str]] = field(default_factory=dict)
    """LLMService key -> the condition types that are True for it."""

    def set_conditions(self, key: str, conditions: list[dict]) -> None:
        """Record which conditions are True for one LLMService and refresh the gauge."""
        self._conditions[key] = {c["type"] for c in conditions if c.get("status") == "True"}
        self._refresh()

    def forget(self, key: str) -> None:
        self._conditions.pop(key, None)
        self._refresh()

    def _refresh(self) -> None:
        for cond in CONDITIONS:
            self.managed.labels(condition=cond).set(sum(cond in true for true in self._conditions.values()))


def build_operator_metrics(registry: CollectorRegistry | None = None) -> OperatorMetrics:
    """Create the operator metrics on `registry` (a fresh one by default), every label value pre-created."""
    registry = registry or CollectorRegistry()
    out = OperatorMetrics(
        registry=registry,
        reconciles=Counter("cpuserve_operator_reconciles", "Reconcile passes by result.", ("result",),
                           registry=registry),
        reconcile_duration=Histogram("cpuserve_operator_reconcile_duration_seconds", "Wall time of one reconcile.",
                                     buckets=DURATION_BUCKETS, registry=registry),
        errors=Counter("cpuserve_operator_errors", "Unexpected errors while reconciling (API failures, bugs).",
                       registry=registry),
        managed=Gauge("cpuserve_operator_managed_llmservices", "LLMServices whose condition is True, by type.",
                      ("condition",), registry=registry),
    )
    for result in RESULTS:
        out.reconciles.labels(result=result)
    out._refresh()
    return out
