"""Every child manifest of one LLMService, in creation order: the reconcile's desired state."""
from __future__ import annotations

from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.memory import MemoryPlan, plan_memory
from cpuserve.operator.pods import build_head_pod, build_rank_pod
from cpuserve.operator.security import build_network_policy
from cpuserve.operator.services import build_pdb, build_service_monitor, build_services
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import LLMServiceSpec


def build_children(body: dict[str, Any], spec: LLMServiceSpec, settings: OperatorSettings,
                   with_service_monitor: bool) -> list[dict[str, Any]]:
    """Services, head pod, rank pods (group-major), PDB, the Ray NetworkPolicy and optionally a ServiceMonitor.

    The generated Ray token Secret is not here: it is created once, never compared or patched (reconcile.py).

    Args:
        body: the LLMService as read from the API (apiVersion, kind, metadata.name/namespace/uid).
        spec: its validated spec (validation.validate returned no findings).
        settings: operator settings (default image, NUMA node label).
        with_service_monitor: whether the ServiceMonitor CRD exists in the cluster.
    Returns:
        Manifests with owner references and spec-hash annotations.
    """
    name = body["metadata"]["name"]
    plan = plan_memory(spec)
    assert isinstance(plan, MemoryPlan), "validate() reports a missing parameter count first"
    manifests = build_services(name, spec) + [build_head_pod(name, spec, settings)]
    manifests += [build_rank_pod(name, g, r, spec, settings, plan)
                  for g in range(spec.replicas) for r in range(spec.ranks_per_replica)]
    manifests += [build_pdb(name), build_network_policy(name, spec, settings)]
    if with_service_monitor:
        manifests.append(build_service_monitor(name))
    return [naming.finish(m, body) for m in manifests]
