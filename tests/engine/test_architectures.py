"""Every supported architecture, from a GGUF file and from a safetensors folder, against Hugging Face transformers
running the very model both were written from (tiny random weights built from a config: arch_factory.py)."""
from __future__ import annotations

import pytest
import torch
from arch_factory import ARCHS, build_hf_model, save_hf_folder, tiny_tokenizer, write_gguf

from cpuserve.engine.llm import LLM
from cpuserve.engine.sampling_params import SamplingParams

IDS = [5, 17, 99, 3, 250, 42, 42, 7, 130, 64, 8, 200, 11, 77, 150, 23, 5, 90, 31, 260]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _fp32_engine(path: str) -> LLM:
    return LLM(model=path, weights="fp32", kv_cache="fp32", kv_cache_gb=0.02, show_progress=False)


@pytest.mark.parametrize("name", sorted(ARCHS))
@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, tokenizer, name, fmt):
    model = build_hf_model(name)
    path = write_gguf(model, tmp_path / "m.gguf", name) if fmt == "gguf" else \
        save_hf_folder(model, tmp_path / "hf", tokenizer)
    llm = _fp32_engine(path)
    ours = llm.engine.score(IDS)  # [L, V]
    with torch.inference_mode():
        ref = model(torch.tensor([IDS])).logits[0].float()
    spread = (ref.max() - ref.min()).item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-3 * spread, f"{name} {fmt}: max |diff| {err:.2e} vs logit range {spread:.2e}"
    got = llm.generate([IDS[:6]], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        want = model.generate(torch.tensor([IDS[:6]]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert got == want[0, 6:].tolist(), f"{name} {fmt}"


@pytest.mark.parametrize("config,message", [
    ({"architectures": ["Gemma3ForConditionalGeneration"]},  # Gemma 3 4B+ with its vision tower (text: ForCausalLM)
     r"config.json: architectures=\['Gemma3ForConditionalGeneration'\] is not supported; supported: "
     r"\['Gemma3ForCausalLM', 'LlamaForCausalLM', 'MistralForCausalLM', 'MixtralForCausalLM', 'Phi3ForCausalLM', "
     r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\]"),
    ({"architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5},  # Phi-4-mini's, on another model
     r"config.json: partial_rotary_factor=0.5 is not supported for LlamaForCausalLM; supported: 1.0 \(partial rotary "
     r"heads: Phi3ForCausalLM only\)"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "longrope"}},  # Phi-3 128k's, likewise
     r"config.json: rope type 'longrope' is not supported; supported: default, llama3 \(longrope: Phi3ForCausalLM "
     r"only\)"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"config.json: rope type 'dynamic' is not supported; supported: default, llama3, longrope"),
])
def test_unsupported_models_are_refused_by_name(tmp_path, config, message):
    import json

    from cpuserve.engine.loader import load_checkpoint

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, **config}))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(tmp_path))
