"""GPTQ and AWQ checkpoints of a tiny transformers Llama, written by hand from each format's documented layout (their
quantizers do not install here: GPTQModel needs a newer torch, AutoAWQ and AutoGPTQ need CUDA builds), and each
format's documented dequantization, written apart from the loader's (per element, from the raw words), as the
reference.

    folder, ref = write_gptq(model, tmp / "gptq", tokenizer, group=32, sym=False, act_order=True)
    ref["model.layers.0.self_attn.q_proj.weight"]   # fp32 [N, K]: the checkpoint's own weights

Quantization is round-to-nearest with GPTQ's grid (its quantizer's scale and zero rules); what a checkpoint holds,
not how well it was made, is what the loader reads. act_order: each weight's inputs are visited in a random order
(the same for q, k, v and for gate, up, which share their inputs, as GPTQ's Hessian order is), so g_idx scatters
every group over the inputs.
"""
from __future__ import annotations

import json

import numpy as np
import torch
from arch_factory import save_hf_folder
from safetensors.torch import load_file, save_file

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
SHARED_INPUTS = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
                 "mlp.up_proj": "mlp.gate_proj"}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # field i of a word holds output 8c + AWQ_ORDER[i]


def rtn(w: torch.Tensor, group: int, bits: int, sym: bool, order: torch.Tensor | None = None):
    """GPTQ's grid on w [N, K]: groups of `group` inputs taken in `order` -> q [N, K] (input order), scales fp16
    [N, G], zeros [N, G] ints, g_idx [K] (the group of each input)."""
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    wg = w[:, order].double().reshape(n, k // group, group)
    maxq = 2 ** bits - 1
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-5).half()
    zero = torch.full_like(lo, (maxq + 1) // 2) if sym else torch.round(-lo / scale.double()).clamp(0, maxq)
    q = torch.clamp(torch.round(wg / scale.double()[..., None]) + zero[..., None], 0, maxq).reshape(n, k)
    q_in_order = torch.empty_like(q).index_copy_(1, order, q)
    return q_in_order.to(torch.int64), scale, zero.to(torch.int64), g_idx


def _pack(values: np.ndarray, bits: int, fields: list[int] | None = None) -> np.ndarray:
    """values [R, C] (C a multiple of 32 // bits) -> uint32 [R, C * bits / 32]: field i of word c holds
    value c * P + fields[i] (fields: identity unless given)."""
    per = 32 // bits
    fields = fields or list(range(per))
    v = values.astype(np.uint64).reshape(values.shape[0], -1, per)
    words = np.zeros(v.shape[:2], dtype=np.uint64)
    for i, pos in enumerate(fields):
        words |= v[:, :, pos] << np.uint64(bits * i)
    return words.astype(np.uint32)


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.view(np.int32).copy())


def gptq_tensors(q, scale, zero, g_idx, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQModel's layout: qweight [K / P, N] packed along K, qzeros [G, N / P] along N (v1: each word minus
    0x11..1, modulo 2**32), scales [G, N] fp16, g_idx [K] int32."""
    qweight = _pack(q.numpy(), bits).T  # [N, K] packed along K, then [K / P, N]
    zwords = _pack(zero.t().contiguous().numpy(), bits)  # [G, N / P]
    if v1:
        one_each = sum(1 << (bits * i) for i in range(32 // bits))
        zwords = ((zwords.astype(np.int64) - one_each) % 2 ** 32).astype(np.uint32)
    return {"qweight": _int32(np.ascontiguousarray(qweight)), "qzeros": _int32(zwords),
            "scales": scale.t().contiguous(), "g_idx": g_idx}


def awq_tensors(q, scale, zero) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [K, N / 8], qzeros [G, N / 8], both interleaved (AWQ_ORDER), scales [G, N]."""
    return {"qweight": _int32(_pack(q.t().contiguous().numpy(), 4, AWQ_ORDER)),
            "qzeros": _int32(_pack(zero.t().contiguous().numpy(), 4, AWQ_ORDER)),
            "scales": scale.t().contiguous()}


def _field(word: int, bits: int, i: int) -> int:
    return (word >> (bits * i)) & (2 ** bits - 1)


def gptq_reference(t: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """GPTQ's dequantization, element by element: w[n, k] = scales[g, n] * (q - z), g = g_idx[k], q in word
    [k // P, n] at bits B (k % P), z in word [g, n // P] at bits B (n % P) (v1: the word plus 0x11..1)."""
    per = 32 // bits
    qw = t["qweight"].numpy().view(np.uint32).astype(np.int64)
    qz = t["qzeros"].numpy().view(np.uint32).astype(np.int64)
    if v1:
        qz = (qz + sum(1 << (bits * i) for i in range(per))) % 2 ** 32
    scales, g_idx = t["scales"].double().numpy(), t["g_idx"].numpy()
    k, n = qw.shape[0] * per, qw.shape[1]
    z = np.array([[_field(int(qz[g, nn // per]), bits, nn % per) for nn in range(n)] for g in range(len(qz))])
    w = np.empty((n, k))
    for kk in range(k):
        g = g_idx[kk]
        q = (qw[kk // per] >> (bits * (kk % per))) & (2 ** bits - 1)  # [N]
        w[:, kk] = scales[g] * (q - z[g])
    return torch.from_numpy(w).float()


def awq_reference(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """AWQ's dequantization: output n of input k is field AWQ_ORDER.index(n % 8) of word [k, n // 8]; likewise the
    zero of group k // group; w = scales * (q - z)."""
    qw = t["qweight"].numpy().view(np.uint32).astype(np.int64)
    qz = t["qzeros"].numpy().view(np.uint32).astype(np.int64)
    scales = t["scales"].double().numpy()
    k, n = qw.shape[0], qw.shape[1] * 8
    field_of = [AWQ_ORDER.index(j) for j in range(8)]
    w = np.empty((n, k))
    for nn in range(n):
        c, i = nn // 8, field_of[nn % 8]
        q = (qw[:, c] >> (4 * i)) & 15  # [K]
        z = ((qz[:, c] >> (4 * i)) & 15).repeat(group)  # [K]
        w[nn] = scales[:, nn].repeat(group) * (q - z)
    return torch.from_numpy(w).float()


def _orders(model, act_order: bool, seed: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    orders = {}
    for layer in range(model.config.num_hidden_layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}"
            k = model.get_submodule(name).in_features
            shared = SHARED_INPUTS.get(proj)
            orders[name] = orders[f"model.layers.{layer}.{shared}"] if shared else (
                torch.randperm(k, generator=g) if act_order else None)
    return orders


def _write(model, folder, tokenizer, qconfig: dict, pack) -> tuple[str, dict[str, torch.Tensor]]:
    """The float folder, every projection's weight replaced by pack(name, weight) -> (tensors, reference)."""
    save_hf_folder(model, folder, tokenizer)
    path = folder / "model.safetensors"
    state, ref = load_file(str(path)), {}
    for name in [n.removesuffix(".weight") for n in state if n.endswith("_proj.weight")]:
        tensors, ref[f"{name}.weight"] = pack(name, state.pop(f"{name}.weight"))
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder), ref


def write_gptq(model, folder, tokenizer, group: int = 128, sym: bool = True, act_order: bool = False,
               bits: int = 4, v1: bool = True, seed: int = 0):
    orders = _orders(model, act_order, seed)

    def pack(name, w):
        t = gptq_tensors(*rtn(w, group, bits, sym, orders[name]), bits=bits, v1=v1)
        return t, gptq_reference(t, bits, v1)

    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
               "lm_head": False, "checkpoint_format": "gptq" if v1 else "gptq_v2", "pack_dtype": "int32"}
    return _write(model, folder, tokenizer, qconfig, pack)


def write_awq(model, folder, tokenizer, group: int = 128):
    def pack(name, w):
        q, scale, zero, _ = rtn(w, group, 4, sym=False)
        t = awq_tensors(q, scale, zero)
        return t, awq_reference(t, group)

    qconfig = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
               "modules_to_not_convert": None}
    return _write(model, folder, tokenizer, qconfig, pack)


def dequantized_model(model, ref: dict[str, torch.Tensor]):
    """A copy of the transformers model with the checkpoint's own weights: the reference forward."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in ref.items():
            out.get_parameter(name).copy_(w)
    return out.eval()


def write_compressed_tensors(model, folder, tokenizer, weights: dict, fmt: str, activations: dict | None = None):
    """The model quantized and saved by compressed-tensors itself (the library llm-compressor saves with): its
    min-max scales and zero points (calculate_qparams) per group or channel, rounded to fp16 values as a half-precision
    model's are, its packing (ModelCompressor) and its config.json entry. The model is changed in place (copy it)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    acts = QuantizationArgs(**activations) if activations else None
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach()
            n, k = w.shape
            group = args.group_size if args.strategy == "group" else k
            wg = w.reshape(n, k // group, group)  # wg: [N, G, group]
            scale, zero = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
            module.weight_scale.data.copy_(scale.half().float().reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    save_hf_folder(model, folder, tokenizer)
    compressor.update_config(str(folder))
    return str(folder)


def decompressed_by_transformers(folder):
    """transformers' own load of a compressed-tensors folder, decompressed to float by the library: the reference."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=CompressedTensorsConfig(dequantize=True),
                                                dtype=torch.float32).eval()
