"""The token embedding looked up from a packed weight's codes instead of a dense bf16 table.

A GGUF's token_embd is block-quantized (a Q4_K_M 8B file: Q4_K, 0.56 bytes a weight); dequantized whole to bf16 it
would hold 2 bytes a weight for rows of which a step reads a few. With tied embeddings (Llama 3.2 1B / 3B, SmolLM2,
Gemma 3) the lm_head already holds the same codes: the lookup reads them there, so the table costs nothing. A step
unpacks only its own tokens' rows (Int8ActLinear.rows), the same values the lm_head multiplies.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from cpuserve.engine.layers.linear.act_int8 import Int8ActLinear


class CodedEmbedding(nn.Module):
    """Rows of `codes` (an Int8ActLinear over the vocabulary: [V, dim]) in `dtype`, times `multiplier` in that dtype
    when given (Gemma's sqrt(dim), rounded as its dense table was)."""

    def __init__(self, codes: Int8ActLinear, dtype: torch.dtype, multiplier: float | None = None):
        super().__init__()
        self.codes = codes  # a tied lm_head is a child of both modules: one copy of its buffers
        self.dtype = dtype
        self.multiplier = None if multiplier is None else torch.tensor(multiplier, dtype=dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.out_features, self.codes.in_features))

    def forward(self, token_ids: Tensor) -> Tensor:
        rows = self.codes.rows(token_ids.reshape(-1)).to(self.dtype)  # rows: [N, dim]
        return rows if self.multiplier is None else rows * self.multiplier
