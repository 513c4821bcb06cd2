"""activations="int8-token": per-channel int8 weights x int8 activations with one scale per token (vLLM's W8A8
scheme): against the plain-torch reference and against fp32, and refused where the weights are not per channel.
(A row's independence of the batch and the threads: test_int8_activations.py, parametrized with it.)"""
import pytest
import torch
import torch.nn.functional as F
from test_int8_activations import ROWS, assert_matches_reference, make_weight, make_x

from cpuserve.engine.config import EngineConfig
from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.layers.linear.act_int8 import W8A8Linear
from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.layers.linear.int8 import quantize_int8

pytestmark = pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="needs the int8 dot-product kernels")


def token_layer(n: int, k: int, bias: torch.Tensor | None = None) -> W8A8Linear:
    m = build_linear(make_weight(n, k), bias, "int8", activations="int8-token")
    assert isinstance(m, W8A8Linear) and m.act_group == k and m.scales.shape[1] == 1  # one group: the whole row
    return m


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (80, 96), (112, 80), (49152 // 8, 576)])
def test_matches_the_plain_torch_reference(n, k):
    """K = 80 and 96 are not multiples of 32: one scale per token needs K in steps of 16 only."""
    m = token_layer(n, k)
    for rows in ROWS + [64, 100]:
        x = make_x(rows, k)
        assert_matches_reference(m(x), m.reference(x))


def test_error_against_fp32_is_within_the_row_rounding_bound():
    """F.linear in fp32 over the dequantized weight: each activation moves by at most half of its row's step
    absmax / 127, so |y - y_fp32| <= 0.5 step |W| (plus the bf16 output rounding)."""
    m = token_layer(576, 1536)
    x = make_x(16, 1536).float()
    ref = F.linear(x, m.dequantize())
    step = x.abs().amax(-1, keepdim=True) / 127  # [M, 1]: one scale per row
    bound = 0.5 * step * m.dequantize().abs().sum(-1) + 2 ** -8 * ref.abs()
    err = (m(x).float() - ref).abs()
    assert (err <= bound * 1.001).all(), (err / bound).max()
    # coarser than groups of 32: the same weights with a scale per 32 inputs err less
    grouped = build_linear(make_weight(576, 1536), None, "int8", activations="int8")
    assert (grouped(x).float() - ref).abs().mean() < err.mean()


def test_a_files_block_codes_are_quantized_again_per_channel():
    """A block-quantized tensor (here 4-bit codes in groups of 32 with offsets) cannot keep its groups: its
    dequantized values are quantized per channel, as vLLM's W8A8 checkpoint is made from the same file."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (96, 512), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(96, 16, generator=gen) * 0.01 + 1e-3).half().float()
    zoff = (torch.randn(96, 16, generator=gen) * 0.01).half().float()
    coded = CodedWeight(codes, scale, zoff, 32, 4, "test")
    m = build_linear(coded, None, "int8", activations="int8-token")
    assert isinstance(m, W8A8Linear) and m.act_group == 512 and m.scales.shape[1] == 1
    q, s = quantize_int8(coded.dequantize())
    assert torch.equal(m.dequantize(), q.float() * s.float()[:, None])


def test_int8_token_is_refused_where_the_weights_are_not_per_channel():
    with pytest.raises(ValueError, match="activations='int8-token'.*weights='int8'.*got weights='int4'"):
        EngineConfig(activations="int8-token")  # the default weights are int4
    with pytest.raises(ValueError, match="activations='int8-token'.*fmt='int8', got fmt='int4'"):
        build_linear(make_weight(96, 512), None, "int4", 32, activations="int8-token")
    assert EngineConfig(weights="int8", activations="int8-token").activations == "int8-token"
