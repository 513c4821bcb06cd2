"""Memory of one rank pod: weights shard + KV budget + overhead, with the arithmetic spelled out for status; a
rank-0 pod adds its group's draft model (weights and KV pool), if any."""
from __future__ import annotations

import math
from dataclasses import dataclass

from cpuserve.operator.checkpoints import stored_bytes
from cpuserve.operator.spec import EMBEDDED_NUM_PARAMETERS, DraftModelSpec, LLMServiceSpec

GIB = 1024**3
MIB = 1024**2
# The int8-activation kernels (the default; the CRD sets no other) keep an fp32 scale and zero offset per group: 8
# bytes per group on top of half a byte per weight. Measured (tests/operator/test_operator_memory_measured.py): the
# engine holds 0.717 bytes a parameter of SmolLM2 (groups of 32: 0.75 planned), 0.732 of a Q4_K_M-layout file.
_INT4_GROUP_BYTES = 8


def bytes_per_parameter(weights: str, group_size: int) -> float:
    """Runtime bytes per weight for a weight format (int8 keeps per-channel scales: negligible)."""
    if weights == "int4":
        return 0.5 + _INT4_GROUP_BYTES / group_size
    return {"int8": 1.0, "bf16": 2.0, "fp32": 4.0}[weights]


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The memory of one rank pod and how it was reached."""

    weights_shard_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int
    draft_bytes: int
    """The draft model's weights and KV pool: on rank-0 pods with speculative method draft, else 0."""
    required_bytes: int
    """weights shard + KV + draft + overhead, rounded up to MiB."""
    limit_bytes: int
    """What the pod requests (= limit): spec.resources.memoryPerRankGb, else required_bytes."""
    arithmetic: str

    @property
    def quantity(self) -> str:
        """The pod's memory request/limit as a Kubernetes quantity in Mi."""
        return f"{self.limit_bytes // MIB}Mi"

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.limit_bytes


def num_parameters(spec: LLMServiceSpec) -> int | None:
    """The parameter count: given, or the embedded model's."""
    if spec.model.num_parameters is not None:
        return spec.model.num_parameters
    return EMBEDDED_NUM_PARAMETERS if spec.model.source == "embedded" else None


def _weights_label(weights: str, group_size: int) -> str:
    return f"{weights}/g{group_size}" if weights == "int4" else weights


def draft_model(spec: LLMServiceSpec) -> DraftModelSpec | None:
    """The draft model a replica group's engine runs (its defaults when spec.speculative.draft is omitted), or None."""
    s = spec.speculative
    if s is None or s.method != "draft":
        return None
    return s.draft or DraftModelSpec()


def _draft_memory(spec: LLMServiceSpec, draft: DraftModelSpec) -> tuple[int, str] | None:
    """(bytes, arithmetic) of the draft model: whole weights (a group's engine loads it unsharded, next to rank 0's
    shard: engine/spec/draft_model.py) + its KV pool; None when its parameter count is unknown."""
    params = draft.num_parameters or (EMBEDDED_NUM_PARAMETERS if draft.path is None else None)
    if params is None:
        return None
    q = spec.quantization
    weights = draft.weights or q.weights
    bpp = bytes_per_parameter(weights, q.group_size)
    model, kv = math.ceil(params * bpp), math.ceil(draft.kv_cache_gb * GIB)
    return model + kv, (f" + draft {model / GIB:.3f} GiB ({params} params x {bpp:g} B "
                        f"{_weights_label(weights, q.group_size)}) + draft KV {kv / GIB:.3f} GiB")


def plan_memory(spec: LLMServiceSpec, rank: int = 0) -> MemoryPlan | None:
    """Memory of a rank pod of `rank` (rank 0, the default, holds the most), or None when a parameter count is
    unknown (validation reports it). A group's engine, and so its draft model, runs on its rank-0 pod
    (serving/app.py places it there)."""
    params = num_parameters(spec)
    draft = draft_model(spec) if rank == 0 else None
    draft_memory = (0, "") if draft is None else _draft_memory(spec, draft)
    if params is None or draft_memory is None:
        return None
    q, res, ranks = spec.quantization, spec.resources, spec.ranks_per_replica
    bpp = bytes_per_parameter(q.weights, q.group_size)
    shard = math.ceil(params * bpp / ranks)
    kv = math.ceil(res.kv_cache_gb * GIB)
    overhead = math.ceil(res.overhead_gb * GIB)
    required = math.ceil((shard + kv + draft_memory[0] + overhead) / MIB) * MIB
    limit = required if res.memory_per_rank_gb is None else math.floor(res.memory_per_rank_gb * GIB / MIB) * MIB
    arithmetic = (f"weights {shard / GIB:.3f} GiB ({params} params x {bpp:g} B "
                  f"{_weights_label(q.weights, q.group_size)} / {ranks} ranks) + KV {kv / GIB:.3f} GiB"
                  f"{draft_memory[1]} + overhead {overhead / GIB:.3f} GiB = {required // MIB}Mi; pod {limit // MIB}Mi")
    return MemoryPlan(shard, kv, overhead, draft_memory[0], required, limit, arithmetic)


def download_size_limit(spec: LLMServiceSpec) -> str:
    """emptyDir size for a downloaded checkpoint: what its type stores at most (checkpoints.stored_bytes), +10% and
    256 MiB slack (headers, tokenizer, norms, and the few tensors checkpoints.py leaves to it)."""
    stored = stored_bytes(spec.model.checkpoint_type or "F32", num_parameters(spec) or 0)
    return f"{math.ceil(stored * 1.1 / MIB) + 256}Mi"
