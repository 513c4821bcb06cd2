"""The drafter interface: what the scheduler asks of whatever proposes draft tokens.

    prepare(requests, max_tokens)               once a step, before propose: the requests that may draft and at most
                                                how many tokens each (a drafter that runs a model batches them here)
    propose(request, max_tokens) -> list[int]   up to max_tokens tokens to follow the request's tokens ([] = none)
    forget(request_id)                          the request ended: drop what was kept for it
    populate_kv() -> bool                       idle work: fault in the next part of the drafter's own KV pool
                                                (ModelRunner.populate_kv); whether any is left (none: False)

Two drafters: the n-gram one (ngram.py: no model, no torch) and a draft model with the model's tokenizer
(draft_model.py: its own runner and KV pool, loaded only when chosen). Neither touches the model's KV pool.
"""

from __future__ import annotations

from typing import Protocol

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.config import EngineConfig
from cpuserve.engine.request import Request
from cpuserve.engine.spec.block_index import BlockIndex
from cpuserve.engine.spec.ngram import NgramDrafter


class Drafter(Protocol):
    def prepare(self, requests: list[Request], max_tokens: list[int]) -> None: ...

    def propose(self, request: Request, max_tokens: int) -> list[int]: ...

    def forget(self, request_id: str) -> None: ...

    def populate_kv(self) -> bool: ...


def check_rows_verify_exactly(config: EngineConfig) -> None:
    """Greedy speculative output is decoding's only where a verification row computes a one-token decode's bits:
    int4 / int8 weights (every kernel of theirs computes a row alone), fp32 / bf16 ones on dense_gemm
    (engine/layers/linear/dense.py); torch's F.linear, which they run where it is not built, rounds a row by its
    batch's size.

    Raises:
        ValueError: speculation with fp32 / bf16 weights where dense_gemm does not run.
    """
    if config.speculative is None or config.weights not in ("fp32", "bf16"):
        return
    from cpuserve.engine.layers import native  # torch: only for these weights

    if not native.dense_gemm_enabled():
        raise ValueError(f"speculative={config.speculative!r} with weights={config.weights!r} needs cpuserve's "
                         "fp32 / bf16 GEMM (engine/csrc/dense_gemm.cpp, AVX2 or AVX-512), whose rows do not depend "
                         f"on their batch, and it does not run here (CPUSERVE_KERNELS={native.mode()}): torch's "
                         "F.linear would round verification rows unlike decode rows; use weights='int4' or 'int8', "
                         "or speculative=None")


def build_drafter(config: EngineConfig, block_manager: BlockManager, tokenizer, vocab_size: int,
                  max_model_len: int) -> Drafter | None:
    """The drafter config.speculative names (None when speculation is off); the n-gram drafter indexes the blocks
    the block manager caches (when prefix caching is on); the draft model is checked against the model's tokenizer
    and vocab_size and drafts within max_model_len."""
    if config.speculative is None:
        return None
    if config.speculative == "draft":
        from cpuserve.engine.spec.draft_model import build_draft_model_drafter

        return build_draft_model_drafter(config, tokenizer, vocab_size, max_model_len)
    assert config.speculative == "ngram", config.speculative  # EngineConfig checked the name
    index = None
    if block_manager.enable_prefix_caching:
        n_range = config.spec_ngram_max - config.spec_ngram_min + 1
        index = BlockIndex(block_manager.blocks, block_manager.block_size, config.spec_ngram_min,
                           config.spec_ngram_max, max_entries=2 * block_manager.num_blocks * config.block_size * n_range)
        block_manager.on_cached = index.add
    return NgramDrafter(config.spec_ngram_min, config.spec_ngram_max, index)
