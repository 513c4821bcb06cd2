"""The fused decode step (engine/csrc/decode_layers.cpp via engine/models/fused_decode.py) against the op-by-op
path it replaces: the same logits and the same KV pool contents, bit for bit, on the real SmolLM2 weights."""
from __future__ import annotations

import pytest
import torch

from cpuserve.engine.layers import native
from cpuserve.engine.models import fused_decode
from cpuserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="needs the int8 dot-product kernels")

PROMPTS = ["The capital of France is", "Write a haiku about the sea, then explain it line by line:", "1, 2, 3,"]


def _pools(model) -> list[torch.Tensor]:
    return [t.clone() for layer in model.layers for t in (layer.attention.kv.kv, layer.attention.kv.scale)
            if t is not None]


def _check_every_decode_step(llm, prompts) -> None:
    """The sequences decode together; at every decode-only step the op-by-op path runs first, then the fused one
    on the same inputs: logits and the K/V it wrote must be identical."""
    model = llm.engine.runner.model
    assert model.fused_decode() is not None, "the model's layers should take the fused path"
    forward = model.forward
    checked = []

    def both(token_ids, meta, logit_rows):
        if meta.prefills:
            return forward(token_ids, meta, logit_rows)
        fused, model._fused = model._fused, None  # op-by-op first
        try:
            expected = forward(token_ids, meta, logit_rows)
        finally:
            model._fused = fused
        pools = _pools(model)
        got = forward(token_ids, meta, logit_rows)  # the same slots written again, now by the fused step
        assert torch.equal(got, expected), f"logits differ at step {len(checked)}"
        assert all(torch.equal(a, b) for a, b in zip(_pools(model), pools)), "the KV written differs"
        checked.append(len(token_ids))
        return got

    model.forward = both
    try:
        llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    finally:
        del model.forward
    assert checked and max(checked) == len(prompts), f"decode steps checked: {checked}"


def test_every_decode_step_matches_the_op_by_op_path_bit_for_bit(llm_int4):
    """SmolLM2 (Llama), int4 weights from the GGUF's own codes, int8 KV; three sequences of different lengths."""
    _check_every_decode_step(llm_int4, PROMPTS)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "phi4-mini"])
def test_qkv_biases_head_norms_and_partial_rotary_match_too(tmp_path, name):
    """Qwen2's qkv biases, Qwen3's q/k norms, Phi-4-mini's partial rotary heads with LongRoPE (the same full-head
    rotation, pass-through pairs at cos 1 / sin 0: models/rope.py), on tiny random-weight models (arch_factory.py),
    bf16 KV."""
    from arch_factory import build_hf_model, save_hf_folder, tiny_tokenizer

    from cpuserve.engine.llm import LLM

    folder = save_hf_folder(build_hf_model(name), tmp_path / "hf", tiny_tokenizer(tmp_path))
    llm = LLM(model=folder, weights="int4", kv_cache="bf16", kv_cache_gb=0.02, show_progress=False)
    model = llm.engine.runner.model
    attention = model.layers[0].attention
    present = {"qwen2": attention.qkv.bias is not None, "qwen3": attention.q_norm is not None,
               "phi4-mini": model.args.rotary_dim < model.args.head_dim and model.args.long_rope is not None}
    assert present[name]
    _check_every_decode_step(llm, [[5, 17, 99], [3, 250, 42, 42, 7, 130, 64], [8]])


def test_q4_k_m_layers_with_stacked_qkv_match_too(tmp_path):
    """A tiny Q4_K_M file: layer 1's qkv keeps Q4_K q, k and Q6_K v apart (StackedLinear), two GEMMs into one qkv."""
    from kquant_factory import write_q4_k_m

    from cpuserve.engine.layers.linear.stacked import StackedLinear
    from cpuserve.engine.llm import LLM

    write_q4_k_m(tmp_path / "tiny-q4_k_m.gguf")
    llm = LLM(model=str(tmp_path / "tiny-q4_k_m.gguf"), kv_cache_gb=0.02, show_progress=False)
    assert isinstance(llm.engine.runner.model.layers[1].attention.qkv, StackedLinear)
    _check_every_decode_step(llm, [[5, 17, 99], [3, 250, 42, 42, 7, 130, 64], [8]])


def test_mixture_of_experts_layers_match_too(tmp_path):
    """A tiny Qwen3-MoE with Q4_K gate/up and Q6_K down experts (Q4_K_M's types): each layer's router and routed
    experts in one call (moe_experts.cpp) inside the fused step."""
    from arch_factory import build_hf_model, write_gguf

    from cpuserve.engine.llm import LLM

    model = build_hf_model("qwen3moe", hidden_size=256, moe_intermediate_size=256, head_dim=64)
    experts = {"ffn_gate_exps.weight": "Q4_K", "ffn_up_exps.weight": "Q4_K", "ffn_down_exps.weight": "Q6_K"}
    path = write_gguf(model, tmp_path / "moe.gguf", "qwen3moe", expert_qtype=experts, dense_qtype="Q8_0")
    llm = LLM(model=path, kv_cache_gb=0.02, show_progress=False)
    assert all(layer.mlp.stack is not None for layer in llm.engine.runner.model.layers)
    _check_every_decode_step(llm, [[5, 17, 99], [3, 250, 42, 42, 7, 130, 64], [8]])


def test_layers_that_do_not_fit_keep_the_op_by_op_path(llm_int4, monkeypatch):
    model = llm_int4.engine.runner.model
    norm = model.layers[3].ffn_norm
    monkeypatch.setattr(norm, "eps", norm.eps * 10)  # a norm whose eps the C++ step (one eps for all) would not use
    assert fused_decode.FusedDecode.build(model) is None
    monkeypatch.undo()
    assert fused_decode.FusedDecode.build(model) is not None
    monkeypatch.setenv(fused_decode.ENV, "0")
    assert fused_decode.FusedDecode.build(model) is None
    monkeypatch.setenv(fused_decode.ENV, "yes")
    with pytest.raises(ValueError, match="CPUSERVE_FUSED_DECODE='yes'"):
        fused_decode.FusedDecode.build(model)


def test_bad_arguments_are_refused_with_the_count_expected(llm_int4):
    fused = llm_int4.engine.runner.model.fused_decode()
    x = torch.zeros(1, llm_int4.engine.args.dim, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weights hold fewer tensors"):
        torch.ops.cpuserve.decode_layers(x, fused.weights[:-1], fused.linear_meta, fused.pools, fused.extras, x, x,
                                         torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                                         torch.ones(1, dtype=torch.int32), fused.n_heads, fused.eps, fused.scale)
