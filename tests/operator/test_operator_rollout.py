"""Which outdated pods a pass deletes: the head at once, rank pods one replica group at a time."""
from __future__ import annotations

import pytest

from cpuserve.operator.rollout import pods_to_delete

RANKS = ["chat-g0-r0", "chat-g0-r1", "chat-g1-r0", "chat-g1-r1", "chat-g2-r0", "chat-g2-r1"]


def manifest(name):
    labels = {} if name.endswith("head") else {"cpuserve.dev/group": name.split("-g")[1].split("-")[0]}
    return {"metadata": {"name": name, "labels": labels}}


def pod(name, ready=True, terminating=False):
    meta = {"name": name, **({"deletionTimestamp": "2025-01-01T00:00:00Z"} if terminating else {})}
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


DESIRED = [manifest("chat-head")] + [manifest(n) for n in RANKS]
ALL_READY = {n: pod(n) for n in ["chat-head"] + RANKS}
CASES = [  # (outdated, current pods, deleted now)
    (["chat-head"], ALL_READY, ["chat-head"]),
    (RANKS, ALL_READY, ["chat-g0-r0", "chat-g0-r1"]),  # the lowest group first
    (RANKS[2:], ALL_READY, ["chat-g1-r0", "chat-g1-r1"]),
    (RANKS[2:], {**ALL_READY, "chat-g0-r1": pod("chat-g0-r1", ready=False)}, []),  # group 0 not back yet
    (RANKS[2:], {k: v for k, v in ALL_READY.items() if k != "chat-g0-r0"}, []),  # group 0 being recreated
    (RANKS[2:], {**ALL_READY, "chat-g2-r0": pod("chat-g2-r0", terminating=True)}, []),
    (["chat-head", *RANKS[4:]], {**ALL_READY, "chat-g2-r0": pod("chat-g2-r0", ready=False)},
     ["chat-head", "chat-g2-r0", "chat-g2-r1"]),  # a stale group's own readiness does not hold it back
]


@pytest.mark.parametrize("outdated,current,expected", CASES)
def test_pods_to_delete(outdated, current, expected):
    assert pods_to_delete(outdated, DESIRED, current) == expected
