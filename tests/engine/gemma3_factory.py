"""A tiny random-weight Gemma 3 built by transformers from a config, saved as a safetensors folder and written as a
GGUF the way llama.cpp's convert_hf_to_gguf.py writes `gemma3` (norms stored as 1 + weight, HF's q/k row order,
sliding window in the metadata), both with a small SentencePiece vocabulary carrying Gemma's turn tokens and chat
template.

    model = build_gemma3(query_pre_attn_scalar=24)
    folder = save_gemma3_folder(model, tmp_path / "hf")
    path = write_gemma3_gguf(model, tmp_path / "m.gguf")
"""
from __future__ import annotations

import json

import gguf
import gguf_factory as gf
import numpy as np
import torch
from arch_factory import _GGUF_LAYER, _gguf_name, finish_gguf, save_hf_folder

QT = gguf.GGMLQuantizationType
WINDOW = 16  # shorter than the tests' prompts: they span at least two windows
DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, CTX = 64, 7, 4, 2, 32, 128, 512  # 7 layers: 5 local, 1 global, 1 local
ROPE_LINEAR = 2.0  # the global layers' linear RoPE scaling (Gemma 3 4B and up use 8)
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_NAMES = {  # HF -> llama.cpp, with Gemma 3's four norms per block
    **_GGUF_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def build_gemma3(query_pre_attn_scalar: float = HEAD_DIM, seed: int = 0):
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=len(gf.spm_vocab(TURN_TOKENS)[0]), hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=FFN, max_position_embeddings=CTX,
        sliding_window=WINDOW, query_pre_attn_scalar=query_pre_attn_scalar, rms_norm_eps=1e-6,
        rope_scaling={"rope_type": "linear", "factor": ROPE_LINEAR}, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():  # Gemma's norms start at 0 (a multiplier of 1): move them, so a skipped one is caught
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_gemma3_folder(model, folder, tokenizer) -> str:
    save_hf_folder(model, folder, tokenizer)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
    return str(folder)


def write_gemma3_gguf(model, path, final_logit_softcapping: float | None = None, qtype: QT = QT.F32) -> str:
    """qtype: of the 2-D tensors (norms stay F32, as llama.cpp keeps them)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    if final_logit_softcapping is not None:  # Gemma 2 style; Gemma 3's converter writes none
        writer.add_final_logit_softcapping(final_logit_softcapping)
    shape = gf.Shape(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                     n_kv_heads=cfg.num_key_value_heads, ffn_dim=cfg.intermediate_size, ctx=cfg.max_position_embeddings)
    gf.add_llama_metadata(writer, shape, cfg.vocab_size, cfg.rope_parameters["full_attention"]["rope_theta"],
                          cfg.head_dim, cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)  # the converter: for the global layers
    writer.add_rope_scaling_factor(ROPE_LINEAR)
    gf.add_spm_tokenizer(writer, TURN_TOKENS, CHAT_TEMPLATE)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" or "rotary_emb" in hf:  # tied: llama.cpp writes no output.weight
            continue
        array = tensor.detach().float().numpy()
        if hf.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter stores Gemma's RMSNorm multiplier
        gf.add_tensor(writer, _gguf_name(hf, _NAMES), np.ascontiguousarray(array, dtype=np.float32), qtype)
    return finish_gguf(writer, path)


def dequantized_copy(model, qtype: QT):
    """The model with every 2-D weight replaced by gguf's own dequantization of its `qtype` blocks: what a file
    written with that qtype means, run by transformers."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, p in ref.named_parameters():
            if p.dim() == 2:
                blocks = gguf.quants.quantize(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).reshape(p.shape))
    return ref
