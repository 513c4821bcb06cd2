"""Tiny random-weight models of every supported architecture, built by Hugging Face transformers from a config,
saved as a safetensors folder and written as a GGUF the way llama.cpp's converter writes that architecture.

    model = build_hf_model("qwen3")                  # transformers' own model: the reference
    folder = save_hf_folder(model, tmp_path / "hf")  # config.json + model.safetensors + tokenizer files
    path = write_gguf(model, tmp_path / "m.gguf")    # llama.cpp names, metadata and layouts

Mixture-of-experts models (Mixtral, Qwen3-MoE) too: their configs and stacked GGUF experts are moe_factory.py's.
"""
from __future__ import annotations

import json
import math

import gguf
import gguf_factory as gf
import numpy as np
import torch
from moe_factory import MOE_EXTRA, add_moe_metadata, is_expert_state, write_experts

QT = gguf.GGMLQuantizationType
DIM, LAYERS, HEADS, KV_HEADS, FFN, CTX = 128, 2, 4, 2, 256, 256
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # all three bands at head_dim 32
ARCHS = {
    # name: (transformers config class, extra config, GGUF architecture)
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True), "llama"),
    "mistral": ("MistralConfig", dict(sliding_window=None, rope_theta=1e6), "llama"),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), "qwen2"),
    "qwen3": ("Qwen3Config", dict(head_dim=48, tie_word_embeddings=True), "qwen3"),  # H * D != dim
    "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2), "phi3"),
    "mixtral": ("MixtralConfig", MOE_EXTRA["mixtral"], "llama"),  # GGUF: llama with expert_count
    "qwen3moe": ("Qwen3MoeConfig", MOE_EXTRA["qwen3moe"], "qwen3moe"),
    "qwen3moe-raw-topk": ("Qwen3MoeConfig", MOE_EXTRA["qwen3moe-raw-topk"], "qwen3moe"),
}
ORIGINAL_CTX = 40  # LongRoPE's switch point: prompts + 32 generated tokens fit below it, and longer ones above it
# Phi-3 128k and Phi-4-mini at test size: LongRoPE with random factors (one per rotary pair, >= 1 as published ones
# are: short ones near 1, long ones growing to ~CTX / ORIGINAL_CTX and beyond); Phi-4-mini rotates 3/4 of each head
# and ties its embeddings. Not in ARCHS: which factors transformers uses depends on the sequence's length
# (tests/engine/test_phi_rope.py picks lengths where it and the engine agree).
LONG_ROPE_ARCHS = {
    "phi4-mini": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.75,
                                     tie_word_embeddings=True, original_max_position_embeddings=ORIGINAL_CTX), "phi3"),
    "phi3-128k": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     original_max_position_embeddings=ORIGINAL_CTX), "phi3"),
}
SPECS = {**ARCHS, **LONG_ROPE_ARCHS}
_GGUF_LAYER = {**gf._TO_GGUF, "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
               "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.gate.weight": "ffn_gate_inp.weight"}


def tiny_tokenizer(tmp_path):
    from cpuserve.engine.loader import load_checkpoint

    gf.write_llama_gguf(tmp_path / "tok.gguf", {}, gf.TINY)
    return load_checkpoint(str(tmp_path / "tok.gguf"), show_progress=False).tokenizer


def build_hf_model(name: str, seed: int = 0, **overrides):
    """overrides: config fields replacing the tiny shape's (hidden_size=256 for K-quant rows, ...)."""
    import transformers

    cls, extra, _ = SPECS[name]
    vocab = len(gf.tiny_vocab()[0])
    if name in LONG_ROPE_ARCHS:
        extra = {**extra, "rope_scaling": _long_rope_factors(extra.get("partial_rotary_factor", 1.0), seed)}
    fields = dict(vocab_size=vocab, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, intermediate_size=FFN, max_position_embeddings=CTX, rms_norm_eps=1e-5,
                  initializer_range=0.1)  # 0.1: logits far enough apart that greedy picks are no near-ties
    config = getattr(transformers, cls)(**{**fields, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls.replace("Config", "ForCausalLM"))(config).float().eval()
    with torch.no_grad():  # norms away from 1, so a loader that skips one is caught
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _long_rope_factors(partial_rotary_factor: float, seed: int) -> dict:
    pairs = int(DIM // HEADS * partial_rotary_factor) // 2
    g = torch.Generator().manual_seed(seed + 1)
    short = 1.0 + 0.5 * torch.rand(pairs, generator=g).sort().values
    long = 1.0 + 3.0 * torch.rand(pairs, generator=g).sort().values * torch.linspace(0.2, 4.0, pairs)
    return {"type": "longrope", "short_factor": short.tolist(), "long_factor": long.tolist()}


def save_hf_folder(model, folder, tokenizer) -> str:
    model.save_pretrained(str(folder))
    (folder / "tokenizer.json").write_text(tokenizer.backend.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": gf.CHAT_TEMPLATE,
                                                              "eos_token": "<|im_end|>"}))
    return str(folder)


def write_gguf(model, path, name: str, attn_factor: bool = True, expert_qtype=None,
               dense_qtype: str | None = None) -> str:
    """The model as llama.cpp's convert_hf_to_gguf writes it: llama permutes Q/K rows, the others keep HF's.
    attn_factor=False leaves LongRoPE's attention factor out (the reader derives it from the context lengths);
    expert_qtype: the block type(s) of an MoE model's experts (moe_factory.write_experts), which then become the
    file's values in `model` too; None: F32. dense_qtype: the type of the other 2-D tensors (one gguf.quants
    encodes), which `model` then holds as the file's values too; None: F32."""
    arch = SPECS[name][2]
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    shape = gf.Shape(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                     n_kv_heads=cfg.num_key_value_heads, ffn_dim=cfg.intermediate_size, ctx=cfg.max_position_embeddings)
    rope = cfg.rope_parameters or {}
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * head_dim)  # phi3's converter: int(f * dim) // heads
    gf.add_llama_metadata(writer, shape, cfg.vocab_size, float(rope.get("rope_theta", 10000.0)), head_dim,
                          cfg.rms_norm_eps, rope_dims)
    if rope.get("rope_type") == "longrope":
        _add_long_rope(writer, rope, cfg.max_position_embeddings, attn_factor)
    gf.add_tiny_tokenizer(writer)
    if getattr(cfg, "num_experts_per_tok", None):
        add_moe_metadata(writer, cfg, arch)
        write_experts(writer, model, expert_qtype)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for hf, array in state.items():
        if "rotary_emb" in hf or (cfg.tie_word_embeddings and hf == "lm_head.weight") or is_expert_state(hf):
            continue
        raw_dtype = None
        if dense_qtype is not None and array.ndim == 2:
            raw_dtype = QT[dense_qtype]
            blocks = gguf.quants.quantize(array, raw_dtype)  # [rows, bytes]: permute_qk moves whole rows alike
            array[...] = gguf.quants.dequantize(blocks, raw_dtype)  # into the model's own parameter (shared memory)
            array = blocks
        if arch == "llama" and hf.endswith("q_proj.weight"):
            array = gf.permute_qk(array, cfg.num_attention_heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            array = gf.permute_qk(array, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(hf), np.ascontiguousarray(array), raw_dtype=raw_dtype)
    if rope.get("rope_type") == "llama3":  # the converter stores the scaled frequencies' divisors, not the params
        inv = model.model.rotary_emb.inv_freq.double()
        base = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        writer.add_tensor("rope_freqs.weight", (base / inv).float().numpy())
    return finish_gguf(writer, path)


def _add_long_rope(writer: gguf.GGUFWriter, rope: dict, max_len: int, attn_factor: bool) -> None:
    """As convert_hf_to_gguf's Phi3MiniModel: the original context, sqrt(1 + ln(s) / ln(original)) with s = context /
    original, and the factors as two F32 tensors."""
    original = rope["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    if attn_factor:
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(max_len / original) / math.log(original)))
    writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def finish_gguf(writer: gguf.GGUFWriter, path) -> str:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _gguf_name(hf: str, names: dict[str, str] = _GGUF_LAYER) -> str:
    if hf in names:
        return names[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{names[rest]}"
