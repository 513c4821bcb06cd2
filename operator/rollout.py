"""Which outdated pods one pass may delete: the head at once, rank pods one replica group at a time.

A rank pod is replaced by deleting it (pods are immutable; the next pass creates the new one). Deleting every
group at once would stop serving; so the lowest group with outdated pods goes only when every pod of the other
groups exists, is not terminating and is ready. Ray Serve moves that group's replica to the others meanwhile.
"""
from __future__ import annotations

from typing import Any

from cpuserve.operator import naming
from cpuserve.operator.conditions import is_pod_ready


def _group(pod: dict[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(naming.LABEL_GROUP)


def pods_to_delete(outdated: list[str], desired: list[dict[str, Any]], current: dict[str, dict[str, Any]]) -> list[str]:
    """Names of the outdated pods to delete now.

    Args:
        outdated: names of existing pods whose spec hash differs from the desired one.
        desired: the desired pod manifests (head and every rank pod).
        current: existing pods by name.
    """
    groups = {m["metadata"]["name"]: _group(m) for m in desired}
    now = [n for n in outdated if groups.get(n) is None]  # the head (not a rank)
    stale_groups = sorted({groups[n] for n in outdated if groups.get(n) is not None}, key=int)
    if not stale_groups:
        return now
    first = stale_groups[0]
    others = [n for n, g in groups.items() if g is not None and g != first]
    if all(n in current and not current[n]["metadata"].get("deletionTimestamp") and is_pod_ready(current[n])
           for n in others):
        now += [n for n in outdated if groups.get(n) == first]
    return now
