"""K-quant files as llama.cpp's quantizer lays them out, with random weights (gguf has no K-quant encoder).

recipe_type(recipe, name, shape, ...) is the type llama.cpp's llama-quantize gives each tensor of a Llama for the
"mostly" types we benchmark (its llama_tensor_get_type):

    Q4_K_M  Q4_K everywhere; Q6_K for the output (or the tied embedding), and for attn_v and ffn_down (an MoE's
            ffn_down_exps too) in the first and last eighth of the layers and every third layer between them
    Q6_K    Q6_K everywhere
    a K-quant needs rows of whole 256-value super-blocks: other widths fall back as llama.cpp's do
    (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; SmolLM2's 576 is one such width)

random_blocks writes valid blocks byte by byte: random codes and sub-block scales, and the fp16 super-block scales
chosen so the values have mean ~0 and standard deviation ~0.02, like the other synthetic weights.
"""
from __future__ import annotations

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
RECIPES = ("Q4_K_M", "Q6_K")
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}
# byte offsets of the fp16 (d, dmin) of each K-quant block
_F16_FIELDS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def _more_bits(layer: int, n_layers: int) -> bool:
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def recipe_type(recipe: str, name: str, shape: tuple[int, ...], n_layers: int, tie_embeddings: bool) -> QT:
    if len(shape) == 1:
        return QT.F32
    if recipe == "Q6_K":
        qt = QT.Q6_K
    elif name == "output.weight" or (tie_embeddings and name == "token_embd.weight"):
        qt = QT.Q6_K
    elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and _more_bits(
            int(name.split(".")[1]), n_layers):
        qt = QT.Q6_K
    else:
        qt = QT.Q4_K
    return qt if shape[-1] % 256 == 0 else _FALLBACK[qt]


def random_blocks(qt: QT, shape: tuple[int, int], rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """uint8 [rows, bytes] of valid `qt` blocks for a [rows, cols] tensor, values ~ mean 0, standard deviation std."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = shape
    raw = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    fields = _F16_FIELDS[qt]
    # with d = 1 and dmin = the codes' mean a sample's mean is ~0; one measurement then scales both to `std`
    ratio = {QT.Q2_K: 1.5, QT.Q4_K: 7.5, QT.Q5_K: 15.5}.get(qt, 0.0)
    sample = raw[:1, :1].copy()
    _set_f16(sample, fields, 1.0, ratio)
    spread = float(gguf.quants.dequantize(sample.reshape(1, -1), qt).std()) or 1.0
    _set_f16(raw, fields, std / spread, ratio * std / spread)
    return raw.reshape(rows, -1)


def _set_f16(raw: np.ndarray, fields: tuple[int, ...], d: float, dmin: float) -> None:
    for at, value in zip(fields, (d, dmin)):
        raw[..., at:at + 2] = np.array([value], dtype=np.float16).view(np.uint8)
