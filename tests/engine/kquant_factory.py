"""Real GGUF block layouts for tests: gguf's own quantizer where it has one, else valid K-quant blocks built byte
by byte (bench/kquant_recipe.py), and a tiny Llama laid out as llama.cpp's Q4_K_M.

    raw = real_blocks("Q4_K", (64, 512))     # uint8 [rows, bytes]
    types = write_q4_k_m(path)                # GGUF name -> type of every 2-D tensor
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import gguf_factory as gf
import numpy as np

QT = gguf.GGMLQuantizationType
GGUF_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the block types gguf.quants can encode
SHAPE = gf.Shape(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, ctx=256)  # K-quant rows: 256 columns


def bench_module(name: str):
    """A bench/ script as a module (bench scripts import each other by bare name, so bench/ goes on sys.path)."""
    folder = Path(__file__).resolve().parents[2] / "bench"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def real_blocks(qtype: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in GGUF_QUANTIZES:
        return gguf.quants.quantize(rng.normal(0, 0.02, size=shape).astype(np.float32), QT[qtype])
    return bench_module("kquant_recipe").random_blocks(QT[qtype], shape, rng)


def write_q4_k_m(path, shape: gf.Shape = SHAPE, seed: int = 0) -> dict[str, QT]:
    """A tiny Llama whose 2-D tensors are valid random blocks of the types llama.cpp's Q4_K_M gives them."""
    recipe = bench_module("kquant_recipe")
    tokens, _, _ = gf.tiny_vocab()
    weights = gf.make_llama_weights(shape, len(tokens), seed=seed)
    rng = np.random.default_rng(seed)
    raw, types = {}, {}
    for hf, array in list(weights.items()):
        if array.ndim == 2:
            name = gf.gguf_name(hf)
            types[name] = recipe.recipe_type("Q4_K_M", name, array.shape, shape.n_layers, tie_embeddings=True)
            raw[name] = (recipe.random_blocks(types[name], array.shape, rng), types[name])
            del weights[hf]
    gf.write_llama_gguf(path, weights, shape, raw_tensors=raw)
    return types
