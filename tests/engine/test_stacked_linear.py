"""A fused weight whose row blocks differ in storage (engine/layers/linear/stacked.py): a Q4_K_M layer's Q4_K q, k
beside its Q6_K v, each block keeping its own codes, against the separate layers and gguf's own dequantization."""
from __future__ import annotations

import gguf
import pytest
import torch
from kquant_factory import real_blocks

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.layers.linear.act_int8 import W4A8Linear, W6A8Linear
from cpuserve.engine.layers.linear.coded import CodedRows, CodedWeight, concat_rows
from cpuserve.engine.layers.linear.stacked import StackedLinear
from cpuserve.engine.loader.gguf_codes import decode_codes

QT = gguf.GGMLQuantizationType
needs_vnni = pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="needs the int8 dot-product kernels")
K = 512
QKV = [("Q4_K", 64, 1), ("Q4_K", 32, 2), ("Q6_K", 32, 3)]  # (type, rows, seed) of q, k, v
ROWS = [1, 2, 5, 8, 13, 16, 17, 33]  # decode register blocks and beyond


def _parts(spec=QKV) -> tuple[list[CodedWeight], torch.Tensor]:
    """The coded parts and gguf's own dequantization of them, stacked."""
    raws = [(q, n, real_blocks(q, (n, K), seed)) for q, n, seed in spec]
    ref = torch.cat([torch.from_numpy(gguf.quants.dequantize(raw, QT[q])) for q, _, raw in raws])
    return [decode_codes(raw, QT[q], (n, K)) for q, n, raw in raws], ref


def _x(rows: int) -> torch.Tensor:
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)


def test_parts_of_one_storage_fuse_and_different_ones_stay_apart():
    parts, ref = _parts()
    rows = concat_rows(parts)
    assert isinstance(rows, CodedRows) and [(p.source, p.group, p.bits) for p in rows.parts] == [
        ("Q4_K", 32, 4), ("Q6_K", 16, 8)]
    assert rows.shape == (128, K) and rows.parts[0].shape == (96, K)  # q and k fused
    assert torch.equal(rows.dequantize(), ref)
    merged = rows.merged()  # one weight for the paths that take one: finest group, widest storage, same values
    assert (merged.group, merged.bits, merged.source) == (16, 8, "Q4_K+Q6_K") and torch.equal(merged.dequantize(), ref)
    same, _ = _parts([("Q4_K", 32, 1), ("Q4_K", 16, 2)])
    assert isinstance(concat_rows(same), CodedWeight)


@needs_vnni
def test_stacked_layer_is_the_separate_layers_side_by_side_bit_for_bit():
    parts, ref = _parts()
    bias = torch.randn(128)
    layer = build_linear(concat_rows(parts), bias, "int4", activations="int8")
    assert isinstance(layer, StackedLinear) and layer.out_features == 128
    assert [type(p) for p in layer.parts] == [W4A8Linear, W6A8Linear]
    # each part quantizes the activations itself, one scale per super-block over its own weight groups
    assert [(p.group_size, p.act_group) for p in layer.parts] == [(32, 256), (16, 256)]
    separate = [build_linear(p, None, "int4", activations="int8") for p in (concat_rows(parts[:2]), parts[2])]
    for rows in ROWS:
        x = _x(rows)
        expected = torch.cat([lin(x) for lin in separate], 1) + bias.bfloat16()
        assert torch.equal(layer(x), expected), rows
        out = torch.full((rows, 128), float("nan"), dtype=torch.bfloat16)
        assert layer(x, out=out) is out and torch.equal(out, expected)
    torch.testing.assert_close(layer.dequantize(), torch.cat([lin.dequantize() for lin in separate]), rtol=0, atol=0)
    x = _x(5)
    assert ((layer(x).double() - bias.bfloat16().double() - x.double() @ ref.double().T).norm()
            / (x.double() @ ref.double().T).norm()) < 0.01


@needs_vnni
def test_kernel_writes_only_its_block_of_columns():
    """out= a block of columns of a wider output (rows of a larger stride): the other columns stay untouched."""
    parts, _ = _parts()
    layer = build_linear(parts[2], None, "int4", activations="int8")
    for rows in (1, 9, 20):
        x = _x(rows)
        wide = torch.full((rows, 80), float("nan"), dtype=torch.bfloat16)
        torch.ops.cpuserve.vnni_gemm.out(x, layer.packed, layer.scales, layer.zoffs, 6, layer.act_group, layer.supers,
                                         out=wide[:, 24:56])
        assert torch.equal(wide[:, 24:56], layer(x)) and wide[:, :24].isnan().all() and wide[:, 56:].isnan().all()
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.cpuserve.vnni_gemm.out(x, layer.packed, layer.scales, layer.zoffs, 6, layer.act_group, layer.supers,
                                         out=torch.empty(32, 20, dtype=torch.bfloat16).t())


def test_without_the_kernel_the_merged_weight_is_used():
    parts, ref = _parts()
    layer = build_linear(concat_rows(parts), None, "int8", activations="bf16")
    assert not isinstance(layer, StackedLinear)
    step = ref.abs().amax(1, keepdim=True) / 127  # per-channel int8 re-quantization of the file's values
    assert ((layer.dequantize() - ref).abs() <= 0.51 * step * (1 + 2 ** -7)).all()
