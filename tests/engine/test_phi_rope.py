"""Phi-4-mini's partial rotary heads and Phi-3 128k / Phi-4-mini's LongRoPE, from a safetensors folder and from a
GGUF, against transformers running the same tiny random-weight models (arch_factory.py LONG_ROPE_ARCHS).

Which LongRoPE factors: the engine fixes one set for its whole context (engine/models/rope.py long_rope_factors):
the long ones when max_model_len > original_max_position_embeddings (ORIGINAL_CTX here), else the short ones.
transformers picks by the current sequence's length, so the two agree where every sequence a test runs stays on the
engine's side of ORIGINAL_CTX: "short" runs with max_model_len = ORIGINAL_CTX and 6 + 32 tokens, "long" with the
model's context (256) and a prompt longer than ORIGINAL_CTX.
"""
from __future__ import annotations

import json

import gguf
import gguf_factory as gf
import pytest
import torch
from arch_factory import CTX, HEADS, LONG_ROPE_ARCHS, ORIGINAL_CTX, build_hf_model, save_hf_folder, tiny_tokenizer, \
    write_gguf
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from cpuserve.engine.layers import ops
from cpuserve.engine.layers.kv_quant import LayerKV
from cpuserve.engine.llm import LLM
from cpuserve.engine.loader import load_checkpoint
from cpuserve.engine.models.rope import apply_rope, rope_tables, rotary_order
from cpuserve.engine.sampling_params import SamplingParams

SHORT_IDS = [5, 17, 99, 3, 250, 42, 42, 7, 130, 64, 8, 200, 11, 77, 150, 23, 5, 90, 31, 260]
LONG_IDS = [(37 * i * i + 11 * i + 5) % 260 + 3 for i in range(ORIGINAL_CTX + 8)]  # 48 tokens: past the switch
REGIMES = {"short": (ORIGINAL_CTX, SHORT_IDS, SHORT_IDS[:6]), "long": (None, LONG_IDS, LONG_IDS)}  # max_model_len,
# the prompt scored at every position, the prompt 32 tokens are generated from


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("name", sorted(LONG_ROPE_ARCHS))
@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, tokenizer, name, fmt, regime):
    max_model_len, scored, prompt = REGIMES[regime]
    model = build_hf_model(name)
    # phi3-128k's GGUF leaves out rope.scaling.attn_factor: the loader derives it from the two context lengths
    path = write_gguf(model, tmp_path / "m.gguf", name, attn_factor=name == "phi4-mini") if fmt == "gguf" else \
        save_hf_folder(model, tmp_path / "hf", tokenizer)
    llm = LLM(model=path, weights="fp32", kv_cache="fp32", kv_cache_gb=0.02, max_model_len=max_model_len,
              show_progress=False)
    assert (llm.engine.max_model_len > ORIGINAL_CTX) == (regime == "long")
    ours = llm.engine.score(scored)  # [L, V]
    ref = _reference_logits(model, scored)
    spread = (ref.max() - ref.min()).item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-3 * spread, f"{name} {fmt} {regime}: max |diff| {err:.2e} vs logit range {spread:.2e}"
    print(f"{name} {fmt} {regime}: max |diff| {err:.2e}, logit range {spread:.2f}")
    got = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    assert got == _reference_greedy(model, prompt, 32), f"{name} {fmt} {regime}"


def _reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():  # EOS neither stops nor is forbidden (min_new_tokens would forbid it), as ignore_eos
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def test_a_batch_with_chunked_prefills_rotates_each_sequence_as_alone(tmp_path, tokenizer):
    """The factor set is the engine's, not the step's: three prompts past the switch, prefilled in 16-token chunks
    beside each other's decodes, each give transformers' tokens for that prompt alone."""
    model = build_hf_model("phi4-mini")
    llm = LLM(model=save_hf_folder(model, tmp_path / "hf", tokenizer), weights="fp32", kv_cache="fp32",
              kv_cache_gb=0.02, max_num_batched_tokens=16, show_progress=False)
    prompts = [LONG_IDS, LONG_IDS[3:] + LONG_IDS[:6], LONG_IDS[::-1] + [9, 9]]  # 48, 51 and 50 tokens
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _reference_greedy(model, prompt, 16)


@pytest.mark.parametrize("name", sorted(LONG_ROPE_ARCHS))
def test_the_two_factor_sets_give_different_logits(name):
    """The comparisons above tell short from long factors: transformers' own logits over the same first
    ORIGINAL_CTX tokens, computed with each set, differ by far more than the tolerance."""
    model = build_hf_model(name)
    short = _reference_logits(model, LONG_IDS[:ORIGINAL_CTX])  # ORIGINAL_CTX tokens: the short factors
    long = _reference_logits(model, LONG_IDS)[:ORIGINAL_CTX]  # one token more: the long ones
    spread = (short.max() - short.min()).item()
    assert (short - long).abs().max().item() > 50 * 1e-3 * spread


@pytest.mark.parametrize("kernel", ["ops", "torch"])
@pytest.mark.parametrize("max_len", [ORIGINAL_CTX, ORIGINAL_CTX + 24])
def test_partial_rotary_rotates_the_first_dims_only_as_transformers_does(tmp_path, tokenizer, max_len, kernel):
    """Phi-4-mini's RoPE on q and k of every position < max_len: the engine's tables, head order and rotation (the
    op the model calls, C++ where built; models/rope.py apply_rope) against transformers' Phi3RotaryEmbedding and
    apply_rotary_pos_emb. A rotation over all dims would move the last quarter, which transformers leaves alone."""
    model = build_hf_model("phi4-mini")
    args = load_checkpoint(save_hf_folder(model, tmp_path / "hf", tokenizer), show_progress=False).args
    d, r, hkv = args.head_dim, args.rotary_dim, args.n_kv_heads
    assert r == int(d * 0.75) < d
    torch.manual_seed(1)
    q, k, v = torch.randn(max_len, HEADS, d), torch.randn(max_len, hkv, d), torch.randn(max_len, hkv, d)
    positions = torch.arange(max_len)
    with torch.no_grad():  # transformers picks the factors by max(position) + 1 = max_len, as the engine by max_len
        cos, sin = model.model.rotary_emb(q, positions[None])
        q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ref, k_ref = q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)  # [N, heads, D]
    assert torch.equal(q_ref[..., r:], q[..., r:]) and not torch.allclose(q_ref[..., :r], q[..., :r])
    order = rotary_order(d, r)
    cos_t, sin_t = (t.unsqueeze(1) for t in rope_tables(args, max_len, torch.float32))  # [N, 1, D]
    qkv = torch.cat([q[..., order], k[..., order], v], dim=1)  # [N, H + 2 Hkv, D], the builder's head order
    if kernel == "ops":
        pool = LayerKV(torch.zeros(1, max_len, 2 * hkv, d), None)
        ops.rope_write_kv(qkv, cos_t, sin_t, HEADS, pool, positions)
    else:
        qkv[:, : HEADS + hkv] = apply_rope(qkv[:, : HEADS + hkv], cos_t, sin_t)
    back = torch.argsort(order)
    torch.testing.assert_close(qkv[:, :HEADS][..., back], q_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(qkv[:, HEADS:HEADS + hkv][..., back], k_ref, rtol=0, atol=1e-5)
    assert torch.equal(qkv[:, HEADS + hkv:], v)


def test_a_published_config_reads_as_transformers_reads_it(tmp_path):
    """Phi-4-mini's config.json as Microsoft ships it (rope_scaling "longrope", top-level rope_theta,
    partial_rotary_factor and original_max_position_embeddings, no factor): our fields against transformers' parse."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    pairs = 48
    config = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 24,
              "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 8192, "vocab_size": 200064,
              "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
              "partial_rotary_factor": 0.75, "sliding_window": 262144, "tie_word_embeddings": True,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 100 for i in range(pairs)],
                               "long_factor": [1.0 + i for i in range(pairs)]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from cpuserve.engine.loader.safetensors import build_model_args

    args = build_model_args(config, str(tmp_path))
    ref = Phi3Config.from_pretrained(str(tmp_path))
    rope = Phi3RotaryEmbedding(ref)
    params = ref.rope_parameters
    assert args.rotary_dim == int(ref.hidden_size // ref.num_attention_heads * params["partial_rotary_factor"]) == 96
    assert args.long_rope.short_factor == tuple(params["short_factor"])
    assert args.long_rope.long_factor == tuple(params["long_factor"])
    assert args.long_rope.original_max_position_embeddings == params["original_max_position_embeddings"]
    assert args.long_rope.attention_factor == pytest.approx(rope.attention_scaling, rel=1e-12)
    assert args.rope_theta == params["rope_theta"] and args.tie_embeddings and args.vocab_size == 200064


@pytest.mark.parametrize("config,message", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 16}},
     r"config.json: rope_scaling short_factor must list 16 numbers \(one per rotary pair of rotary_dim=32\)"),
    ({"partial_rotary_factor": 0.8},  # 25.6 dims: 25, an odd count
     r"config.json: partial_rotary_factor=0.8 rotates 25 of head_dim=32 dims; it must give an even number"),
])
def test_phi3_configs_the_engine_cannot_run_are_refused(tmp_path, config, message):
    full = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 128, "num_attention_heads": 4,
            "max_position_embeddings": 256, **config}
    (tmp_path / "config.json").write_text(json.dumps(full))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("arch,tensors,rope_dims,message", [
    ("llama", ["rope_factors_long.weight", "rope_factors_short.weight"], None,
     r"m.gguf: rope_factors_long/short \(LongRoPE\) in a 'llama' file are not supported; supported: LongRoPE in phi3"),
    ("llama", [], 24, r"m.gguf: llama.rope.dimension_count=24 rotates part of each head \(head_dim=32\); supported: "
                      r"32 \(partial rotary heads: phi3 only\)"),
    ("phi3", ["rope_factors_long.weight"], None,
     r"m.gguf: LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight; the file has only "
     r"rope_factors_long.weight"),
    ("phi3", ["rope_factors_long.weight", "rope_factors_short.weight"], None,  # no original context length
     r"m.gguf: phi3.rope.scaling.original_context_length is missing; LongRoPE"),
    ("phi3", [], 33, r"m.gguf: phi3.rope.dimension_count=33; it must be even and in \(0, head_dim=32\]"),
])
def test_gguf_rope_the_engine_cannot_run_is_refused(tmp_path, arch, tensors, rope_dims, message):
    shape = gf.Shape(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=256, ctx=CTX)
    factors = {name: (torch.ones(16).numpy(), gguf.GGMLQuantizationType.F32) for name in tensors}
    gf.write_llama_gguf(tmp_path / "m.gguf", {}, shape, arch=arch, raw_tensors=factors, rope_dims=rope_dims)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(tmp_path / "m.gguf"))
