"""Gemma 3 (text) from a GGUF file and from a safetensors folder against Hugging Face transformers running the very
model both were written from (gemma3_factory.py: 7 layers, 5 local + 1 global + 1 local, window 16 tokens).

Prompts of 40 tokens and 32 generated ones: prefill and decode both run well past the window."""
from __future__ import annotations

import pytest
import torch
from gemma3_factory import (CHAT_TEMPLATE, QT, WINDOW, build_gemma3, dequantized_copy, save_gemma3_folder,
                            write_gemma3_gguf)

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.act_int8 import W4A8Linear
from cpuserve.engine.llm import LLM
from cpuserve.engine.loader import load_checkpoint
from cpuserve.engine.sampling_params import SamplingParams

PROMPT = [(7 * i + 3) % 280 + 1 for i in range(40)]  # 40 tokens = 2.5 windows, ids of the tiny vocabulary
assert len(PROMPT) >= 2 * WINDOW
LONG = [(11 * i + 5) % 280 + 1 for i in range(340)]  # 21 windows; its last 64-token chunk starts past key 256


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{format: (transformers model, path)}: the GGUF's queries scaled by head_dim ** -0.5 as llama.cpp fixes it,
    the folder's by query_pre_attn_scalar = 24 from its config."""
    tmp = tmp_path_factory.mktemp("gemma3")
    gguf_model = build_gemma3()
    gguf_path = write_gemma3_gguf(gguf_model, tmp / "m.gguf")
    hf_model = build_gemma3(query_pre_attn_scalar=24, seed=1)
    tokenizer = load_checkpoint(gguf_path, show_progress=False).tokenizer
    return {"gguf": (gguf_model, gguf_path), "safetensors": (hf_model, save_gemma3_folder(hf_model, tmp / "hf", tokenizer))}


def _engine(path: str, **kw) -> LLM:
    return LLM(model=path, **{"weights": "fp32", "kv_cache": "fp32", "kv_cache_gb": 0.02, "show_progress": False, **kw})


def _reference_greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _check_logits(llm: LLM, model, tol: float, prompt: list[int] = PROMPT) -> None:
    ours = llm.engine.score(prompt)  # [L, V]
    with torch.inference_mode():
        ref = model(torch.tensor([prompt])).logits[0].float()
    spread = (ref.max() - ref.min()).item()
    err = (ours - ref).abs().max().item()
    assert err <= tol * spread, f"max |diff| {err:.2e} vs logit range {spread:.2e}"


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_logits_and_greedy_tokens_match_transformers(models, fmt):
    model, path = models[fmt]
    llm = _engine(path)
    _check_logits(llm, model, 1e-3)
    got = llm.generate([PROMPT], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    assert got == _reference_greedy(model, PROMPT)


def test_window_changes_the_result(models):
    """The reference itself: without its window the same model gives other logits past the window (so the test
    above could not pass with the window ignored)."""
    model, _ = models["gguf"]
    with torch.inference_mode():
        windowed = model(torch.tensor([PROMPT])).logits[0]
        model.config.sliding_window = 10_000
        try:
            full = model(torch.tensor([PROMPT])).logits[0]
        finally:
            model.config.sliding_window = WINDOW
    assert torch.allclose(windowed[:WINDOW], full[:WINDOW], atol=1e-5)
    assert (windowed[WINDOW:] - full[WINDOW:]).abs().max() > 1e-2


def test_decode_batch_of_mixed_lengths_and_chunked_prefill(models):
    """Sequences shorter than, across and far past the window decode together, prefilled in chunks of 64 tokens
    over blocks of 4, with prefix-cache hits (shared prefixes). The 340-token prompt's last chunk starts at 320:
    its local layers read the context from key 256 on (the aligned start of its window)."""
    model, path = models["gguf"]
    llm = _engine(path, max_num_batched_tokens=64, block_size=4, max_num_seqs=4)
    prompts = [PROMPT[:5], PROMPT, PROMPT[:23], LONG]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _reference_greedy(model, prompt), f"prompt of {len(prompt)} tokens"


def test_plain_torch_path_matches_transformers(models, monkeypatch):
    """The reference attention (CPUSERVE_KERNELS=torch): windowed decode mask, SlimAttention in torch."""
    monkeypatch.setattr(native, "enabled", lambda: False)
    monkeypatch.setattr(native, "slim_attention_native_enabled", lambda: False)
    monkeypatch.setattr(native, "slim_attention_fp32_enabled", lambda: False)
    model, path = models["gguf"]
    llm = _engine(path)
    _check_logits(llm, model, 1e-3)
    got = llm.generate([PROMPT[:30]], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    assert got == _reference_greedy(model, PROMPT[:30])


def test_bf16_engine_stays_close(models):
    """bf16 activations and an int8 KV pool: the C++ SlimAttention with the window, whole and (340 tokens in chunks
    of 64) with the local layers' context cut at key 256."""
    model, path = models["gguf"]
    _check_logits(_engine(path, weights="bf16", kv_cache="int8", max_num_batched_tokens=64), model, 3e-2, LONG)
    _check_logits(_engine(path, weights="bf16", kv_cache="int8"), model, 3e-2)


@pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="the int8-activation kernels are not built")
def test_q4_0_file_on_the_default_engine(models, tmp_path):
    """A Q4_0 file on the engine's defaults (its int4 codes kept, int8 activations, int8 KV) against transformers
    running gguf's dequantization of the same blocks."""
    model = models["gguf"][0]
    path = write_gemma3_gguf(model, tmp_path / "q4_0.gguf", qtype=QT.Q4_0)
    llm = LLM(model=path, kv_cache_gb=0.02, show_progress=False)
    block = llm.engine.runner.model.layers[0]
    assert isinstance(block.attention.qkv, W4A8Linear) and isinstance(block.mlp.down, W4A8Linear)
    # int8 activations and int8 KV on 4-bit codes: 2.79% of the logit range at the avx512_bf16 level and 3.02% at
    # the others (their attention's portable path) on an AMD EPYC Zen 5, under 3% on Zen 4 and the Xeon
    _check_logits(llm, dequantized_copy(model, QT.Q4_0), 3.5e-2)


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_chat_template_and_turn_tokens_come_from_the_file(models, fmt):
    tok = load_checkpoint(models[fmt][1], show_progress=False).tokenizer
    end_of_turn = tok.backend.token_to_id("<end_of_turn>")
    assert tok.chat_template == CHAT_TEMPLATE
    assert end_of_turn in tok.eos_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    ids = tok.encode(text)
    assert ids.count(tok.backend.token_to_id("<start_of_turn>")) == 2 and end_of_turn in ids


@pytest.mark.parametrize("config,message", [
    ({"final_logit_softcapping": 30.0},
     r"config.json: final_logit_softcapping=30.0 is not supported; supported: null \(Gemma 3 has none\)"),
    ({"attn_logit_softcapping": 50.0},
     r"config.json: attn_logit_softcapping=50.0 is not supported; supported: null \(Gemma 3 has none\)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"config.json: rope type 'yarn' of the full-attention layers is not supported; supported: default, linear"),
    ({"hidden_activation": "silu"},
     r"config.json: hidden_activation='silu' is not supported; supported: 'gelu_pytorch_tanh'"),
    ({"use_bidirectional_attention": True},
     r"config.json: use_bidirectional_attention=true is not supported; supported: false \(causal\)"),
])
def test_unsupported_gemma3_configs_are_refused_by_name(tmp_path, config, message):
    import json

    base = {"architectures": ["Gemma3ForCausalLM"], "num_attention_heads": 4, "num_hidden_layers": 2,
            "hidden_size": 64, "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(tmp_path))


def test_gguf_softcapping_and_replica_groups_are_refused(models, tmp_path):
    path = write_gemma3_gguf(models["gguf"][0], tmp_path / "capped.gguf", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match=r"capped.gguf: final_logit_softcapping=30.0 is not supported; supported: "
                                         r"null \(Gemma 3 has none\)"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match=r"ranks=2: replica groups do not run gemma3 models yet; use ranks=1"):
        _engine(models["gguf"][1], ranks=2)


def test_older_config_format_reads_as_transformers_reads_it(tmp_path):
    """A config.json as Gemma 3 1B was published (sliding_window_pattern, rope_theta, rope_local_base_freq,
    rope_scaling): our fields against transformers' own parse of the same keys."""
    import json

    import transformers

    from cpuserve.engine.loader.safetensors import build_model_args

    old = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "vocab_size": 300,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 8,
           "max_position_embeddings": 512, "query_pre_attn_scalar": 20, "sliding_window": 24,
           "sliding_window_pattern": 4, "rope_theta": 500000.0, "rope_local_base_freq": 5000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    ref = transformers.AutoConfig.from_pretrained(str(tmp_path))
    args = build_model_args(old, str(tmp_path))
    assert args.sliding_window.layers == tuple(t == "sliding_attention" for t in ref.layer_types)
    assert args.sliding_window.size == ref.sliding_window
    assert args.sliding_window.rope_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert args.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    assert args.rope_linear_factor == ref.rope_parameters["full_attention"]["factor"]
    assert args.attn_scale == ref.query_pre_attn_scalar ** -0.5
