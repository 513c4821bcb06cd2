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
SPECULATIVE_METHODS = ("ngram", "draft")  # drafters (engine/spec/); None = no speculation


def option(default: Any, help: str, choices: tuple = ()) -> Any:
    """An EngineConfig field a user sets: `help` (and `choices`) are the one text that `cpuserve generate`'s flags
    and ServeConfig's fields (its flags, YAML and CPUSERVE_SERVE_* variables) show for it (engine/cli.py,
    serving/config.py)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Unknown keys are filtered by `from_kwargs`."""

    model: str | None = option(None, "GGUF file or Hugging Face folder; None = the embedded SmolLM2-135M-Instruct.")
    weights: str = option("int4", "Runtime weight format: int4 codes in groups, int8 per output channel, bf16 "
                          "or fp32.", WEIGHT_FORMATS)
    group_size: int = option(32, "int4 quantization group along the input dimension (weights int4 only).",
                            GROUP_SIZES)
    activations: str = option("int8", "What int4 / int8 weights multiply: int8 (one scale per 32 inputs: the default, "
                              "within 1% of fp32's perplexity), int8-token (one scale per token, weights int8 only: "
                              "vLLM's W8A8 scheme, the throughput mode for long prompts at a few % of perplexity; "
                              "docs/engine.md) or bf16 (exact).", ACTIVATION_FORMATS)
    kv_cache: str = option("int8", "KV cache element type; int8 keeps one fp32 scale per token and KV head.",
                           KV_CACHE_DTYPES)
    kv_cache_gb: float = option(1.0, "Memory budget of the KV block pool (each replica's), GiB.")
    block_size: int = option(16, "Tokens per KV block.")
    max_num_seqs: int = option(64, "Sequences one replica runs at once.")
    max_num_batched_tokens: int = option(512, "Token budget of one engine step (prompts above it are prefilled in "
                                         "chunks; a step runs up to 1/16 more to finish a prompt).")
    max_model_len: int | None = option(None, "Context length (prompt + output); None = the model's.")
    arrival_window_ms: float = option(0.0, "After an idle spell, how long the engine waits for requests sent "
                                      "together before its first step (it stops waiting once none has come for a "
                                      "quarter of this, and does not wait while requests keep coming alone); "
                                      "0 = none.")
    enable_prefix_caching: bool = option(True, "Reuse the KV blocks of a prompt prefix seen before.")
    num_threads: int | None = option(None, "torch threads; None = the cores in the process's affinity mask.")
    ranks: int = 1  # tensor-parallel ranks of one replica group (processes, each bound to its own CPU set)
    tp_mode: str = "exact"  # "exact": bit-identical to 1 rank (all-gathers); "reduce": row-parallel all-reduces
    transport: str | None = option(None, "Collectives of a replica group: shm (one host) or torch (gloo/ccl); None: "
                                   "CPUSERVE_COMM, else shm when the ranks share a host.", ("shm", "torch"))
    launcher: Any = None  # starts ranks 1..k-1 (distributed/group.py); None = processes on this host
    seed: int = option(0, "Seed of the engine's generator for unseeded requests.")
    show_progress: bool = True
    # speculative decoding (engine/spec/): "ngram" drafts from each request's own tokens and the prefix cache's blocks,
    # "draft" from a draft model with the same tokenizer (its own KV pool: spec/draft_model.py).
    # The thresholds below are measured (docs/engine.md, "Speculative decoding": bench/speculative.py).
    speculative: str | None = option(None, "Speculative decoding: \"ngram\" drafts tokens from each request's own "
                                     "text and from the prefix cache's blocks (no draft model); \"draft\" runs "
                                     "spec_draft_model. Drafts are verified in the batched step; greedy output is "
                                     "unchanged. None = off.", SPECULATIVE_METHODS)
    spec_tokens: int = option(4, "Draft tokens a request may verify per step, at most.")
    spec_draft_model: str | None = option(None, "Draft model of speculative=\"draft\": a GGUF file or Hugging Face "
                                          "folder with the model's tokenizer; None = the embedded "
                                          "SmolLM2-135M-Instruct.")
    spec_draft_weights: str | None = option(None, "Runtime weight format of the draft model; None = weights'.",
                                            WEIGHT_FORMATS)
    spec_draft_kv_cache_gb: float = option(0.25, "Memory budget of the draft model's own KV block pool, GiB.")
    spec_ngram_min: int = 2  # n: the shortest suffix matched (the longest, spec_ngram_max, is tried first)
    spec_ngram_max: int = 4
    spec_max_batch: int = option(4, "No drafting in a step that runs more requests than this (a large batch is "
                                 "compute-bound: rows cost).")
    spec_pause_after: int = 3  # a request whose drafts were wholly rejected this many steps in a row pauses ...
    spec_pause_steps: int = 16  # ... drafting for this many steps
    # ... and so does one that shares its step with other requests while its drafts keep less than this share
    # (a running average): beside others a row costs, alone it is almost free
    spec_min_acceptance: float = 0.5
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
        self._check_speculative()
        if self.model is not None and not os.path.exists(self.model):
            raise ValueError(f"model={self.model!r}: no such file or folder; give a .gguf file or a Hugging Face folder")

    def _check_speculative(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative={self.speculative!r} is not supported; use None (off) or one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        for name in ("spec_tokens", "spec_ngram_min", "spec_max_batch", "spec_pause_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.spec_ngram_max < self.spec_ngram_min:
            raise ValueError(f"spec_ngram_max={self.spec_ngram_max} must be >= spec_ngram_min={self.spec_ngram_min}")
        if self.spec_pause_steps < 0:
            raise ValueError(f"spec_pause_steps={self.spec_pause_steps} must be >= 0")
        if not 0 <= self.spec_min_acceptance <= 1:
            raise ValueError(f"spec_min_acceptance={self.spec_min_acceptance} must be between 0 and 1")
        if self.spec_draft_weights is not None and self.spec_draft_weights not in WEIGHT_FORMATS:
            raise ValueError(f"spec_draft_weights={self.spec_draft_weights!r} is not supported; use one of "
                             f"{', '.join(WEIGHT_FORMATS)}")
        if not self.spec_draft_kv_cache_gb > 0:
            raise ValueError(f"spec_draft_kv_cache_gb={self.spec_draft_kv_cache_gb} must be > 0")
        if self.spec_draft_model is not None and self.speculative != "draft":
            raise ValueError(f"spec_draft_model={self.spec_draft_model!r} is set but speculative="
                             f"{self.speculative!r}: set speculative='draft' to use a draft model")
        if self.spec_draft_model is not None and not os.path.exists(self.spec_draft_model):
            raise ValueError(f"spec_draft_model={self.spec_draft_model!r}: no such file or folder; give a .gguf "
                             "file or a Hugging Face folder")
        if self.spec_tokens >= self.max_num_batched_tokens:
            raise ValueError(f"spec_tokens={self.spec_tokens} must be below max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)


def engine_option(name: str) -> tuple[Any, str, tuple]:
    """(default, help, choices) of EngineConfig's user-set field `name`."""
    f = OPTIONS[name]
    return f.default, f.metadata["help"], f.metadata["choices"]


OPTIONS = {f.name: f for f in fields(EngineConfig) if "help" in f.metadata}  # the fields option() declares
