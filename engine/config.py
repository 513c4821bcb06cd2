"""Engine configuration: one frozen-at-start dataclass, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

WEIGHT_FORMATS = ("int4", "int8", "bf16", "fp32")  # one class each in engine/layers/linear/
KV_CACHE_DTYPES = ("int8", "bf16", "fp32")
# what int4 / int8 weights multiply (engine/layers/linear/act_int8.py): int8 codes with one scale per group of inputs,
# int8 codes with one scale per token (vLLM's W8A8 scheme; per-channel int8 weights only), or bf16
ACTIVATION_FORMATS = ("int8", "int8-token", "bf16")
GROUP_SIZES = (32, 64, 128, 256)  # int4 groups along K: the ones torch's int4 CPU kernel (and ours) accept


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Unknown keys are filtered by `from_kwargs`."""

    model: str | None = None  # GGUF file or HF folder; None = the embedded SmolLM2 default
    weights: str = "int4"  # runtime weight format, see WEIGHT_FORMATS
    group_size: int = 32  # int4 quantization group along the input dimension
    activations: str = "int8"  # int4 / int8 weights x int8 activations (VNNI), or "bf16": torch's exact arithmetic
    kv_cache: str = "int8"  # KV cache dtype, see KV_CACHE_DTYPES
    kv_cache_gb: float = 1.0  # memory budget of the KV block pool
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 512  # token budget of a step (chunked prefill above it; +1/16 to finish a prompt)
    max_model_len: int | None = None  # None = the model's context length
    # after an idle spell, how long the engine waits for requests sent together before its first step (0: none)
    arrival_window_ms: float = 0.0
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # None = the cores of this process's affinity mask
    ranks: int = 1  # tensor-parallel ranks of one replica group (processes, each bound to its own CPU set)
    tp_mode: str = "exact"  # "exact": bit-identical to 1 rank (all-gathers); "reduce": row-parallel all-reduces
    transport: str | None = None  # "shm" | "torch"; None: CPUSERVE_COMM, else shm when all ranks share a host
    launcher: Any = None  # starts ranks 1..k-1 (distributed/group.py); None = processes on this host
    seed: int = 0
    show_progress: bool = True
    # derived at startup
    num_blocks: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights={self.weights!r} is not supported; use one of {', '.join(WEIGHT_FORMATS)}")
        if self.activations not in ACTIVATION_FORMATS:
            raise ValueError(f"activations={self.activations!r} is not supported; use one of "
                             f"{', '.join(ACTIVATION_FORMATS)}")
        if self.activations == "int8-token" and self.weights != "int8":
            raise ValueError(f"activations='int8-token' (one scale per token) goes with weights='int8' (per-channel int8),"
                             f" got weights={self.weights!r}: use weights='int8' or activations='int8'")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache={self.kv_cache!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size} is not supported; use one of {GROUP_SIZES}")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb} must be > 0")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= block_size={self.block_size}"
            )
        if not 0 <= self.arrival_window_ms <= 1000:
            raise ValueError(f"arrival_window_ms={self.arrival_window_ms} must be between 0 and 1000")
        if self.ranks < 1:
            raise ValueError(f"ranks={self.ranks} must be >= 1")
        if self.tp_mode not in ("exact", "reduce"):
            raise ValueError(f"tp_mode={self.tp_mode!r} is not supported; use 'exact' or 'reduce'")
        if self.transport not in (None, "shm", "torch"):
            raise ValueError(f"transport={self.transport!r} is not supported; use 'shm' or 'torch'")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads} must be >= 1")
        if self.model is not None and not os.path.exists(self.model):
            raise ValueError(f"model={self.model!r}: no such file or folder; give a .gguf file or a Hugging Face folder")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)
