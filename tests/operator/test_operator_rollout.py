"""Which replica groups should exist: a change of the rank pods rolls with a surge of one group, and a group goes
only once no Ray actor runs on it."""
from __future__ import annotations

import pytest

from cpuserve.operator.rollout import GroupPlan, plan_groups

OLD, NEW = "old", "new"


def pod(group: int, rank: int = 0, revision: str = NEW, terminating: bool = False) -> dict:
    meta = {"name": f"chat-g{group}-r{rank}", "labels": {"cpuserve.dev/group": str(group),
                                                         "cpuserve.dev/revision": revision}}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta}


def busy(*groups: int, ranks: int = 1) -> set[str]:
    return {f"chat-g{g}-r{r}" for g in groups for r in range(ranks)}


CASES = [  # (replicas, pods, busy pods, the plan)
    # steady state and scaling
    (1, [], set(), GroupPlan([0], frozenset())),
    (2, [pod(0)], busy(0), GroupPlan([0, 1], frozenset())),  # scale up: all at once
    (1, [pod(0), pod(1)], busy(0, 1), GroupPlan([0, 1], frozenset())),  # scale down: Serve has not stopped one yet
    (1, [pod(0), pod(1)], busy(0), GroupPlan([0], frozenset())),  # ... now it has: the idle group goes
    (1, [pod(0), pod(1)], set(), GroupPlan([0], frozenset())),  # both idle: the highest goes
    (1, [pod(0), pod(1)], None, GroupPlan([0, 1], frozenset())),  # unknown: nothing goes
    (0, [pod(0)], busy(0), GroupPlan([], frozenset())),  # replicas 0: nothing is to serve
    (1, [pod(0, 0), pod(0, 1)], busy(0, ranks=2), GroupPlan([0], frozenset())),
    # a one-replica rollout: a group of the new revision, then the old one goes once idle
    (1, [pod(0, revision=OLD)], busy(0), GroupPlan([1], frozenset({"chat-g0-r0"}))),
    (1, [pod(0, revision=OLD), pod(1)], busy(0), GroupPlan([1], frozenset({"chat-g0-r0"}))),
    (1, [pod(0, revision=OLD), pod(1)], busy(0, 1), GroupPlan([1], frozenset({"chat-g0-r0"}))),  # both serve
    (1, [pod(0, revision=OLD), pod(1)], busy(1), GroupPlan([1], frozenset())),  # the old replica stopped
    (1, [pod(0, revision=OLD), pod(1)], None, GroupPlan([1], frozenset({"chat-g0-r0"}))),
    (1, [pod(0, revision=OLD)], set(), GroupPlan([1], frozenset())),  # nothing ran on it: no need to wait
    (1, [pod(0, revision=OLD, terminating=True), pod(1)], busy(1), GroupPlan([1], frozenset())),
    # two replicas: one group more at most while old ones drain, and new indexes avoid names still taken
    (2, [pod(0, revision=OLD), pod(1, revision=OLD)], busy(0, 1),
     GroupPlan([2], frozenset({"chat-g0-r0", "chat-g1-r0"}))),
    (2, [pod(0, revision=OLD, terminating=True), pod(1, revision=OLD), pod(2)], busy(1, 2),
     GroupPlan([2, 3], frozenset({"chat-g1-r0"}))),
    (2, [pod(1, revision=OLD), pod(2), pod(3)], busy(2, 3), GroupPlan([2, 3], frozenset())),
    # a group with one outdated rank is outdated; one rank missing from a current group is recreated
    (1, [pod(0, 0), pod(0, 1, revision=OLD)], busy(0, ranks=2),
     GroupPlan([1], frozenset({"chat-g0-r0", "chat-g0-r1"}))),
    (1, [pod(0, 1)], busy(0, ranks=2), GroupPlan([0], frozenset())),
]


@pytest.mark.parametrize("replicas,pods,busy_pods,expected", CASES, ids=range(len(CASES)))
def test_plan_groups(replicas, pods, busy_pods, expected):
    assert plan_groups(replicas, NEW, pods, busy_pods) == expected
