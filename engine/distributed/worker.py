"""Ranks 1..k-1: load this rank's shard, then run every step rank 0 broadcasts until it says stop."""

from __future__ import annotations

import logging
import os

import torch

from cpuserve.engine.distributed import step
from cpuserve.engine.distributed.communicator import Communicator, RankFailedError
from cpuserve.engine.distributed.connect import make_communicator

log = logging.getLogger(__name__)
READY_TIMEOUT = 900.0  # seconds rank 0 waits for every shard to load (a 70B shard streams for minutes)


def build_rank(spec: dict, comm: Communicator):
    """This rank's model shard and runner (its own KV pool, holding only its heads)."""
    from cpuserve.engine.distributed.sharding import build_sharded_model
    from cpuserve.engine.loader import load_checkpoint
    from cpuserve.engine.model_runner import ModelRunner
    from cpuserve.engine.threads import tune_allocator

    tune_allocator()
    checkpoint = load_checkpoint(spec["model"], show_progress=False)
    model = build_sharded_model(checkpoint, spec["weights"], spec["group_size"], comm, spec["tp_mode"],
                                activations=spec["activations"])
    return ModelRunner(model, spec["kv_cache"], spec["num_blocks"], spec["block_size"], spec["max_model_len"])


@torch.inference_mode()
def run_shard(runner, wire: torch.Tensor) -> tuple[int, int, torch.Tensor | None]:
    """Every rank's part of a step: (kind, num_candidates, local logits [S, V_pad] or None to stop). KIND_POPULATE's
    "logits" are [[1.0]] while this rank's pools have regions left to fault in (gathered whole: FULL), else [[0.0]]."""
    kind, candidates, out = step.unpack(wire)
    if kind == step.KIND_STOP:
        return kind, candidates, None
    if kind == step.KIND_POPULATE:
        return kind, candidates, torch.tensor([[float(runner.populate_kv())]])
    token_ids, meta, logit_rows = runner.prepare_inputs(out)
    if kind == step.KIND_SCORE:
        logit_rows = torch.arange(len(token_ids))
    return kind, candidates, runner.model(token_ids, meta, logit_rows)


def contribute(comm: Communicator, logits: torch.Tensor, candidates: int, vocab_start: int):
    """Gather this rank's sampling candidates (or whole shard) at rank 0; returns the gathered tensor there."""
    if candidates == step.FULL:
        return comm.gather(logits.contiguous())
    return comm.gather(step.local_candidates(logits, candidates, vocab_start))


def worker_main(rank: int, world_size: int, addr: str, port: int, cpus: list[int], spec: dict) -> None:
    """Process entry of a worker rank (multiprocessing spawn); rendezvous through the environment."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))
    logging.basicConfig(level=spec.get("log_level", logging.WARNING),
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    from cpuserve.engine.distributed.cpus import bind_rank

    bind_rank(rank, cpus, spec.get("num_threads"))
    comm = make_communicator(spec.get("transport"))
    try:
        runner = build_rank(spec, comm)
        comm.barrier(READY_TIMEOUT)  # tell rank 0 this shard is loaded
        vocab_start = runner.model.plan.vocab[0]
        while True:
            wire = comm.broadcast_ints(None, idle=True)  # idle: wait as long as rank 0 lives
            kind, candidates, logits = run_shard(runner, wire)
            if logits is None:
                break
            contribute(comm, logits, candidates, vocab_start)
    except RankFailedError as e:
        log.warning("rank %d stops: %s", rank, e)
    finally:
        comm.close()
