"""GPTQ, AWQ and compressed-tensors safetensors folders of tiny transformers models (quant_factory.py; and one AutoAWQ
made itself, tests/engine/data/autoawq-g64): the loader's
codes and scales are the checkpoint's own weights bit for bit (GPTQ / AWQ: against each format's documented
dequantization; compressed-tensors: against the library's own decompression inside transformers); the fp32 engine
matches transformers running those weights (logits within the dense tests' bound, 32 greedy tokens); the default
engine keeps the codes on the int8-activation kernels."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from arch_factory import build_hf_model, save_hf_folder, tiny_tokenizer
from quant_factory import (decompressed_by_transformers, dequantized_model, write_awq, write_compressed_tensors,
                           write_gptq)

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear.act_int8 import W4A8Linear, W8A8Linear
from cpuserve.engine.layers.linear.coded import CodedWeight, concat_rows
from cpuserve.engine.layers.linear.permuted import PermutedLinear
from cpuserve.engine.llm import LLM
from cpuserve.engine.loader import load_checkpoint
from cpuserve.engine.loader.gptq import GptqFormat
from cpuserve.engine.loader.int_codes import group_order
from cpuserve.engine.sampling_params import SamplingParams

IDS = [5, 17, 99, 3, 250, 42, 42, 7, 130, 64, 8, 200, 11, 77, 150, 23, 5, 90, 31, 260]
W8A8_ACTS = dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
CASES = {
    # name: (architecture, writer, options, the default engine's layer class)
    "gptq-g128-sym": ("llama3", "gptq", dict(group=128, sym=True), W4A8Linear),
    "gptq-g32-asym-act-order": ("llama3", "gptq", dict(group=32, sym=False, act_order=True), W4A8Linear),
    "gptq-v2-g64-sym-act-order": ("mistral", "gptq", dict(group=64, sym=True, act_order=True, v1=False), W4A8Linear),
    "gptq-8bit-g32-asym": ("llama3", "gptq", dict(group=32, sym=False, bits=8), W8A8Linear),
    "awq-g64": ("qwen2", "awq", dict(group=64), W4A8Linear),
    "awq-g128": ("llama3", "awq", dict(group=128), W4A8Linear),
    "ct-w4a16-asym-g32": ("llama3", "ct", (dict(num_bits=4, type="int", strategy="group", group_size=32,
                                                symmetric=False), "pack-quantized", None), W4A8Linear),
    "ct-w4a16-sym-g128": ("qwen2", "ct", (dict(num_bits=4, type="int", strategy="group", group_size=128,
                                               symmetric=True), "pack-quantized", None), W4A8Linear),
    "ct-w8a8-channel": ("mistral", "ct", (dict(num_bits=8, type="int", strategy="channel", symmetric=True),
                                          "int-quantized", W8A8_ACTS), W8A8Linear),
}

# the fp32 engine against transformers, 32 greedy tokens: one case per format and scheme family (the others differ
# only in what the codes test above holds exactly)
END_TO_END = ("gptq-g128-sym", "gptq-g32-asym-act-order", "awq-g64", "ct-w4a16-asym-g32", "ct-w8a8-channel")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory, tokenizer):
    """(case, folder, the reference transformers model with the checkpoint's own weights)."""
    arch, kind, opts, _ = CASES[request.param]
    model = build_hf_model(arch)
    folder = tmp_path_factory.mktemp(request.param)
    if kind == "ct":
        path = write_compressed_tensors(copy.deepcopy(model), folder, tokenizer, *opts)
        return request.param, path, decompressed_by_transformers(path)
    path, ref = (write_gptq if kind == "gptq" else write_awq)(model, folder, tokenizer, **opts)
    return request.param, path, dequantized_model(model, ref)


def test_codes_and_scales_are_the_checkpoints_own_weights(checkpoint):
    case, path, ref = checkpoint
    coded = {name: w for name, w in load_checkpoint(path, show_progress=False).iter_native_weights()
             if isinstance(w, CodedWeight)}
    assert len(coded) == 7 * ref.config.num_hidden_layers  # every projection kept as codes
    for name, w in coded.items():
        assert torch.equal(w.dequantize(), ref.get_parameter(name).detach()), f"{case}: {name}"
    act_order = "act-order" in case
    assert all((w.perm is not None) == act_order for w in coded.values())


def _logits_err(llm: LLM, ref) -> tuple[float, float]:
    with torch.inference_mode():
        want = ref(torch.tensor([IDS])).logits[0].float()
    return (llm.engine.score(IDS) - want).abs().max().item(), (want.max() - want.min()).item()


@pytest.mark.parametrize("checkpoint", END_TO_END, indirect=True)
def test_fp32_engine_matches_transformers_on_the_checkpoints_weights(checkpoint):
    case, path, ref = checkpoint
    llm = LLM(model=path, weights="fp32", kv_cache="fp32", kv_cache_gb=0.02, show_progress=False)
    err, spread = _logits_err(llm, ref)
    assert err <= 1e-3 * spread, f"{case}: max |diff| {err:.2e} vs logit range {spread:.2e}"
    got = llm.generate([IDS[:6]], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        want = ref.generate(torch.tensor([IDS[:6]]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert got == want[0, 6:].tolist(), case


@pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="the int8-activation kernels are not built")
def test_default_engine_keeps_the_checkpoints_codes(checkpoint):
    case, path, ref = checkpoint
    llm = LLM(model=path, kv_cache_gb=0.02, show_progress=False)  # int4 weights, int8 activations
    layer = llm.engine.runner.model.layers[0]
    for linear in (layer.attention.qkv, layer.attention.o_proj, layer.mlp.gate_up, layer.mlp.down):
        inner = linear.inner if isinstance(linear, PermutedLinear) else linear
        assert isinstance(linear, PermutedLinear) == ("act-order" in case), case
        assert isinstance(inner, CASES[case][3]) and inner.group_size == _group(case, inner), (case, inner)
    # the kernel's weights are the file's: exact for symmetric codes (scale and zero kept); with zero points, the
    # offset -z * scale in fp16 (within 2**-11 of it)
    for linear, name in ((layer.attention.o_proj, "self_attn.o_proj"), (layer.mlp.down, "mlp.down_proj")):
        w, want = linear.dequantize(), ref.get_parameter(f"model.layers.0.{name}.weight").detach()
        if _symmetric(case):
            assert torch.equal(w, want), (case, name)
        else:
            assert (w - want).abs().max() <= want.abs().max() * 2 ** -10, (case, name)
    err, spread = _logits_err(llm, ref)  # what remains is the int8 activations and the int8 KV cache
    assert err <= 0.03 * spread, f"{case}: max |diff| {err:.2e} vs logit range {spread:.2e}"


def _symmetric(case: str) -> bool:
    opts = CASES[case][2]
    return opts[0]["symmetric"] if CASES[case][1] == "ct" else opts.get("sym", False)


def _group(case: str, linear) -> int:
    opts = CASES[case][2]
    if CASES[case][1] != "ct":
        return opts["group"]
    return opts[0].get("group_size") or linear.in_features  # channel: one group of K


# -- refused by name -------------------------------------------------------------------------------------------------

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}
SUPPORTED = r"supported: \['gptq', 'awq', 'compressed-tensors'\]"


def _ct(**weights):
    return {**CT_W4A16, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        **CT_W4A16["config_groups"]["group_0"]["weights"], **weights}}}}


@pytest.mark.parametrize("qconfig,message", [
    *[({"quant_method": m}, rf"quant_method='{m}' is not supported; {SUPPORTED}")
      for m in ("bitsandbytes", "fp8", "hqq", "eetq", "exl2", "marlin", "torchao", "aqlm", "quanto", "mxfp4")],
    ({**GPTQ, "bits": 3}, r"GPTQ bits=3 is not supported; supported: \[4, 8\]"),
    ({**GPTQ, "bits": 2}, r"GPTQ bits=2 is not supported; supported: \[4, 8\]"),
    ({**GPTQ, "checkpoint_format": "marlin"}, r"GPTQ checkpoint_format='marlin' is not supported; supported: "
                                              r"\['gptq', 'gptq_v2'\]"),
    ({**GPTQ, "is_marlin_format": True}, r"GPTQ checkpoint_format='marlin' is not supported"),
    ({**GPTQ, "pack_dtype": "int16"}, r"GPTQ pack_dtype='int16' is not supported; supported: 'int32'"),
    ({**GPTQ, "dynamic": {"re:.*down.*": {"bits": 8}}}, r"GPTQ dynamic \(per-module bits / group sizes\) is not "
                                                          r"supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     r"AWQ version='gemv' is not supported; supported: \['gemm'\]"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, r"AWQ version='exllama'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"AWQ bits=8 is not supported; supported: \[4\]"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
     r"AWQ zero_point=false is not supported"),
    ({**CT_W4A16, "format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "tensor"}}}},
     r"config_groups.g: format='float-quantized' is not supported; supported: \['pack-quantized', 'int-quantized', "
     r"'naive-quantized'\]"),
    ({**CT_W4A16, "format": "nvfp4-pack-quantized"}, r"format='nvfp4-pack-quantized' is not supported"),
    (_ct(type="float"), r"weights: type='float' is not supported; supported: 'int'"),
    (_ct(num_bits=2), r"weights: num_bits=2 is not supported; supported: \[4, 8\]"),
    (_ct(num_bits=3), r"weights: num_bits=3 is not supported"),
    (_ct(strategy="tensor"), r"weights: strategy='tensor' is not supported; supported: \['group', 'channel'\]"),
    (_ct(strategy="block"), r"weights: strategy='block' is not supported"),
    ({**CT_W4A16, "config_groups": {"g": {**CT_W4A16["config_groups"]["group_0"], "input_activations": {
        "num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}}},
     r"input_activations: .* is not supported; supported: none, or int8 symmetric dynamic per token \(W8A8\)"),
    ({**CT_W4A16, "sparsity_config": {"format": "sparse-24-bitmask"}}, r"sparsity_config is not supported"),
    ({**CT_W4A16, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, r"kv_cache_scheme is not supported"),
    ({**CT_W4A16, "transform_config": {"config_groups": {"u": {}}}}, r"transform_config is not supported"),
    ({**CT_W4A16, "quantization_status": "frozen"}, r"quantization_status='frozen' is not supported; supported: "
                                                    r"'compressed'"),
])
def test_other_quantization_methods_and_options_are_refused_by_name(tmp_path, tokenizer, qconfig, message):
    folder = tmp_path / "m"
    save_hf_folder(build_hf_model("llama3"), folder, tokenizer)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    with pytest.raises(ValueError, match=r"config.json: quantization_config.*" + message):
        load_checkpoint(str(folder), show_progress=False)


def test_gptq_v1_zeros_undo_the_borrow_of_a_zero_point_of_zero():
    # v1 files store each word of zeros minus 0x11111111: a zero of 0 borrows from the next field's
    zeros = torch.tensor([[0, 15, 0, 0, 7, 1, 0, 15]], dtype=torch.int64)  # [G=1, N=8]
    word = sum(int(z) << (4 * i) for i, z in enumerate(zeros[0]))
    stored = (word - 0x11111111) % 2 ** 32
    t = {"qweight": torch.zeros(2, 8, dtype=torch.int32),  # K = 16, all codes 0: w = -z * s
         "qzeros": torch.from_numpy(np.array([[stored]], dtype=np.uint32).view(np.int32)),
         "scales": torch.ones(1, 8, dtype=torch.float16)}
    w = GptqFormat(bits=4, group_size=16, v1_zeros=True).decode("m", t).dequantize()
    assert torch.equal(w, -zeros.t().float().expand(8, 16))


def test_act_order_that_cannot_be_kept_exactly_is_refused():
    with pytest.raises(ValueError, match="g_idx does not put exactly 32 inputs in each of 2 groups"):
        group_order(torch.tensor([0] * 40 + [1] * 24), 64, 32, "m")
    assert group_order(torch.arange(64) // 32, 64, 32, "m") is None  # static groups: nothing to gather
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    part = lambda perm: CodedWeight(codes, torch.ones(16, 2), torch.zeros(16, 2), 32, 4, "GPTQ-4", perm=perm)  # noqa
    with pytest.raises(ValueError, match=r"order their inputs differently"):
        concat_rows([part(torch.randperm(64)), part(torch.randperm(64))])
    with pytest.raises(ValueError, match="cannot be cut along its inputs"):
        part(torch.randperm(64)).slice_with(lambda t: t[:, :32])


# -- a checkpoint made by AutoAWQ's own quantizer (tests/engine/data/make_autoawq_fixture.py) ------------------------

AUTOAWQ = Path(__file__).parent / "data" / "autoawq-g64"


def test_autoawq_checkpoint_matches_autoawqs_own_dequantization():
    digests = json.loads((AUTOAWQ / "autoawq_dequantized_fp16.sha256.json").read_text())
    weights = dict(load_checkpoint(str(AUTOAWQ), show_progress=False).iter_native_weights())
    coded = {n: w.dequantize() for n, w in weights.items() if isinstance(w, CodedWeight)}
    assert sorted(coded) == sorted(digests)
    for name, w in coded.items():  # AutoAWQ dequantizes in fp16: the exact weights rounded once to fp16
        assert hashlib.sha256(w.half().numpy().tobytes()).hexdigest() == digests[name], name
    # transformers on AutoAWQ's own fp16 weights (the digests' bytes), against the fp32 engine on the exact ones
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((AUTOAWQ / "config.json").read_text())
    config.pop("quantization_config")
    ref = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    ref.load_state_dict({**weights, **{n: w.half().float() for n, w in coded.items()}}, strict=True)
    llm = LLM(model=str(AUTOAWQ), weights="fp32", kv_cache="fp32", kv_cache_gb=0.02, show_progress=False)
    err, spread = _logits_err(llm, ref)
    assert err <= 1e-3 * spread, f"max |diff| {err:.2e} vs logit range {spread:.2e}"
