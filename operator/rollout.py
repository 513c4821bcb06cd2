"""Which replica groups of rank pods should exist: a change of the rank pods rolls with a surge of one group.

Every rank pod carries its revision (the hash of the rank pod's template and of the engine's Serve args,
serve_document.revision) as a pod label and as a Ray node label; the LLMServer replicas of the current Serve
config run only on Ray nodes of the current revision (serve_document.engine_args). A group is current when its
pods have the current revision, outdated otherwise. Group indexes are names, not positions: a new group takes the
lowest index no pod has.

    replicas 1, the model changes:         g0 (old, serving)
      one group more, of the new revision  g0 (old, serving)  g1 (new)       Serve starts the new replica on g1,
                                                                             then stops the old one
      g0 runs no Ray actor any more: gone  g1 (new, serving)

An outdated group goes once its Ray nodes run no actor (the Serve replica and its rank actors), which the head's
Ray state API tells (serve_api.ServeApi.busy_nodes); while that is unknown, it stays. So Ray Serve, not the operator,
decides when an old replica stops (after its streams drain), and a one-replica service answers throughout. A
scale-down removes idle groups the same way, after Serve stopped the replica on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpuserve.operator import naming


@dataclass(frozen=True, slots=True)
class GroupPlan:
    groups: list[int]
    """Group indexes whose rank pods (of the current revision) should exist; missing pods are created."""
    keep: frozenset[str]
    """Rank pods outside `groups` that stay for now: a Ray actor still runs on their group."""


def _labels(pod: dict[str, Any]) -> dict[str, str]:
    return pod["metadata"].get("labels") or {}


def plan_groups(replicas: int, revision: str, pods: list[dict[str, Any]], busy: set[str] | None) -> GroupPlan:
    """The groups to have now; rank pods neither in them nor kept are deleted.

    Args:
        replicas: the spec's replica groups.
        revision: the current rank pod revision.
        pods: the existing rank pods of the LLMService.
        busy: names of the pods whose Ray nodes run an actor; None when unknown (the head's API did not answer).
    """
    by_group: dict[int, list[dict[str, Any]]] = {}
    for pod in pods:
        by_group.setdefault(int(_labels(pod)[naming.LABEL_GROUP]), []).append(pod)

    def is_idle(group: int) -> bool:
        if replicas == 0:  # nothing is to serve (Serve's one replica waits for a rank pod)
            return True
        return busy is not None and not any(p["metadata"]["name"] in busy for p in by_group[group])

    def is_going(group: int) -> bool:
        return all(p["metadata"].get("deletionTimestamp") for p in by_group[group])

    current = sorted(g for g in by_group if all(_labels(p).get(naming.LABEL_REVISION) == revision
                                                for p in by_group[g]))
    outdated = [g for g in sorted(by_group) if g not in current and not is_going(g)]
    draining = [g for g in outdated if not is_idle(g)]  # a replica still runs there: Serve moves it first
    surplus = max(0, len(current) - replicas)
    leaving = sorted((g for g in current if is_idle(g)), reverse=True)[:surplus]  # scale-down: idle ones only
    groups = [g for g in current if g not in leaving]
    missing = replicas - len(groups)
    if draining:  # a rollout: one group more than the spec at most
        missing = min(missing, replicas + 1 - len(groups) - len(draining))
    free = (g for g in range(len(by_group) + replicas + 1) if g not in by_group)
    groups += [next(free) for _ in range(max(0, missing))]
    keep = frozenset(p["metadata"]["name"] for g in draining for p in by_group[g])
    return GroupPlan(sorted(groups), keep)
