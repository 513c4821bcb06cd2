"""Every child manifest of one LLMService, in creation order: the reconcile's desired state."""
from __future__ import annotations

from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.memory import MemoryPlan, plan_memory
from cpuserve.operator.pods import build_head_pod, build_rank_pod, rank_template_hash
from cpuserve.operator.security import build_network_policy
from cpuserve.operator.serve_document import revision
from cpuserve.operator.services import build_pdb, build_service_monitor, build_services
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import LLMServiceSpec


def rank_pod_revision(name: str, spec: LLMServiceSpec, settings: OperatorSettings) -> str:
    """The revision the rank pods of `spec` carry (serve_document.revision)."""
    return revision(spec, rank_template_hash(name, spec, settings, plan_memory(spec)))


def build_children(body: dict[str, Any], spec: LLMServiceSpec, settings: OperatorSettings,
                   with_service_monitor: bool, groups: list[int] | None = None) -> list[dict[str, Any]]:
    """Services, head pod, rank pods (group-major), PDB, the Ray NetworkPolicy and optionally a ServiceMonitor.

    The generated Ray token Secret is not here: it is created once, never compared or patched (reconcile.py).

    Args:
        body: the LLMService as read from the API (apiVersion, kind, metadata.name/namespace/uid).
        spec: its validated spec (validation.validate returned no findings).
        settings: operator settings (default image, NUMA node label).
        with_service_monitor: whether the ServiceMonitor CRD exists in the cluster.
        groups: the replica groups' indexes (rollout.plan_groups); None: 0 .. replicas - 1.
    Returns:
        Manifests with owner references and spec-hash annotations.
    """
    name = body["metadata"]["name"]
    plans = [plan_memory(spec, r) for r in range(spec.ranks_per_replica)]  # rank 0's holds a draft model too
    assert all(isinstance(p, MemoryPlan) for p in plans), "validate() reports a missing parameter count first"
    manifests = build_services(name, spec) + [build_head_pod(name, spec, settings)]
    rev = rank_pod_revision(name, spec, settings)
    manifests += [build_rank_pod(name, g, r, spec, settings, plans[r], rev)
                  for g in (range(spec.replicas) if groups is None else groups)
                  for r in range(spec.ranks_per_replica)]
    manifests += [build_pdb(name), build_network_policy(name, spec, settings)]
    if with_service_monitor:
        manifests.append(build_service_monitor(name))
    return [naming.finish(m, body) for m in manifests]
