"""spec.model.checkpointType: the checkpoint types the engine loads, per format, and the bytes each stores, an upper
bound that sizes the emptyDir a `source: url` download lands in (memory.download_size_limit).

GGUF types are llama.cpp's file types (llama-quantize's argument; gguf's LlamaFileType without MOSTLY_). A file type
gives each tensor a block type (llama.cpp src/llama-quant.cpp llama_tensor_get_type), every one of which the engine
loads (engine/loader/gguf.py SUPPORTED_TYPES). Safetensors types are the float dtypes and the quantized layouts the
loader keeps (engine/loader/gptq.py, awq.py, compressed_tensors.py).

A checkpoint stores its layers at a rate (bytes a parameter) and its embedding and output layer at another:

    stored = P x layer rate + E(P) x max(0, outer rate - layer rate)

    GGUF         layer rate: the largest block type the file type gives a layer's tensors (the mixtures hold
                 several: Q4_K_M's attn_v and ffn_down are partly Q6_K); outer: output.weight (or a tied
                 token_embd), which llama-quantize writes as Q6_K below Q8_0
    GPTQ / AWQ / layer rate: codes + a scale and a zero per group at the smallest usual group (32) + g_idx;
    W4A16 ...    outer: the embedding and lm_head, which these exports keep in fp16 / bf16
    E(P)         the embedding + output layer's parameters, at most min(P, 16 000 x sqrt(P)) (_EMBEDDING_PER_SQRT)
"""
from __future__ import annotations

import math

# gguf.GGML_QUANT_SIZES of the types the engine loads: (values a block, bytes a block). The operator extra does not
# install gguf (nor numpy); tests/operator/test_operator_checkpoints.py holds this table equal to gguf's.
GGML_BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
    "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
    "Q5_K": (256, 176), "Q6_K": (256, 210),
}
# llama.cpp file type -> the block types llama-quantize gives a layer's 2-D tensors (llama_tensor_get_type; its
# default type first). Left out, as within the +10% slack of download_size_limit (at most 2% of the parameters,
# under 0.007 B a parameter): a 70B Llama's attn_v in Q5_K, Mixtral's (8 experts) attn_k / attn_v in Q8_0 and
# attn_output in Q5_K. A tensor whose rows are not whole 256-value super-blocks falls back (Q2_K, Q3_K -> Q4_0,
# Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0): only models of widths such as 576, 640, 896, 960, 1152 have such rows
# (SmolLM2, Qwen2.5-0.5B, Gemma 3 270M and 1B), and at up to 1.1B parameters the 256 MiB slack covers even every
# tensor fallen back (Q6_K -> Q8_0: 0.24 B a parameter).
GGUF_LAYER_TYPES: dict[str, tuple[str, ...]] = {
    "F32": ("F32",), "F16": ("F16",), "BF16": ("BF16",), "Q8_0": ("Q8_0",),
    "Q4_0": ("Q4_0", "Q4_1"), "Q4_1": ("Q4_1",),  # with an importance matrix the first eighth's ffn_down is Q4_1
    "Q5_0": ("Q5_0", "Q5_1"), "Q5_1": ("Q5_1",),  # likewise Q5_1
    "Q2_K": ("Q2_K", "Q3_K", "Q4_K"), "Q2_K_S": ("Q2_K", "Q4_K"),
    "Q3_K_S": ("Q3_K",), "Q3_K_M": ("Q3_K", "Q4_K", "Q5_K"), "Q3_K_L": ("Q3_K", "Q4_K", "Q5_K"),
    "Q4_K_S": ("Q4_K", "Q5_K"), "Q4_K_M": ("Q4_K", "Q5_K", "Q6_K"),
    "Q5_K_S": ("Q5_K",), "Q5_K_M": ("Q5_K", "Q6_K"), "Q6_K": ("Q6_K",),
}
GGUF_OUTPUT_TYPE = "Q6_K"  # llama-quantize's output.weight (a tied model's token_embd) below Q8_0
# The quantized safetensors types -> code bits (every loader stores bits / 8 bytes a code: GPTQ, AWQ and
# pack-quantized pack 32 // bits codes in an int32, int-quantized one int8 a code) and whether a g_idx may be there.
# GPTQ-* and AWQ-INT4 are quant_method gptq / awq; W4A16, W8A16, W8A8 are compressed-tensors' schemes
# (llm-compressor's presets, symmetric or _ASYM; W8A8 the int8 one). A 4-bit compressed-tensors folder stored one
# code a byte (int- / naive-quantized) stores W8A16's bytes.
SAFETENSORS_QUANTIZED: dict[str, tuple[int, bool]] = {
    "GPTQ-INT4": (4, True), "GPTQ-INT8": (8, True), "AWQ-INT4": (4, False),
    "W4A16": (4, True), "W8A16": (8, True), "W8A8": (8, True),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
CHECKPOINT_TYPES = {"gguf": tuple(GGUF_LAYER_TYPES), "safetensors": FLOAT_TYPES + tuple(SAFETENSORS_QUANTIZED)}
ALL_CHECKPOINT_TYPES = tuple(dict.fromkeys(CHECKPOINT_TYPES["gguf"] + CHECKPOINT_TYPES["safetensors"]))

# Per group, a scale (fp16 / bf16: 2 bytes) and an integer zero (bits / 8 bytes; symmetric files store none).
# Group 32 gives the bound: the loaders take any group, exporters write 128 (the default), 64 or 32; a group of g
# below 32 stores (2 + bits / 8) x (1 / g - 1 / 32) bytes a parameter more (16: +0.08 for 4 bits).
BOUND_GROUP = 32
SCALE_BYTES = 2
# g_idx: an int32 per input of each module, 4 / N bytes a parameter of a module N outputs wide: 4 / 256 bounds a
# layer's average, its MLP being thousands wide (Qwen2.5-0.5B, whose k and v are 128 wide: 0.003).
G_IDX_BYTES = 4 / 256
FP16_BYTES = 2
# E(P) <= _EMBEDDING_PER_SQRT x sqrt(P): the embedding and output layer hold V x d parameters (twice when untied), and
# the width d grows as sqrt(P). Over the families the engine loads the ratio stays below 14 000 (Qwen3-8B, untied
# 152k vocabulary: 13 800; Llama 3.1 8B 11 700; Gemma 3 1B 9 500, 270M 10 300; Llama 3.1 70B 7 900):
# tests/operator/test_operator_checkpoints.py checks the bound over their shapes.
_EMBEDDING_PER_SQRT = 16_000


def block_rate(block_type: str) -> float:
    """Bytes a parameter of a GGUF block type."""
    values, size = GGML_BLOCKS[block_type]
    return size / values


def layer_rate(checkpoint_type: str) -> float:
    """Bytes a parameter of the checkpoint's layers (an upper bound): see the module docstring."""
    if checkpoint_type in SAFETENSORS_QUANTIZED:
        bits, g_idx = SAFETENSORS_QUANTIZED[checkpoint_type]
        return bits / 8 + (SCALE_BYTES + bits / 8) / BOUND_GROUP + (G_IDX_BYTES if g_idx else 0.0)
    return max(block_rate(t) for t in GGUF_LAYER_TYPES[checkpoint_type])


def outer_rate(checkpoint_type: str) -> float:
    """Bytes a parameter of the embedding and output layer."""
    if checkpoint_type in SAFETENSORS_QUANTIZED:
        return FP16_BYTES
    return max(layer_rate(checkpoint_type), block_rate(GGUF_OUTPUT_TYPE))


def embedding_bound(num_parameters: int) -> float:
    """An upper bound on the parameters of the embedding and output layer of a model of `num_parameters`."""
    return min(num_parameters, _EMBEDDING_PER_SQRT * math.sqrt(num_parameters))


def stored_bytes(checkpoint_type: str, num_parameters: int) -> float:
    """The bytes a checkpoint of `checkpoint_type` holding `num_parameters` stores, at most (tensor data; headers,
    tokenizer and 1-D norms are left to download_size_limit's slack)."""
    layers = layer_rate(checkpoint_type)
    outer = max(0.0, outer_rate(checkpoint_type) - layers)
    return num_parameters * layers + embedding_bound(num_parameters) * outer
