"""Rank bodies for test_expert_parallel (spawned processes import them by name)."""

from __future__ import annotations

from cpuserve.engine.distributed.connect import make_communicator
from cpuserve.engine.distributed.sharding import build_sharded_model
from cpuserve.engine.loader import load_checkpoint


def expert_bytes(mlp) -> int:
    """Bytes of a layer's experts as this process holds them (their stacked buffers, else each expert's own)."""
    moe = getattr(mlp, "moe", mlp)  # a rank's ExpertParallel wraps its MoE
    tensors = [t for t in moe.stack.gate_up + moe.stack.down if t is not None] if moe.stack is not None else [
        t for expert in moe.experts for t in expert.buffers()]
    return sum(t.untyped_storage().nbytes() for t in tensors)


def shard_experts(rank: int, world: int, path: str, tp_mode: str) -> dict:
    """Build this rank's shard of the checkpoint; returns its experts and what they hold."""
    comm = make_communicator("shm", timeout=60)
    try:
        model = build_sharded_model(load_checkpoint(path, show_progress=False), "int4", 32, comm, tp_mode,
                                    activations="int8")  # the engine's default: experts stacked
        layers = [layer.mlp for layer in model.layers]
        return dict(experts=model.plan.experts, held=[len(mlp.moe.experts) for mlp in layers],
                    first=[mlp.moe.first_expert for mlp in layers], bytes=sum(expert_bytes(m) for m in layers),
                    router_rows=[mlp.moe.router.shape[0] for mlp in layers],
                    stacked=all(mlp.moe.stack is not None for mlp in layers))
    finally:
        comm.close()
