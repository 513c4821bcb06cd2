"""Build a runtime model from a checkpoint's fp32 weight stream, quantizing each layer as it arrives."""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from tqdm import tqdm

from cpuserve.engine.layers.linear import QuantLinear, build_linear
from cpuserve.engine.layers.embedding import CodedEmbedding
from cpuserve.engine.layers.linear.act_int8 import Int8ActLinear
from cpuserve.engine.layers.linear.factory import INT8_ACTIVATIONS, check_token_scales
from cpuserve.engine.layers.linear.coded import CodedWeight, coded_misfit, concat_rows, to_linear
from cpuserve.engine.models import gemma3, moe
from cpuserve.engine.models.llama import MLP, Attention, LlamaModel, TransformerBlock
from cpuserve.engine.models.rope import reorder_heads, rotary_order

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_PARTS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)
_MLP_PARTS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def activation_dtype(weights: str) -> torch.dtype:
    return torch.float32 if weights == "fp32" else torch.bfloat16


def lm_head_format(weights: str, tensor=None) -> str:
    # Re-quantizing the vocabulary projection to int4 costs accuracy for little speed; int8 per-channel keeps both.
    # A file's codes wider than 4 bits take "int4" too: its rule keeps them in their narrowest exact storage or, where
    # the kernel cannot take them, makes them int8, never int4 (a Q6_K output layer keeps 6-bit codes, where int8
    # storage would stream 1.14x the bytes at every decode step).
    if weights == "int4" and not (isinstance(tensor, CodedWeight) and tensor.bits > 4):
        return "int8"
    return weights


def build_model(checkpoint, weights: str, group_size: int, show_progress: bool = True,
                activations: str = "bf16") -> LlamaModel:
    """checkpoint: a loader Checkpoint or a rank's ShardedCheckpoint (args + iter_native_weights: tensors in Hugging
    Face Llama naming, fp32, a GGUF's block-quantized ones as CodedWeight whose codes build_linear may keep);
    activations: what int4 / int8 weights multiply (build_linear's)."""
    args = checkpoint.args
    dtype = activation_dtype(weights)
    pending: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    layers: dict[int, TransformerBlock] = {}
    top: dict[str, torch.Tensor] = {}
    lm_head = None
    stream = tqdm(checkpoint.iter_native_weights(), total=checkpoint.num_tensors,
                  desc=f"loading and converting to {weights}", unit="tensor", disable=not show_progress, leave=False)
    for name, tensor in stream:
        match = _LAYER.fullmatch(name)
        # the vocabulary-sized tensors are converted as they arrive, so their fp32 copies are never held together
        # with the layers' (a 1B model's embedding and lm_head are 262 MB each in fp32)
        if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and args.tie_embeddings):
            lm_head = build_linear(tensor, None, lm_head_format(weights, tensor), group_size, activations=activations)
            check_token_scales(lm_head, args.arch, "lm_head", activations)
        if name == "model.embed_tokens.weight":  # the lookup table, in the activation dtype or packed codes
            tensor = _embedding_table(tensor, lm_head if args.tie_embeddings else None, dtype)
        elif name == "lm_head.weight":
            tensor = None  # kept only as lm_head: the name marks it as present
        if match is None:
            top[name] = tensor
            continue
        index, part = int(match.group(1)), match.group(2)
        pending[index][part] = tensor
        if all(p in pending[index] for p in _parts(args)):
            layers[index] = _build_block(args, index, pending.pop(index), weights, group_size, dtype, activations)
    missing = [i for i in range(args.n_layers) if i not in layers]
    if missing:
        raise ValueError(f"checkpoint is missing tensors of layer(s) {missing[:5]}: expected {_parts(args)}")
    required = ("model.embed_tokens.weight", "model.norm.weight") + (() if args.tie_embeddings else ("lm_head.weight",))
    for name in required:
        if name not in top:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
    embedding = top.pop("model.embed_tokens.weight")
    # Gemma scales the embedding by sqrt(dim), rounded to the table's dtype as HF does
    multiplier = args.dim ** 0.5 if args.arch == "gemma3" else None
    if isinstance(embedding, Int8ActLinear):
        embedding = CodedEmbedding(embedding, dtype, multiplier)
    elif multiplier is not None:  # not in place: with tied embeddings an fp32 lm_head may share this very tensor
        embedding = embedding * torch.tensor(multiplier, dtype=embedding.dtype)
    model_class = gemma3.Gemma3Model if args.arch == "gemma3" else LlamaModel
    model = model_class(args, embedding, [layers[i] for i in range(args.n_layers)], lm_head, dtype)
    model.norm.weight.data = top.pop("model.norm.weight").to(dtype)
    return model.eval()


def _embedding_table(tensor, tied_head, dtype: torch.dtype):
    """A GGUF's coded table stays packed for bf16 models (engine/layers/embedding.py): the tied lm_head's own codes,
    else the file's codes packed as the kernels' layers are; anything else a dense table in dtype."""
    if not isinstance(tensor, CodedWeight):
        return tensor.to(dtype)
    if dtype == torch.bfloat16 and isinstance(tied_head, Int8ActLinear):
        return tied_head
    if dtype == torch.bfloat16 and not coded_misfit(tensor):
        return to_linear(tensor, "int4")
    return tensor.dequantize(False, dtype)


def _parts(args) -> list[str]:
    """The tensors a layer of this model needs before it can be built."""
    extra = [f"self_attn.{p}_proj.bias" for p in "qkv"] if args.qkv_bias else []
    extra += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if args.qk_norm else []
    extra += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"] if args.arch == "gemma3" else []
    mlp = moe.expert_parts(args.experts_held) if args.n_experts else _MLP_PARTS
    return [*_LAYER_PARTS, *mlp, *extra]


def _partial_rotary_order(args, parts: dict) -> dict:
    """q and k with each head's dims in rope.py's order for partial rotary (its docstring): weights, biases, norms."""
    order = rotary_order(args.head_dim, args.rotary_dim)

    def reorder(t):
        fn = lambda rows: reorder_heads(rows, args.head_dim, order)  # noqa: E731
        return t.map_rows(fn) if isinstance(t, CodedWeight) else fn(t)

    names = [f"self_attn.{p}_{kind}" for p in "qk" for kind in ("proj.weight", "proj.bias", "norm.weight")]
    return {**parts, **{n: reorder(parts[n]) for n in names if n in parts}}


def _build_block(args, index: int, parts: dict[str, torch.Tensor], weights: str, group_size: int, dtype,
                 activations: str) -> TransformerBlock | gemma3.Gemma3Block:
    def linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantLinear:
        layer = build_linear(weight, bias, weights, group_size, activations=activations)
        return check_token_scales(layer, args.arch, f"layer {index} {name}", activations)

    if args.rotary_dim < args.head_dim:
        parts = _partial_rotary_order(args, parts)
    qkv_weight = concat_rows([parts[f"self_attn.{p}_proj.weight"] for p in "qkv"])  # [(H + 2 Hkv) D, dim]
    qkv_bias = torch.cat([parts[f"self_attn.{p}_proj.bias"] for p in "qkv"]) if args.qkv_bias else None
    qkv, o_proj = linear("qkv_proj", qkv_weight, qkv_bias), linear("o_proj", parts["self_attn.o_proj.weight"])
    if args.n_experts:  # Mixtral, Qwen3-MoE: the MLP is the layer's experts
        mlp = moe.build_moe(args, parts, linear)
    else:
        gate_up = concat_rows([parts["mlp.gate_proj.weight"], parts["mlp.up_proj.weight"]])  # [2 ffn, dim]
        gate_up, down = linear("gate_up_proj", gate_up), linear("down_proj", parts["mlp.down_proj.weight"])
        mlp = MLP(gate_up, down)
    int8_keys = activations in INT8_ACTIVATIONS  # prefill's Q K^T as int8 dot products where the kernel runs them
    if args.arch == "gemma3":
        block = gemma3.build_block(args, index, qkv, o_proj, gate_up, down, parts, dtype)
        block.attention.int8_keys = int8_keys
        return block
    attention = Attention(args, qkv, o_proj)
    attention.int8_keys = int8_keys
    if args.qk_norm:  # in the activation dtype, as the block's norms
        attention.q_norm.weight.data = parts["self_attn.q_norm.weight"].to(dtype)
        attention.k_norm.weight.data = parts["self_attn.k_norm.weight"].to(dtype)
    block = TransformerBlock(args, attention, mlp, dtype)
    block.attention_norm.weight.data = parts["input_layernorm.weight"].to(dtype)
    block.ffn_norm.weight.data = parts["post_attention_layernorm.weight"].to(dtype)
    return block
