"""The ops the model calls, each choosing between its C++ kernel (engine/csrc, loaded by native.py as
torch.ops.cpuserve.*) and its plain-torch reference, which the tests compare the kernel against.

    op                 kernel (CPUSERVE_KERNELS=auto / native)    reference (=torch, or kernels not built)
    rms_norm           cpuserve.rms_norm                          F.rms_norm
    silu_mul           cpuserve.silu_mul.out                      F.silu(gate) * up
    rope_write_kv      cpuserve.rope_write_kv                     models/rope.py apply_rope + kv_quant.write_kv_fused
    gather_kv          cpuserve.gather_kv_int8 (int8 pool -> bf16)  kv_quant.gather_kv, for K and for V
    decode_attention   cpuserve.decode_attention.out              attention.paged_decode_attention
    prefill_context    gather_kv, or cpuserve.gather_context_int8  kv_quant.gather_codes + gather_kv for V
                       (the int8 K as stored, V dequantized)
    prefill_attention  cpuserve.slim_attention (bf16: AMX/AVX512;  attention.slim_attention
                       fp32: AVX-512)
    argmax_rows        cpuserve.argmax_rows                       logits.max(dim=-1).indices
    router_logits      cpuserve.dense_gemm over an fp32 router    x in float64 @ a float64 router, rounded to fp32
                       (router_dtype() says which the weights are kept in)
    decode_layers      cpuserve.decode_layers (models/fused_decode.py; the op-by-op path of the model's own modules
                       is its reference: decode_layers_enabled() says whether it can run)
    moe_experts        cpuserve.moe_experts (a mixture of experts' router and routed experts in one call; its reference
                       is models/moe.py's MoE.route and experts_reference, the experts' own modules one by one);
                       moe_expert_rows and moe_combine: its two halves, for a replica group's ranks

Model code (engine/models, engine/distributed/sharding.py) calls these and never asks native.py itself. The
weight formats' matmuls choose their GEMM in engine/layers/linear/.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from cpuserve.engine.layers import native
from cpuserve.engine.layers.attention import Q_GROUP, decode_mask, paged_decode_attention, slim_attention
from cpuserve.engine.layers.kv_quant import LayerKV, gather_codes, gather_kv as gather_kv_reference, write_kv_fused
from cpuserve.engine.models.rope import apply_rope

NATIVE_SLIM_BLOCK_ROWS = 32  # the C++ kernel's row block (4096-token bench: 16..32 best, 8 and 128 slower)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / rms(x) * weight over the last dimension."""
    if native.enabled():
        return torch.ops.cpuserve.rms_norm(x.contiguous(), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h, rms_norm(h)) with h = x + delta: a residual add and the next norm in one pass, the bits of the two."""
    if native.enabled():
        return torch.ops.cpuserve.add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps)
    h = x + delta
    return h, rms_norm(h, weight, eps)


def silu_mul(gate_up: Tensor, make_out: Callable[[int, torch.dtype], Tensor]) -> Tensor:
    """silu(gate) * up of gate_up = [gate | up] [N, 2F] -> [N, F].

    make_out(rows, dtype): the [N, F] tensor the kernel writes into (in a replica group, the next layer's
    shared-memory slot: zero-copy). The reference returns a new tensor and never calls it.
    """
    if native.enabled():
        act = make_out(gate_up.shape[0], gate_up.dtype)
        return torch.ops.cpuserve.silu_mul.out(gate_up.contiguous(), out=act)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gather_kv(kv: LayerKV, block_table: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One sequence's first `length` tokens of a layer's pool, K and V, each contiguous and dequantized:
    [length, Hkv, D] in dtype (kv_quant.gather_kv documents the block table)."""
    if native.enabled() and kv.kv.dtype == torch.int8 and dtype == torch.bfloat16:
        return torch.ops.cpuserve.gather_kv_int8(kv.kv, kv.scale, block_table, length)
    return (gather_kv_reference(kv.k, kv.k_scale, block_table, length, dtype),
            gather_kv_reference(kv.v, kv.v_scale, block_table, length, dtype))


def prefill_context(kv: LayerKV, block_table: Tensor, length: int, dtype: torch.dtype, int8_keys: bool
                    ) -> tuple[Tensor, Tensor | None, Tensor]:
    """gather_kv for prefill_attention: (K, K's scales, V), each for the first `length` tokens.

    int8_keys (the layer's activations are int8): where the pool is int8 and the C++ SlimAttention takes an int8 K
    (native.slim_attention_int8_keys(): its products run on AVX-512 with VNNI, not AMX), K is the pool's codes with
    their scales [T, Hkv], so Q K^T runs as int8 dot products. Otherwise K comes dequantized like V, scales None.
    """
    head_dim = kv.kv.shape[-1]
    if (int8_keys and kv.kv.dtype == torch.int8 and dtype == torch.bfloat16 and head_dim % Q_GROUP == 0
            and native.slim_attention_int8_keys()):
        if native.enabled():  # one pass: K's codes and scales copied, V dequantized
            return torch.ops.cpuserve.gather_context_int8(kv.kv, kv.scale, block_table, length)
        codes, scale = gather_codes(kv.k, kv.k_scale, block_table, length)
        return codes, scale, gather_kv_reference(kv.v, kv.v_scale, block_table, length, dtype)
    k, v = gather_kv(kv, block_table, length, dtype)
    return k, None, v


def rope_write_kv(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, kv: LayerKV, slot_mapping: Tensor) -> None:
    """RoPE on the q and k heads of qkv, in place, then the k and v heads into the pool.

    Args:
        qkv: [N, H + 2 Hkv, D] (q heads, k heads, v heads); cos, sin: [N, 1, D]; num_heads: H.
        slot_mapping: [N] int64, slot = block_id * B + offset.
    """
    if native.enabled():  # one C++ pass
        torch.ops.cpuserve.rope_write_kv(qkv, cos, sin, num_heads, kv.kv, kv.scale, slot_mapping)
        return
    h, hkv = num_heads, kv.num_kv_heads
    # one rotation for q and k together, written back so k and v stay adjacent for the fused KV write
    qkv[:, : h + hkv] = apply_rope(qkv[:, : h + hkv], cos, sin)
    write_kv_fused(kv.kv, kv.scale, qkv[:, h:], slot_mapping)


def decode_attention(q: Tensor, kv: LayerKV, block_tables: Tensor, context_lens: Tensor, scale: float, out: Tensor,
                     invalid: Tensor | None = None, window: int = 0) -> None:
    """One new token per sequence against its paged context, written into out.

    Args:
        q: [S, H, D]; out: [S, H, D] (a view of o_proj's input buffer).
        block_tables: [S, max_blocks] int32; context_lens: [S] int32, including the new token.
        invalid: prepare_decode_mask's result for this step and window (the reference reads it; built when None).
        window: > 0 for a sliding-window layer: each sequence's last `window` tokens only.
    """
    if native.enabled():
        torch.ops.cpuserve.decode_attention.out(q, kv.kv, kv.scale, block_tables, context_lens, scale, window,
                                                out=out)
        return
    out[:] = paged_decode_attention(q, kv.k, kv.k_scale, kv.v, kv.v_scale, block_tables, context_lens, scale,
                                    invalid=invalid, window=window)


def prepare_decode_mask(context_lens: Tensor, block_size: int, window: int = 0) -> Tensor | None:
    """decode_mask for the step when decode_attention runs the reference (built once, read by every layer of that
    window); None when the kernel runs, which needs none."""
    return None if native.enabled() else decode_mask(context_lens, block_size, window)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float, window: int = 0,
                      k_scale: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """SlimAttention as the engine runs it: the C++ kernel (engine/csrc/slim_attention.cpp: bf16 products on AMX
    or AVX512-BF16, fp32 softmax; with an int8 K and k_scale from prefill_context, Q K^T in int8) for bf16 when it
    is built and the CPU has either, and for fp32 (fp32 products: slim_attention_fp32.cpp) when it is built with
    AVX-512; else attention.slim_attention. Same arguments, and out: a contiguous tensor of q's shape and dtype to
    write the result into (o_proj's input rows), returned. The kernel's rows do not depend on how a prompt was split
    (whole, in chunks, after a prefix-cache hit); the plain-torch path's fp32 matmuls round a row by its block's
    size."""
    if (native.slim_attention_native_enabled() if q.dtype == torch.bfloat16 else
            q.dtype == torch.float32 and native.slim_attention_fp32_enabled()):
        args = (q, k.contiguous(), v.contiguous(), q_start, scale, NATIVE_SLIM_BLOCK_ROWS, window, k_scale)
        if out is None:
            return torch.ops.cpuserve.slim_attention(*args)
        return torch.ops.cpuserve.slim_attention.out(*args, out=out)
    result = slim_attention(q, k, v, q_start, scale, window=window, k_scale=k_scale)
    return result if out is None else out.copy_(result)


def argmax_rows(logits: Tensor) -> Tensor:
    """The first maximum of each row of logits [S, V] float32 (a NaN counts as the largest): [S] int64."""
    if native.enabled() and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.ops.cpuserve.argmax_rows(logits)
    return logits.max(dim=-1).indices


def router_dtype() -> torch.dtype:
    """The dtype a mixture of experts keeps its router [E, dim] in for router_logits: fp32 where dense_gemm runs,
    else float64."""
    return torch.float32 if native.dense_gemm_enabled() else torch.float64


def router_logits(x: Tensor, router: Tensor) -> Tensor:
    """x [N, dim] (bf16 or fp32) @ router.T -> logits [N, E] fp32, each row's bits independent of N and of its place
    in the batch (a request is routed alike batched and alone; moe_experts' route computes the same bits).

    An fp32 router (router_dtype()): dense_gemm, one fixed summation order per element, reading 4 bytes a weight.
    A float64 one (the plain-torch path): torch's matmul in float64, whose order follows N, but a logit could only
    change where the float64 sums of two orders straddle an fp32 rounding boundary.
    """
    if router.dtype == torch.float32:
        return torch.ops.cpuserve.dense_gemm(x.float().contiguous(), router, None)  # [N, E]
    return (x.to(torch.float64) @ router.T).float()  # [N, E]


def decode_layers_enabled() -> bool:
    """decode_layers can run: the kernels are built, with the int8 dot-product GEMMs it strings together."""
    return native.vnni_gemm_enabled()


def decode_layers(x: Tensor, weights: list[Tensor], linear_meta: list[int], pools: list[Tensor],
                  extras: list[Tensor | None], cos: Tensor, sin: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                  context_lens: Tensor, n_heads: int, eps: float, scale: float) -> Tensor:
    """Every decoder layer of a decode-only step in one C++ call (engine/csrc/decode_layers.cpp documents the
    arguments); only where decode_layers_enabled()."""
    return torch.ops.cpuserve.decode_layers(x, weights, linear_meta, pools, extras, cos, sin, slot_mapping,
                                            block_tables, context_lens, n_heads, eps, scale)


def moe_experts_enabled() -> bool:
    """moe_experts can run: the kernels are built, with the int8 dot-product GEMMs it calls per expert."""
    return native.vnni_gemm_enabled()


def moe_experts(x: Tensor, router: Tensor, n_used: int, norm_topk_prob: bool, gate_up: list[Tensor | None],
                down: list[Tensor | None], meta: list[int]) -> Tensor:
    """A mixture of experts' router and routed experts over x [N, dim] bf16 in one C++ call
    (engine/csrc/moe_experts.cpp documents the arguments); only where moe_experts_enabled()."""
    return torch.ops.cpuserve.moe_experts(x, router, n_used, norm_topk_prob, gate_up, down, meta)


def moe_expert_rows(x: Tensor, router: Tensor, n_used: int, norm_topk_prob: bool, gate_up: list[Tensor | None],
                    down: list[Tensor | None], meta: list[int], first: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A replica group rank's part of moe_experts: route over every expert, run experts [first, first + stacked)
    only -> (their pairs' rows [Q, dim] bf16, weights [N, k], pairs by expert [N k], expert e's at [start[e],
    start[e + 1]) [E + 1]); only where moe_experts_enabled()."""
    return torch.ops.cpuserve.moe_expert_rows(x, router, n_used, norm_topk_prob, gate_up, down, meta, first)


def moe_combine(ys: Tensor, weights: Tensor, order: Tensor, start: Tensor, first: int, stop: int, out: Tensor) -> Tensor:
    """out [N, dim] fp32 = the weighted sum of the pairs of experts [first, stop), whose rows ys holds in pair order
    (moe.py's combine_reference in one C++ loop: the same bits)."""
    torch.ops.cpuserve.moe_combine(ys, weights, order, start, first, stop, out)
    return out
