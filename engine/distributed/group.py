"""Start a replica group from the engine: rank 0 in this process, ranks 1..k-1 as spawned processes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket

from cpuserve.engine.distributed.communicator import RankFailedError, make_communicator
from cpuserve.engine.distributed.cpus import bind_rank, rank_cpu_sets
from cpuserve.engine.distributed.worker import READY_TIMEOUT, build_rank, worker_main

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(config, max_model_len: int, vocab_size: int, transport: str | None = None):
    """Spawn the workers, build shard 0 here, wait until every shard is loaded; returns rank 0's TPRunner.

    config: the EngineConfig (num_blocks already derived: every rank's pool has that many blocks of its heads).
    """
    from cpuserve.engine.distributed.tp_runner import TPRunner

    world = config.ranks
    cpu_sets = rank_cpu_sets(world)  # from the mask as it is now, before rank 0 narrows its own
    port = _free_port()
    spec = dict(model=config.model, weights=config.weights, group_size=config.group_size, kv_cache=config.kv_cache,
                num_blocks=config.num_blocks, block_size=config.block_size, max_model_len=max_model_len,
                tp_mode=config.tp_mode, num_threads=None, transport=transport, log_level=logging.getLogger().level)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, world, "127.0.0.1", port, cpu_sets[r], spec), daemon=True,
                         name=f"cpuserve-rank{r}") for r in range(1, world)]
    for p in procs:
        p.start()
    saved_mask = os.sched_getaffinity(0)
    runner = comm = None
    try:
        num_threads = bind_rank(0, cpu_sets[0], config.num_threads)
        comm = make_communicator(transport, rendezvous=(0, world, "127.0.0.1", port),
                                 startup_check=lambda: _dead_worker(procs))
        runner = TPRunner(build_rank(spec, comm), comm, vocab_size,
                          on_close=lambda r: _stop(r, procs, saved_mask))
        comm.barrier(READY_TIMEOUT)
    except BaseException:
        if runner is not None:
            runner.close()
        else:
            _stop(None, procs, saved_mask, comm)
        raise
    runner.num_threads = num_threads
    runner.worker_pids = [p.pid for p in procs]
    log.info("replica group up: %d ranks, cpus %s, transport %s", world, cpu_sets, type(comm).__name__)
    return runner


def _dead_worker(procs) -> str | None:
    dead = [p for p in procs if p.exitcode is not None]
    return f"{dead[0].name} exited with code {dead[0].exitcode} while starting" if dead else None


def _stop(runner, procs, saved_mask, comm=None) -> None:
    """Tell live workers to stop (if the group still works), reap them, give rank 0 its cores back."""
    comm = comm if comm is not None else (runner.comm if runner is not None else None)
    if runner is not None and not runner.broken:
        from cpuserve.engine.distributed import step
        from cpuserve.engine.scheduler import SchedulerOutput

        try:
            comm.broadcast_ints(step.pack(SchedulerOutput(), step.KIND_STOP, 0))
        except RankFailedError:
            pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    if comm is not None:
        comm.close()
    os.sched_setaffinity(0, saved_mask)
