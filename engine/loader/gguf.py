"""GGUF checkpoints (llama.cpp's format): hyper-parameters, tokenizer, and weights: float tensors as fp32, block-
quantized ones as their own codes and group scales (gguf_codes.py).

Weights come out in Hugging Face Llama naming and layout, so the model has one load path for both formats.
The one layout quirk: llama.cpp's converter permutes the rows of Q and K in every head from HF's
"halves" order (rotate_half RoPE) to interleaved pairs (GPT-J RoPE); we permute them back.
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.loader import gemma3, moe, phi3
from cpuserve.engine.loader.fused import split_fused
from cpuserve.engine.loader.gguf_codes import CODED_TYPES, decode_codes
from cpuserve.engine.loader.gguf_reader import GGUFReader
from cpuserve.engine.loader.gguf_tokenizer import build_gguf_tokenizer
from cpuserve.engine.loader.rope import rope_scaling_from_freqs
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.tokenizer import Tokenizer

QT = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16) + CODED_TYPES  # block types: their codes are kept (gguf_codes.py)
# qwen2 / qwen3 / phi3 GGUFs keep HF's row order (llama.cpp runs them with NEOX RoPE): only llama is un-permuted
SUPPORTED_ARCHS = {
    "llama": {"permuted_qk": True, "qkv_bias": False},  # Llama 2 / 3.x, Mistral, SmolLM, TinyLlama, Mixtral
    "qwen2": {"permuted_qk": False, "qkv_bias": True},
    "qwen3": {"permuted_qk": False, "qkv_bias": False},  # + per-head q/k norms
    "qwen3moe": {"permuted_qk": False, "qkv_bias": False},  # Qwen3's attention, experts' MLPs (moe.py)
    "phi3": {"permuted_qk": False, "qkv_bias": False},  # fused attn_qkv and ffn_up (gate + up), split by fused.py
    "gemma3": {"permuted_qk": False, "qkv_bias": False},  # + sliding-window layers, four norms per block (gemma3.py)
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **moe.GGUF_NAMES,
}
# Gemma 3 has four norms per block: llama.cpp's ffn_norm is its pre-feed-forward one
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"  # llama3 per-dimension frequency divisors; folded into ModelArgs.rope_scaling
# tensors read into ModelArgs (rope_scaling, long_rope), never streamed as weights
ROPE_TENSORS = (ROPE_FREQS, *phi3.FACTOR_TENSORS)


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if llama.cpp's name is not one we know."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match and arch == "phi3" and match.group(2) == "ffn_up.weight":  # phi3's ffn_up holds gate and up
        return f"model.layers.{match.group(1)}.mlp.gate_up_proj.weight"
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    return None


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    # GGUF.* fields are the file header (version, counts), not model metadata
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of Q/K.

    llama.cpp stores each head's rows as pairs (r0, r_half, r1, r_half+1, ...); HF keeps the two halves
    apart (r0..r_half-1, r_half..). weight: [n_heads * head_dim, dim] (or [n_heads * head_dim] for a bias).
    """
    rows = weight.shape[0]
    # w: [n_heads, head_dim // 2, 2, ...] -> swap the pair axis in front of the half axis
    w = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _scalar(meta: dict[str, Any], key: str, path: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ValueError(f"{path}: required GGUF metadata key {key!r} is missing")
    if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv) must be uniform for our engine
        if len(set(value)) != 1:
            raise ValueError(f"{path}: {key} varies per layer ({value}); only uniform values are supported")
        value = value[0]
    return value


def build_model_args(meta: dict[str, Any], reader: gguf.GGUFReader, path: str) -> ModelArgs:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHS)}")
    key = lambda name: f"{arch}.{name}"  # noqa: E731 - metadata keys are prefixed by the architecture
    dim = int(_scalar(meta, key("embedding_length"), path))
    n_heads = int(_scalar(meta, key("attention.head_count"), path))
    names = {t.name for t in reader.tensors}
    vocab = meta.get(key("vocab_size")) or len(meta.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ValueError(f"{path}: neither {key('vocab_size')} nor tokenizer.ggml.tokens gives the vocabulary size")
    scaling_type = meta.get(key("rope.scaling.type"), "none")
    supported_scaling = ("none", "linear") if arch == "gemma3" else ("none", "llama3")  # gemma3: its global layers
    if scaling_type not in supported_scaling and float(meta.get(key("rope.scaling.factor"), 1.0)) != 1.0:
        raise ValueError(f"{path}: {key('rope.scaling.type')}={scaling_type!r} is not supported; supported: "
                         f"{', '.join(supported_scaling)}")
    rope_dims = meta.get(key("rope.dimension_count"))
    head_dim = int(_scalar(meta, key("attention.key_length"), path, dim // n_heads))
    if arch != "phi3" and rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(f"{path}: {key('rope.dimension_count')}={rope_dims} rotates part of each head (head_dim="
                         f"{head_dim}); supported: {head_dim} (partial rotary heads: phi3 only)")
    if arch != "phi3" and any(n in names for n in phi3.FACTOR_TENSORS):
        raise ValueError(f"{path}: rope_factors_long/short (LongRoPE) in a {arch!r} file are not supported; "
                         "supported: LongRoPE in phi3 files")
    factors = lambda name: gguf.quants.dequantize(*_tensor_data(reader, name))  # noqa: E731
    phi = phi3.gguf_fields(meta, key, factors, names, path, head_dim) if arch == "phi3" else {}
    rope_scaling = None
    if ROPE_FREQS in names:
        freqs = gguf.quants.dequantize(*_tensor_data(reader, ROPE_FREQS))
        rope_scaling = rope_scaling_from_freqs(np.asarray(freqs, dtype=np.float64).reshape(-1), meta, key, path)
    n_layers = int(_scalar(meta, key("block_count"), path))
    gemma = gemma3.gguf_fields(meta, key, path, n_layers, dim, n_heads, head_dim) if arch == "gemma3" else {}
    experts = moe.gguf_fields(meta, key, names, arch, path)
    fields = dict(
        arch=arch,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(_scalar(meta, key("attention.head_count_kv"), path, n_heads)),
        head_dim=head_dim,
        ffn_dim=int(_scalar(meta, key("feed_forward_length"), path)),
        vocab_size=int(vocab),
        max_seq_len=int(_scalar(meta, key("context_length"), path)),
        norm_eps=float(_scalar(meta, key("attention.layer_norm_rms_epsilon"), path, 1e-5)),
        rope_theta=float(_scalar(meta, key("rope.freq_base"), path, 10000.0)),
        rope_scaling=rope_scaling,
        tie_embeddings="output.weight" not in names,
        qkv_bias=SUPPORTED_ARCHS[arch]["qkv_bias"] and any(n.endswith("attn_q.bias") for n in names),
        qk_norm=any(n.endswith("attn_q_norm.weight") for n in names),
    )
    return ModelArgs(**{**fields, **gemma, **phi, **experts})


def _tensor_data(reader: gguf.GGUFReader, name: str) -> tuple[np.ndarray, QT]:
    tensor = next(t for t in reader.tensors if t.name == name)
    return tensor.data, tensor.tensor_type


def check_tensors(reader: gguf.GGUFReader, path: str) -> None:
    """Fail before streaming: every tensor must be one we can name and dequantize."""
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    arch = reader_arch(reader)
    for t in reader.tensors:
        if t.name not in ROPE_TENSORS and hf_name(t.name, arch) is None:
            raise ValueError(f"{path}: tensor {t.name!r} is not part of a Llama-family model this loader knows")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name!r} has type {t.tensor_type.name}; supported types: {supported} "
                "(re-quantize the file with llama-quantize to one of them)"
            )


class GGUFWeights:
    """Streams a GGUF's tensors in HF naming, one at a time (the file is memory-mapped): F32 / F16 / BF16 and 1-D
    tensors as fp32, 2-D block-quantized ones as CodedWeight (the file's codes and group scales)."""

    def __init__(self, reader: gguf.GGUFReader, args: ModelArgs):
        self.reader = reader
        self.args = args
        self.permuted_qk = SUPPORTED_ARCHS[args.arch]["permuted_qk"]
        self.tensors = [t for t in reader.tensors if t.name not in ROPE_TENSORS]
        # fused tensors (phi3) come out as their parts: 3 for attn_qkv, 2 for ffn_up
        self.experts = (0, args.n_experts)  # the experts [first, stop) streamed (select_experts)

    def select_experts(self, first: int, stop: int) -> None:
        """Stream only experts [first, stop) of each layer: the other rows of a stacked tensor are never decoded."""
        self.experts = (first, stop)

    def __len__(self) -> int:
        parts = {"attn_qkv.weight": 3, "ffn_up.weight": 2 if self.args.arch == "phi3" else 1}
        n_experts = self.experts[1] - self.experts[0]
        return sum(parts.get(t.name.split(".", 2)[-1], 1) * moe.num_parts(hf_name(t.name, self.args.arch), n_experts)
                   for t in self.tensors)

    def _drop_pages(self, offset: int, size: int) -> None:
        """Take a dequantized tensor's pages of the mapped file out of this process's memory (they are clean: the
        kernel reads them again if ever touched), so a load's RSS never holds the whole file on top of the model."""
        mapped = getattr(self.reader.data, "_mmap", None)  # np.memmap's mmap.mmap
        if mapped is None or not hasattr(mapped, "madvise"):
            return
        start = offset - offset % mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, start, offset + size - start)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | CodedWeight]]:
        first, stop = self.experts
        for t in self.tensors:
            # numpy shape is GGUF's ne reversed: [out_features, in_features], as torch.nn.Linear stores it
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            name, data = hf_name(t.name, self.args.arch), t.data
            if moe.is_stacked(name):  # [E, rows, K]: experts [first, stop) only, whose bytes are contiguous
                data, shape = data[first:stop], (stop - first, *shape[1:])
            if len(shape) >= 2 and t.tensor_type in CODED_TYPES:  # stacked experts [E, rows, K] as [E * rows, K]
                weight = decode_codes(data, t.tensor_type, (math.prod(shape[:-1]), shape[-1]))
            else:
                weight = _dequantize_rows(data, t.tensor_type, shape)
                weight = weight.view(-1, shape[-1]) if len(shape) == 3 else weight
            self._drop_pages(t.data_offset, t.n_bytes)
            if self.permuted_qk and ".q_proj." in name:
                weight = _map_rows(weight, lambda w: unpermute_qk(w, self.args.n_heads))
            elif self.permuted_qk and ".k_proj." in name:
                weight = _map_rows(weight, lambda w: unpermute_qk(w, self.args.n_kv_heads))
            for part_name, part in split_fused(name, weight, self.args):
                yield from moe.split_experts(part_name, part, stop - first, first)


def reader_arch(reader: gguf.GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    return field.contents() if field is not None else ""


def _map_rows(weight, fn):
    return weight.map_rows(fn) if isinstance(weight, CodedWeight) else fn(weight)


DEQUANTIZE_ROWS = 2048  # rows per dequantization call: its numpy temporaries stay a few MB for any tensor size


def _dequantize_rows(data: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor as an fp32 torch tensor that owns its memory, dequantized a slice of rows at a time (a block never
    spans two rows), so loading a 49152-row embedding needs its output plus a few MB rather than several copies."""
    out = torch.empty(shape, dtype=torch.float32)
    rows = out.numpy().reshape(-1, shape[-1])  # a view of out: [prod(shape[:-1]), shape[-1]]
    packed = data.reshape(rows.shape[0], -1)  # one row of quantized blocks (or of F32/F16 values) per output row
    for start in range(0, rows.shape[0], DEQUANTIZE_ROWS):
        # F32 dequantizes to a read-only view of the mapped file: copying it into `out` gives writable memory
        rows[start:start + DEQUANTIZE_ROWS] = gguf.quants.dequantize(packed[start:start + DEQUANTIZE_ROWS], qtype)
    return out


def load_gguf(path: str) -> tuple[ModelArgs, Tokenizer, GGUFWeights]:
    try:
        reader = GGUFReader(path, "r")
    except ValueError as err:  # wrong magic / truncated header
        raise ValueError(f"{path}: not a readable GGUF file ({err})") from err
    meta = read_metadata(reader)
    args = build_model_args(meta, reader, path)
    check_tensors(reader, path)
    tokenizer = build_gguf_tokenizer(meta, path)
    return args, tokenizer, GGUFWeights(reader, args)
