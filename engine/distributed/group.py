"""Start a replica group from the engine: rank 0 in this process, ranks 1..k-1 started by a launcher.

A launcher has two calls (ProcessLauncher below is the engine's default; serving's Ray actors in
serving/rank_actors.py are the other):

    place(world) -> Placement     reserve the workers: rendezvous address, CPU set per rank, one host or not
    start(rank, world, addr, port, cpus, spec) -> handle   run worker_main on that rank

and a handle has `name`, `pid`, `exit_reason() -> str | None` (None while it runs) and `stop(timeout)` (wait that
long for it to finish after the stop step, then kill it).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from dataclasses import dataclass

from cpuserve.engine import settings
from cpuserve.engine.distributed.communicator import RankFailedError
from cpuserve.engine.distributed.connect import make_communicator
from cpuserve.engine.distributed.cpus import bind_rank, rank_cpu_sets
from cpuserve.engine.distributed.worker import READY_TIMEOUT, build_rank, worker_main

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Placement:
    addr: str  # MASTER_ADDR: rank 0's host, as the other ranks reach it
    cpu_sets: list[list[int]]  # [rank] -> the CPUs that rank binds to (on its own host)
    same_host: bool  # every rank on rank 0's host: the shm transport can work


class ProcessLauncher:
    """Ranks 1..k-1 as spawned processes on this host (daemons: they die with this one)."""

    def place(self, world: int) -> Placement:
        return Placement("127.0.0.1", rank_cpu_sets(world), True)  # the mask as it is now, before rank 0 narrows it

    def start(self, rank: int, world: int, addr: str, port: int, cpus: list[int], spec: dict) -> "RankProcess":
        proc = mp.get_context("spawn").Process(target=worker_main, args=(rank, world, addr, port, cpus, spec),
                                               daemon=True, name=f"cpuserve-rank{rank}")
        proc.start()
        return RankProcess(proc)


class RankProcess:
    def __init__(self, proc):
        self.proc, self.name, self.pid = proc, proc.name, proc.pid

    def exit_reason(self) -> str | None:
        return None if self.proc.exitcode is None else f"exited with code {self.proc.exitcode}"

    def stop(self, timeout: float) -> None:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_group(config, max_model_len: int, vocab_size: int, transport: str | None = None):
    """Start the workers, build shard 0 here, wait until every shard is loaded; returns rank 0's TPRunner.

    config: the EngineConfig (num_blocks already derived: every rank's pool has that many blocks of its heads;
        config.launcher starts the workers, None = ProcessLauncher).
    transport: overrides config.transport; None on both: CPUSERVE_COMM, else shm when every rank shares this
        host, else torch. Decided here once, so every rank uses the same one.
    """
    from cpuserve.engine.distributed.tp_runner import TPRunner

    world = config.ranks
    launcher = config.launcher or ProcessLauncher()
    placement = launcher.place(world)
    transport = (transport or config.transport or settings.COMM.get()
                 or ("shm" if placement.same_host else "torch"))
    port = _free_port()
    spec = dict(model=config.model, weights=config.weights, group_size=config.group_size,
                activations=config.activations, kv_cache=config.kv_cache,
                num_blocks=config.num_blocks, block_size=config.block_size, max_model_len=max_model_len,
                tp_mode=config.tp_mode, num_threads=config.num_threads, transport=transport,
                log_level=logging.getLogger().level)
    workers = [launcher.start(r, world, placement.addr, port, placement.cpu_sets[r], spec) for r in range(1, world)]
    saved_mask = os.sched_getaffinity(0)
    runner = comm = None
    try:
        bind_rank(0, placement.cpu_sets[0], config.num_threads)
        comm = make_communicator(transport, rendezvous=(0, world, placement.addr, port),
                                 startup_check=lambda: _dead_worker(workers, " while starting"))
        runner = TPRunner(build_rank(spec, comm), comm, vocab_size,
                          on_close=lambda r: _stop(r, workers, saved_mask), check=lambda: _dead_worker(workers))
        comm.barrier(READY_TIMEOUT)
    except BaseException:
        if runner is not None:
            runner.close()
        else:
            _stop(None, workers, saved_mask, comm)
        raise
    runner.worker_pids = [w.pid for w in workers]
    log.info("replica group up: %d ranks at %s, cpus %s, transport %s", world, placement.addr,
             placement.cpu_sets, type(comm).__name__)
    return runner


def _dead_worker(workers, when: str = "") -> str | None:
    for w in workers:
        reason = w.exit_reason()
        if reason is not None:
            return f"{w.name} {reason}{when}"
    return None


def _stop(runner, workers, saved_mask, comm=None) -> None:
    """Tell live workers to stop (if the group still works), reap them, give rank 0 its cores back."""
    comm = comm if comm is not None else (runner.comm if runner is not None else None)
    if runner is not None and not runner.broken:
        from cpuserve.engine.distributed import step
        from cpuserve.engine.scheduler_output import SchedulerOutput

        try:
            comm.broadcast_ints(step.pack(SchedulerOutput(), step.KIND_STOP, 0))
        except RankFailedError:
            pass
    for w in workers:
        w.stop(5)
    if comm is not None:
        comm.close()
    os.sched_setaffinity(0, saved_mask)
