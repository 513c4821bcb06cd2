"""engine/layers/ops.py is the one place that picks a C++ kernel or its plain-torch reference."""
import re
from pathlib import Path

import pytest
import torch

from cpuserve.engine.layers import native, ops
from cpuserve.engine.layers.attention import decode_mask
from cpuserve.engine.layers.kv_quant import LayerKV, gather_codes

ENGINE = Path(__file__).resolve().parents[2] / "engine"
MODEL_CODE = [*sorted((ENGINE / "models").glob("*.py")), ENGINE / "distributed" / "sharding.py"]
# importing native.py or calling a torch.ops.cpuserve kernel: a kernel chosen outside ops.py
KERNEL_CHOICE = re.compile(r"^\s*from cpuserve\.engine\.layers import .*\bnative\b"
                           r"|layers\.native\b|torch\.ops\.cpuserve", re.MULTILINE)


@pytest.mark.parametrize("path", MODEL_CODE, ids=lambda p: p.name)
def test_model_code_calls_ops_not_kernels(path):
    found = KERNEL_CHOICE.findall(path.read_text())
    assert not found, f"{path.name} chooses kernels itself ({found}): call engine/layers/ops.py instead"


def test_the_check_sees_a_kernel_choice():
    assert KERNEL_CHOICE.search("from cpuserve.engine.layers import native\n")
    assert KERNEL_CHOICE.search("        y = torch.ops.cpuserve.rms_norm(x, w, eps)\n")
    assert not KERNEL_CHOICE.search("from cpuserve.engine.layers import ops\n")


def test_decode_mask_only_for_the_reference(monkeypatch):
    lens = torch.tensor([3, 17], dtype=torch.int32)
    monkeypatch.setattr(native, "enabled", lambda: True)
    assert ops.prepare_decode_mask(lens, 16) is None  # the kernel masks by context_lens itself
    monkeypatch.setattr(native, "enabled", lambda: False)
    assert torch.equal(ops.prepare_decode_mask(lens, 16), decode_mask(lens, 16))


def _int8_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int = 0):
    """A layer's int8 pool as the engine holds it, K heads then V heads side by side, with random codes and scales."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randint(-127, 128, (num_blocks, block_size, 2 * kv_heads, head_dim), generator=gen, dtype=torch.int8)
    scale = torch.rand(num_blocks, block_size, 2 * kv_heads, generator=gen) * 0.05
    return kv, scale


@pytest.mark.parametrize("head_dim", [64, 72])  # 72: a tail past the 16-wide steps
@pytest.mark.parametrize("length", [1, 16, 37, 160])
def test_gather_kv_kernel_gives_the_references_bits(head_dim, length):
    assert native.available(), "the fused kernels must build here (gcc and ninja are installed by the project)"
    kv, scale = _int8_pool(14, 16, 3, head_dim)
    layer = LayerKV(kv, scale)
    table = torch.randperm(14, generator=torch.Generator().manual_seed(length))[:10]
    for table_dtype in (torch.int32, torch.int64):
        k, v = torch.ops.cpuserve.gather_kv_int8(kv, scale, table.to(table_dtype), length)
        assert torch.equal(k, ops.gather_kv_reference(layer.k, layer.k_scale, table, length, torch.bfloat16))
        assert torch.equal(v, ops.gather_kv_reference(layer.v, layer.v_scale, table, length, torch.bfloat16))


@pytest.mark.parametrize("length", [1, 37, 160])
def test_gather_context_kernel_gives_the_pools_k_codes_and_the_references_v(length):
    """Where Q K^T runs in int8, prefill reads K as the pool stores it and V dequantized, in one pass: the codes and
    scales equal the pool's rows (kv_quant.gather_codes), V the reference's bits."""
    assert native.available()
    kv, scale = _int8_pool(14, 16, 3, 64, seed=length)
    layer = LayerKV(kv, scale)
    table = torch.randperm(14, generator=torch.Generator().manual_seed(length))[:10]
    for table_dtype in (torch.int32, torch.int64):
        k, k_scale, v = torch.ops.cpuserve.gather_context_int8(kv, scale, table.to(table_dtype), length)
        codes, scales = gather_codes(layer.k, layer.k_scale, table, length)
        assert k.dtype == torch.int8 and torch.equal(k, codes) and torch.equal(k_scale, scales)
        assert torch.equal(v, ops.gather_kv_reference(layer.v, layer.v_scale, table, length, torch.bfloat16))


def test_gather_context_kernel_refuses_a_block_outside_the_pool():
    kv, scale = _int8_pool(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match=r"block_table\[1\] = 9 is not a block of the pool \(4\)"):
        torch.ops.cpuserve.gather_context_int8(kv, scale, torch.tensor([0, 9]), 20)


def test_gather_kv_kernel_refuses_a_block_outside_the_pool():
    assert native.available()
    kv, scale = _int8_pool(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match=r"block_table\[1\] = 9 is not a block of the pool \(4\)"):
        torch.ops.cpuserve.gather_kv_int8(kv, scale, torch.tensor([0, 9]), 20)
    with pytest.raises(RuntimeError, match="at least ceil\\(length / B\\) = 2 blocks"):
        torch.ops.cpuserve.gather_kv_int8(kv, scale, torch.tensor([0]), 20)
