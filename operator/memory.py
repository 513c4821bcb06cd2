"""Memory of one rank pod: weights shard + KV budget + overhead, with the arithmetic spelled out for status."""
from __future__ import annotations

import math
from dataclasses import dataclass

from cpuserve.operator.spec import EMBEDDED_NUM_PARAMETERS, LLMServiceSpec

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
    required_bytes: int
    """weights shard + KV + overhead, rounded up to MiB."""
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


def plan_memory(spec: LLMServiceSpec) -> MemoryPlan | None:
    """Memory of one rank pod, or None when the parameter count is unknown (validation reports it)."""
    params = num_parameters(spec)
    if params is None:
        return None
    q, res, ranks = spec.quantization, spec.resources, spec.ranks_per_replica
    bpp = bytes_per_parameter(q.weights, q.group_size)
    shard = math.ceil(params * bpp / ranks)
    kv = math.ceil(res.kv_cache_gb * GIB)
    overhead = math.ceil(res.overhead_gb * GIB)
    required = math.ceil((shard + kv + overhead) / MIB) * MIB
    limit = required if res.memory_per_rank_gb is None else math.floor(res.memory_per_rank_gb * GIB / MIB) * MIB
    label = f"{q.weights}/g{q.group_size}" if q.weights == "int4" else q.weights
    arithmetic = (f"weights {shard / GIB:.3f} GiB ({params} params x {bpp:g} B {label} / {ranks} ranks)"
                  f" + KV {kv / GIB:.3f} GiB + overhead {overhead / GIB:.3f} GiB"
                  f" = {required // MIB}Mi; pod {limit // MIB}Mi")
    return MemoryPlan(shard, kv, overhead, required, limit, arithmetic)


def download_size_limit(spec: LLMServiceSpec) -> str:
    """emptyDir size for a downloaded checkpoint: params x stored bytes, +10% and 256 MiB slack."""
    stored = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 1.0625, "Q4_0": 0.5625, "Q4_1": 0.625}
    per_param = stored[spec.model.checkpoint_type or "F32"]
    params = num_parameters(spec) or 0
    return f"{math.ceil(params * per_param * 1.1 / MIB) + 256}Mi"
