"""The int8 dot-product GEMMs every kernel level must compute with the same bits (test_kernel_levels.py): each weight
form the engine builds, at row counts that reach every register block, remainder and tile path of each level.

    python tests/engine/level_gemms.py OUT.pt     # this process's level's outputs: {case: bf16 [rows, N]}

Run under CPUSERVE_KERNEL_LEVEL=<level> (a process loads one level); the layers are built from fixed seeds, so every
process multiplies the same codes and activations.
"""
from __future__ import annotations

import sys

import gguf
import torch
from kquant_factory import real_blocks

from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.layers.linear.coded import CodedWeight, to_linear
from cpuserve.engine.loader.gguf_codes import decode_codes

# decode (1..16: every remainder of a register block), prompt rows (register blocks, and AMX tiles from 128 rows on
# the AVX-512 level)
ROWS = (1, 2, 3, 5, 7, 8, 13, 16, 17, 23, 40, 133)


def _coded(bits: int, group: int, zero: int | None, n: int = 112, k: int = 512, half: bool = True, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    scale = scale.half().float() if half else scale
    zoff = -zero * scale if zero is not None else (torch.randn(n, k // group, generator=gen) * 0.01)
    zoff = zoff.half().float() if half else zoff
    return to_linear(CodedWeight(codes, scale, zoff, group, 8 if bits == 6 else bits, "test"), "int4")


def _float_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.05 + torch.randn(n, 1, generator=gen) * 0.02


def _kquant(qtype: str, shape=(64, 1024)):
    raw = real_blocks(qtype, shape, 0)
    return build_linear(decode_codes(raw, gguf.GGMLQuantizationType[qtype], shape), None, "int4", activations="int8")


def layers() -> dict:
    """case name -> layer (an Int8ActLinear)."""
    cases = {
        "int4_g32_fp32": build_linear(_float_weight(96, 512), None, "int4", 32, activations="int8"),
        "int4_g128": build_linear(_float_weight(80, 512), None, "int4", 128, activations="int8"),
        "int8_channel_g32": build_linear(_float_weight(96, 576), None, "int8", activations="int8"),
        "int8_token": build_linear(_float_weight(96, 576), None, "int8", activations="int8-token"),
        "q4_1_fp16": _coded(4, 32, None),
        "q4_0_sym": _coded(4, 32, 8),
        "int4_g16": _coded(4, 16, None),
        "q8_0_sym": _coded(8, 32, 128),
        "int8_asym_g32": _coded(8, 32, None, half=False),
        "int6_g16_sym": _coded(6, 16, 32),
        "int6_g16": _coded(6, 16, None),
        "int6_g32": _coded(6, 32, None),
        "int6_g64_sym": _coded(6, 64, 16),
    }
    for name, act_group in (("nested_int4_g32_a256", 256), ("nested_int4_sym_a64", 64)):
        layer = _coded(4, 32, None if "sym" not in name else 8)
        layer.act_group = act_group  # activation groups over several weight groups (block_nested)
        cases[name] = layer
    nested6 = _coded(6, 16, 32)
    nested6.act_group = 256
    cases["nested_int6_g16_a256"] = nested6
    for qtype in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        cases[qtype] = _kquant(qtype)
    return cases


def x_for(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 7] *= 20  # an outlier channel
    return x.to(torch.bfloat16)


@torch.inference_mode()
def outputs() -> dict[str, torch.Tensor]:
    out = {}
    for name, layer in layers().items():
        for rows in ROWS:
            out[f"{name}/{rows}"] = layer(x_for(rows, layer.in_features))
    return out


if __name__ == "__main__":
    torch.save(outputs(), sys.argv[1])
