"""The workload every engine of bench/engine.py gets alike: random prompts and the KV capacity they need.

Its own module so that engine_workers.py and peers.py both import it without importing each other.
"""
from __future__ import annotations

import numpy as np

FIRST_ID, LAST_ID = 200, 40000  # ordinary tokens of the SmolLM2 vocabulary: no special or control tokens


def make_prompts(num_seqs: int, length: int, seed: int) -> list[list[int]]:
    """Random token ids, different for every repetition: a repeated prompt would hit cpuserve's prefix cache."""
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_ID, LAST_ID, size=(num_seqs, length)).tolist()


def kv_tokens(cfg: dict) -> int:
    """KV capacity every engine gets: the largest measurement's tokens, padded as llama.cpp pads contexts."""
    def pad(n: int) -> int:
        return -(-n // 256) * 256

    decode = max((b * pad(cfg["prompt_len"] + cfg["gen_tokens"]) for b in cfg["batches"]), default=0)
    return max(decode, pad(cfg.get("prefill_len", 0) + 1))
