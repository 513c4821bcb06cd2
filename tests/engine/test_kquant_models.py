"""Whole models from K-quant GGUF files, against Hugging Face transformers reading the same file (its own GGUF
dequantization through gguf): a tiny Q4_K_M-style file (Q4_K + Q6_K + F32), and a file of SmolLM2's real shapes
laid out as llama.cpp's quantizer lays out SmolLM2 Q4_K_M (576 columns are no K-quant: Q5_0 / Q8_0 fallbacks)."""
from __future__ import annotations

import collections

import gguf
import pytest
import torch

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.act_int8 import W4A8Linear, W6A8Linear
from cpuserve.engine.layers.linear.stacked import StackedLinear
from cpuserve.engine.llm import LLM
from cpuserve.engine.sampling_params import SamplingParams
from kquant_factory import bench_module, write_q4_k_m

QT = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    types = write_q4_k_m(path)
    assert set(types.values()) == {QT.Q4_K, QT.Q6_K}
    return path


@pytest.fixture(scope="module")
def hf_reference(q4_k_m_file):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(q4_k_m_file.parent), gguf_file=q4_k_m_file.name,
                                                 dtype=torch.float32)
    return model.eval()


def _logits_err(llm: LLM, hf_model, ids: list[int]) -> tuple[float, float]:
    ours = llm.engine.score(ids)  # [L, V]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    return (ours - ref).abs().max().item(), (ref.max() - ref.min()).item()


IDS = list(range(3, 40)) + [120, 7, 250, 31, 99]


def test_q4_k_m_fp32_logits_match_transformers_at_every_position(q4_k_m_file, hf_reference):
    llm = LLM(model=str(q4_k_m_file), weights="fp32", kv_cache="fp32", kv_cache_gb=0.05, show_progress=False)
    err, spread = _logits_err(llm, hf_reference, IDS)
    assert err <= 1e-3 * spread, f"max |diff| {err:.2e} vs logit range {spread:.2e}"
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ours = llm.generate([IDS[:8]], params)[0].token_ids
    with torch.inference_mode():
        ref = hf_reference.generate(torch.tensor([IDS[:8]]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours == ref[0, 8:].tolist()


@pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="the int8-activation kernels are not built")
def test_q4_k_m_default_engine_keeps_the_files_codes(q4_k_m_file, hf_reference):
    llm = LLM(model=str(q4_k_m_file), kv_cache_gb=0.05, show_progress=False)  # int4 weights, int8 activations
    layers = llm.engine.runner.model.layers
    # layer 0: every matrix Q4_K -> int4 codes; layer 1 (v and down in Q6_K): the fused qkv keeps q, k as int4
    # codes in groups of 32 and v as 6-bit codes in groups of 16 (StackedLinear), down Q6_K's own 6-bit codes with
    # only its zero code (symmetric), gate/up stay int4; activations one scale per super-block of 256 inputs
    assert isinstance(layers[0].attention.qkv, W4A8Linear) and layers[0].attention.qkv.group_size == 32
    qkv = layers[1].attention.qkv
    assert isinstance(qkv, StackedLinear) and [(type(p), p.group_size, p.act_group) for p in qkv.parts] == [
        (W4A8Linear, 32, 256), (W6A8Linear, 16, 256)]
    assert isinstance(layers[1].mlp.gate_up, W4A8Linear) and isinstance(layers[1].mlp.down, W6A8Linear)
    assert int(layers[1].mlp.down.zoffs[0]) == 32
    # what remains against fp32 is the int8 activations and the int8 KV cache
    err, spread = _logits_err(llm, hf_reference, IDS)
    assert err <= 0.03 * spread, f"max |diff| {err:.2e} vs logit range {spread:.2e}"


def test_smollm2_shaped_q4_k_m_file_loads_and_generates(tmp_path):
    synthetic = bench_module("synthetic_gguf")
    path = tmp_path / "smollm2-shaped-q4_k_m.gguf"
    synthetic.write_synthetic_llama(path, **synthetic.PRESETS["smollm2-135m"], qtype="Q4_K_M", tie_embeddings=True,
                                    show_progress=False)
    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)
    assert counts == {"Q5_0": 166, "F32": 61, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14}  # llama.cpp's SmolLM2 Q4_K_M
    llm = LLM(model=str(path), kv_cache_gb=0.1, show_progress=False)
    out = llm.generate([llm.tokenizer.encode("Hello")], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and all(0 <= t < 49152 for t in out[0].token_ids)
