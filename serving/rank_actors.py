"""Ranks 1..k-1 of a serving replica group as Ray actors in the replica's placement group.

    placement group of one LLMServer replica (build_app: ranks_per_replica bundles, each cpus_per_rank CPUs
    and one unit of socket_resource when given; STRICT_PACK = one node)
      bundle 0: the LLMServer replica = rank 0 (scheduler, sampler, its own shard)
      bundle r: RankWorker "cpuserve-<replica>-rank<r>" = rank r, running the engine's worker_main

RayLauncher is the engine's launcher for such a group (see engine/distributed/group.py). Workers never restart
on their own and die with their replica: the engine kills them when it closes or its group breaks, Ray kills
them when their owner (the replica) dies, and Serve removes the placement group with the replica.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cpuserve.engine import settings
from cpuserve.engine.distributed.cpus import rank_cpu_sets
from cpuserve.engine.distributed.group import Placement
from cpuserve.engine.threads import openmp_env

PLACE_TIMEOUT = 300.0  # seconds to wait for the worker actors to start (a new node may pull the image first)


@ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=2)  # 2: answer `where` while `run` blocks
class RankWorker:
    def where(self) -> dict[str, Any]:
        """This worker's pid, node and CPU mask."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "cpus": sorted(os.sched_getaffinity(0))}

    def run(self, rank: int, world: int, addr: str, port: int, cpus: list[int], spec: dict) -> None:
        """Serve rank `rank` until rank 0 says stop or the group breaks."""
        from cpuserve.engine.distributed.worker import worker_main

        worker_main(rank, world, addr, port, cpus, spec)


class RankActor:
    """One running RankWorker, as the engine's group handles its workers."""

    def __init__(self, actor: Any, name: str, pid: int, run_ref: Any):
        self.actor, self.name, self.pid, self._run = actor, name, pid, run_ref

    def exit_reason(self) -> str | None:
        ready, _ = ray.wait([self._run], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self._run)
        except ray.exceptions.RayError as e:
            return f"died ({type(e).__name__})"
        return "stopped"

    def stop(self, timeout: float) -> None:
        ray.wait([self._run], timeout=timeout)
        ray.kill(self.actor, no_restart=True)


class RayLauncher:
    """Starts the other ranks of the calling replica's group in its placement group's bundles 1..k-1.

    Args:
        name: unique per replica; worker r is the named actor f"{name}-rank{r}".
        cpus_per_rank: CPUs each worker asks for (its bundle's).
        resource: the custom resource each bundle holds one unit of (socket_resource), or None.
    """

    def __init__(self, name: str, cpus_per_rank: int, resource: str | None = None):
        self.name = name
        self.options = dict(num_cpus=cpus_per_rank, resources={resource: 1} if resource else {})
        if preload := openmp_env({}):  # workers step off their main thread too (engine/threads.py)
            self.options["runtime_env"] = {"env_vars": preload}
        self._placed: dict[int, tuple[Any, dict[str, Any]]] = {}

    def place(self, world: int) -> Placement:
        pg = ray.util.get_current_placement_group()
        if pg is None or pg.bundle_count < world:
            raise ValueError(f"ranks={world}: this replica needs a placement group of {world} bundles "
                             f"(build_app gives it ranks_per_replica bundles)")
        actors = {}
        try:
            for r in range(1, world):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
                actors[r] = RankWorker.options(name=f"{self.name}-rank{r}", scheduling_strategy=strategy,
                                               **self.options).remote()
            infos = ray.get([a.where.remote() for a in actors.values()], timeout=PLACE_TIMEOUT)
        except BaseException:
            for a in actors.values():
                ray.kill(a, no_restart=True)
            raise
        self._placed = {r: (a, info) for (r, a), info in zip(actors.items(), infos)}
        nodes = [ray.get_runtime_context().get_node_id()] + [i["node_id"] for i in infos]
        masks = [sorted(os.sched_getaffinity(0))] + [i["cpus"] for i in infos]
        cpu_sets = rank_cpu_sets(world) if settings.CPUS.get() else split_by_node(nodes, masks)
        return Placement(ray.util.get_node_ip_address(), cpu_sets, same_host=len(set(nodes)) == 1)

    def start(self, rank: int, world: int, addr: str, port: int, cpus: list[int], spec: dict) -> RankActor:
        actor, info = self._placed.pop(rank)
        return RankActor(actor, f"{self.name}-rank{rank}", info["pid"],
                         actor.run.remote(rank, world, addr, port, cpus, spec))


def split_by_node(nodes: list[str], masks: list[list[int]]) -> list[list[int]]:
    """[rank] -> CPU set: ranks on one node split that node's mask (its first rank's) as the engine does;
    a rank alone on its node (one NUMA-pinned pod per rank) keeps its whole mask."""
    out: list[list[int]] = [[] for _ in nodes]
    for node in dict.fromkeys(nodes):
        ranks = [r for r, n in enumerate(nodes) if n == node]
        for r, cpus in zip(ranks, rank_cpu_sets(len(ranks), spec="", mask=masks[ranks[0]])):
            out[r] = cpus
    return out
