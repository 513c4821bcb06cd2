"""Hugging Face checkpoint folders: config.json + *.safetensors (+ tokenizer.json, tokenizer_config.json)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as BackendTokenizer

from cpuserve.engine.loader import gemma3, moe, phi3
from cpuserve.engine.loader.fused import FUSED, split_fused
from cpuserve.engine.models.args import ModelArgs, RopeScaling
from cpuserve.engine.tokenizer import END_OF_TURN_TEXTS, Tokenizer

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                           "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3",
                           **moe.HF_ARCHITECTURES}
SUPPORTED_DTYPES = ("F32", "F16", "BF16")
_WEIGHT_RE = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|model\.layers\.\d+\.("
    r"input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm|mlp\.(gate|up|down|gate_up)_proj|self_attn\.(o|qkv)_proj|"
    r"self_attn\.[qk]_norm"
    r")\.weight|model\.layers\.\d+\.self_attn\.[qkv]_proj\.(weight|bias)"
)
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq")  # old checkpoints saved this buffer; it is recomputed


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _rope(config: dict[str, Any], path: str, arch: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes rope_parameters (theta inside); older configs have rope_theta + rope_scaling
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default" or (arch == "phi3" and rope_type in phi3.LONGROPE_TYPES):  # longrope: phi3.hf_fields
        return theta, None
    if rope_type != "llama3":
        supported = "default, llama3" + (", longrope" if arch == "phi3" else " (longrope: Phi3ForCausalLM only)")
        raise ValueError(f"{path}/config.json: rope type {rope_type!r} is not supported; supported: {supported}")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def build_model_args(config: dict[str, Any], path: str) -> ModelArgs:
    archs = config.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{path}/config.json: architectures={archs} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    if arch in ("llama", "qwen3", "qwen3moe") and config.get("attention_bias"):
        raise ValueError(f"{path}/config.json: attention_bias=true is not supported for {archs[0]}")
    if arch != "phi3" and float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{path}/config.json: partial_rotary_factor={config['partial_rotary_factor']} is not "
                         f"supported for {archs[0]}; supported: 1.0 (partial rotary heads: Phi3ForCausalLM only)")
    gemma = gemma3.hf_fields(config, path) if arch == "gemma3" else {}  # its own rope, window, norms, defaults
    theta, scaling = _rope(config, path, arch) if not gemma else (None, None)
    n_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // n_heads)
    phi = phi3.hf_fields(config, path, head_dim) if arch == "phi3" else {}  # partial rotary, LongRoPE
    max_len = int(config["max_position_embeddings"])
    if config.get("sliding_window") and config.get("use_sliding_window", True) and not gemma:
        # Mistral v0.1, Phi-3: attention over the last `sliding_window` tokens; within that many tokens it is
        # full causal attention, which is what the engine computes, so the context stops there
        max_len = min(max_len, int(config["sliding_window"]))
    fields = dict(
        arch=arch,
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_seq_len=max_len,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3moe"),
    )
    name = next(a for a in archs if a in SUPPORTED_ARCHITECTURES)
    experts = moe.hf_fields(config, name, path) if name in moe.HF_ARCHITECTURES else {}
    return ModelArgs(**{**fields, **gemma, **phi, **experts})


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as "..." or {"content": "...", ...}
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(folder: str, tok_config: dict[str, Any]) -> str | None:
    jinja_path = os.path.join(folder, "chat_template.jinja")  # transformers >= 4.43 saves it beside the config
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def _as_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def build_hf_tokenizer(folder: str, config: dict[str, Any]) -> Tokenizer:
    tokenizer_path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        raise ValueError(f"{folder}: tokenizer.json is missing (a Hugging Face folder needs it next to config.json)")
    backend = BackendTokenizer.from_file(tokenizer_path)  # its post-processor already adds BOS if the model wants it
    tok_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    gen_config = _read_json(os.path.join(folder, "generation_config.json"))
    texts = {name: _token_text(tok_config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    texts = {name: text for name, text in texts.items() if text}
    eos_ids = _as_ids(config.get("eos_token_id")) | _as_ids(gen_config.get("eos_token_id"))
    if "eos_token" in texts and backend.token_to_id(texts["eos_token"]) is not None:
        eos_ids.add(backend.token_to_id(texts["eos_token"]))
    added = backend.get_added_tokens_decoder()
    eos_ids |= {i for i, tok in added.items() if tok.special and tok.content in END_OF_TURN_TEXTS}
    bos_id = config.get("bos_token_id")
    if bos_id is None and "bos_token" in texts:
        bos_id = backend.token_to_id(texts["bos_token"])
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=frozenset(eos_ids),
        chat_template=_chat_template(folder, tok_config),
        special_token_texts=texts,
    )


class SafetensorsWeights:
    """Streams the folder's tensors as fp32, one at a time (safetensors files are memory-mapped)."""

    def __init__(self, folder: str, args: ModelArgs):
        self.args = args
        self.files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not self.files:
            raise ValueError(f"{folder}: no *.safetensors files (only safetensors weights are supported, not .bin)")
        self.names: list[tuple[str, str]] = []  # (file, tensor name) in yield order
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    self._check(file, name, f.get_slice(name).get_dtype(), args)
                    if _IGNORED_RE.fullmatch(name) or (args.tie_embeddings and name == "lm_head.weight"):
                        continue
                    self.names.append((file, name))

    @staticmethod
    def _check(file: str, name: str, dtype: str, args: ModelArgs) -> None:
        if _IGNORED_RE.fullmatch(name):
            return
        if not (_WEIGHT_RE.fullmatch(name) or args.n_experts and moe.HF_TENSOR_RE.fullmatch(moe.hf_name(name))):
            raise ValueError(f"{file}: tensor {name!r} is not part of a Llama-family model this loader knows")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {dtype}; supported: {', '.join(SUPPORTED_DTYPES)}")

    def select_experts(self, first: int, stop: int) -> None:
        """Stream only experts [first, stop) of each layer: the others' tensors are never read."""
        def kept(name: str) -> bool:
            e = moe.expert_index(moe.hf_name(name))
            return e is None or first <= e < stop

        self.names = [(file, name) for file, name in self.names if kept(name)]

    def __len__(self) -> int:
        return sum(3 if name.endswith(FUSED[0]) else 2 if name.endswith(FUSED[1]) else 1 for _, name in self.names)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        handles: dict[str, Any] = {}
        for file, name in self.names:
            if file not in handles:
                handles = {file: safe_open(file, framework="pt")}  # one shard open at a time
            tensor = handles[file].get_tensor(name).to(torch.float32)
            name = moe.hf_name(name)  # Mixtral's block_sparse_moe.* in the experts' one naming
            if self.args.arch == "gemma3":
                tensor = gemma3.norm_multiplier(name, tensor)
            yield from split_fused(name, tensor, self.args)


def load_hf_folder(folder: str) -> tuple[ModelArgs, Tokenizer, SafetensorsWeights]:
    config = _read_json(os.path.join(folder, "config.json"))
    args = build_model_args(config, folder)
    return args, build_hf_tokenizer(folder, config), SafetensorsWeights(folder, args)
