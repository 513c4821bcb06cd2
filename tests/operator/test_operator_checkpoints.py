"""spec.model.checkpointType: the types are the loader's, the schema takes each under its format only, and the bytes
a type is sized at hold what real files of that type store: GGUF files written with gguf's writer in llama.cpp's
layouts, a GPTQ folder written by tests/engine/quant_factory.py, and the tensors of real models' shapes laid out as
each format stores them (computed here from the layouts, apart from operator/checkpoints.py's arithmetic).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import gguf
import jsonschema
import pytest

from cpuserve.operator.checkpoints import (CHECKPOINT_TYPES, GGML_BLOCKS, GGUF_LAYER_TYPES, SAFETENSORS_QUANTIZED,
                                           embedding_bound, layer_rate, outer_rate, stored_bytes)
from cpuserve.operator.memory import MIB, download_size_limit
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate
from llmservice_factory import crd_validator, make_body

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
QT = gguf.GGMLQuantizationType
GGUF_ONLY = [t for t in CHECKPOINT_TYPES["gguf"] if t not in CHECKPOINT_TYPES["safetensors"]]
SAFETENSORS_ONLY = [t for t in CHECKPOINT_TYPES["safetensors"] if t not in CHECKPOINT_TYPES["gguf"]]


def engine_factories():
    if str(ENGINE_TESTS) not in sys.path:
        sys.path.insert(0, str(ENGINE_TESTS))
    import gguf_factory
    import kquant_factory

    return gguf_factory, kquant_factory


def body(fmt: str, checkpoint_type: str, params: int = 7_000_000_000) -> dict:
    return make_body(model={"source": "url", "url": "https://h/m" + (".gguf" if fmt == "gguf" else ".tar.gz"),
                            "format": fmt, "checkpointType": checkpoint_type, "numParameters": params})


def limit_bytes(spec) -> int:
    return int(download_size_limit(spec).removesuffix("Mi")) * MIB


# -- the types are the loader's ------------------------------------------------------------------------------------

def test_block_sizes_are_ggufs_own():
    assert GGML_BLOCKS == {name: gguf.GGML_QUANT_SIZES[QT[name]] for name in GGML_BLOCKS}


def test_gguf_types_are_llama_cpp_file_types_whose_every_block_type_the_engine_loads():
    from cpuserve.engine.loader.gguf import SUPPORTED_TYPES

    loaded = {t.name for t in SUPPORTED_TYPES}
    assert set(GGML_BLOCKS) == loaded
    for file_type, block_types in GGUF_LAYER_TYPES.items():
        assert ("ALL_" if file_type == "F32" else "MOSTLY_") + file_type in gguf.LlamaFileType.__members__
        assert set(block_types) <= loaded, file_type


def test_safetensors_types_are_the_loaders_schemes():
    from cpuserve.engine.loader import awq, compressed_tensors, gptq, safetensors

    bits = lambda prefix: {b for t, (b, _) in SAFETENSORS_QUANTIZED.items() if t.startswith(prefix)}  # noqa: E731
    assert bits("GPTQ-") == set(gptq.BITS) and bits("AWQ-") == {4} and bits("W") == set(compressed_tensors.BITS)
    assert awq.AwqFormat(group_size=32).bits == 4
    assert set(CHECKPOINT_TYPES["safetensors"]) - set(SAFETENSORS_QUANTIZED) == set(safetensors.SUPPORTED_DTYPES)


# -- the schema takes each type under its format, the finding refuses it under the other ---------------------------

@pytest.mark.parametrize("fmt,checkpoint_type", [("gguf", t) for t in CHECKPOINT_TYPES["gguf"]]
                         + [("safetensors", t) for t in CHECKPOINT_TYPES["safetensors"]])
def test_each_type_is_accepted_under_its_format(fmt, checkpoint_type):
    b = body(fmt, checkpoint_type)
    crd_validator().validate(b)
    spec, findings = validate(b, OperatorSettings())
    assert findings == [] and spec.model.checkpoint_type == checkpoint_type


@pytest.mark.parametrize("fmt,checkpoint_type", [("safetensors", t) for t in GGUF_ONLY]
                         + [("gguf", t) for t in SAFETENSORS_ONLY])
def test_a_type_of_the_other_format_is_refused_by_name(fmt, checkpoint_type):
    b = body(fmt, checkpoint_type)
    crd_validator().validate(b)  # the schema has one enum for both formats: the operator's finding tells them apart
    _, findings = validate(b, OperatorSettings())
    assert [str(f) for f in findings] == [
        f"spec.model.checkpointType={checkpoint_type!r}: not a {fmt} type; use one of "
        f"{', '.join(CHECKPOINT_TYPES[fmt])}"]


def test_an_unknown_type_is_refused_by_the_schema():
    with pytest.raises(jsonschema.ValidationError, match="IQ4_XS"):
        crd_validator().validate(body("gguf", "IQ4_XS"))


# -- real GGUF files -----------------------------------------------------------------------------------------------

def llama_quantize_type(file_type: str, name: str, shape: tuple[int, ...], n_layers: int) -> QT:
    """The block type llama.cpp's llama-quantize gives a tensor of a tied tiny Llama: bench/kquant_recipe.py's
    recipes (Q4_K_M, Q6_K); for a single-type file type its default type everywhere, but the tied embedding (the output)
    in Q6_K below Q8_0 (llama_tensor_get_type)."""
    _, kquant = engine_factories()
    recipe = kquant.bench_module("kquant_recipe")
    if file_type in recipe.RECIPES:
        return recipe.recipe_type(file_type, name, shape, n_layers, tie_embeddings=True)
    if len(shape) == 1:
        return QT.F32
    default = QT[file_type.removesuffix("_S")]  # Q3_K_S, Q5_K_S: every tensor in Q3_K, Q5_K
    return QT.Q6_K if name == "token_embd.weight" and file_type != "Q8_0" else default


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    gf, kquant = engine_factories()
    shape = kquant.SHAPE  # 256-wide rows: whole K-quant super-blocks
    files = {}
    for file_type in ("Q4_K_M", "Q6_K", "Q4_0", "Q5_1", "Q8_0", "Q3_K_S", "Q5_K_S"):
        weights = gf.make_llama_weights(shape, len(gf.tiny_vocab()[0]), seed=0)
        raw = {}
        for hf, array in list(weights.items()):
            if array.ndim == 2:
                name = gf.gguf_name(hf)
                qt = llama_quantize_type(file_type, name, array.shape, shape.n_layers)
                raw[name] = (kquant.real_blocks(qt.name, array.shape), qt)
                del weights[hf]
        files[file_type] = tmp_path_factory.mktemp(file_type) / "model.gguf"
        gf.write_llama_gguf(files[file_type], weights, shape, raw_tensors=raw)
    return files


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q6_K", "Q4_0", "Q5_1", "Q8_0", "Q3_K_S", "Q5_K_S"])
def test_a_gguf_files_bytes_are_within_its_types_size(gguf_files, file_type):
    path = gguf_files[file_type]
    tensors = gguf.GGUFReader(path).tensors
    params = sum(int(t.n_elements) for t in tensors)
    matrices = [t for t in tensors if len(t.shape) == 2]
    layers = [t for t in matrices if t.name.startswith("blk.")]
    outer = [t for t in matrices if not t.name.startswith("blk.")]
    per_param = lambda ts: sum(int(t.n_bytes) for t in ts) / sum(int(t.n_elements) for t in ts)  # noqa: E731
    assert per_param(layers) <= layer_rate(file_type)
    assert per_param(outer) <= outer_rate(file_type)
    assert sum(int(t.n_bytes) for t in matrices) / params <= stored_bytes(file_type, params) / params
    # the largest type in the file is the one it is sized at (but Q4_0's Q4_1 ffn_down, written with an importance
    # matrix only): the bound is no looser than the mixture needs
    if file_type != "Q4_0":
        assert max(int(t.n_bytes) / int(t.n_elements) for t in layers) == layer_rate(file_type)
    spec, _ = validate(body("gguf", file_type, params), OperatorSettings())
    assert path.stat().st_size <= limit_bytes(spec)


# -- a real GPTQ folder ----------------------------------------------------------------------------------------------

def test_a_gptq_folders_bytes_are_within_gptq_int4s_size(tmp_path):
    from safetensors import safe_open

    if str(ENGINE_TESTS) not in sys.path:
        sys.path.insert(0, str(ENGINE_TESTS))
    from arch_factory import build_hf_model, tiny_tokenizer
    from quant_factory import write_gptq

    model = build_hf_model("llama3", hidden_size=256, intermediate_size=1024).half()  # exports keep fp16 floats
    folder, _ = write_gptq(model, tmp_path / "gptq", tiny_tokenizer(tmp_path), group=32, sym=False,
                           act_order=True)
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        t = {name: f.get_tensor(name) for name in f.keys()}
    nbytes = lambda names: sum(t[n].numel() * t[n].element_size() for n in names)  # noqa: E731
    modules = [n.removesuffix(".qweight") for n in t if n.endswith(".qweight")]
    weights = sum(t[f"{m}.qweight"].numel() * 8 for m in modules)  # 8 codes of 4 bits an int32
    quantized = nbytes([f"{m}.{s}" for m in modules for s in ("qweight", "qzeros", "scales", "g_idx")])
    assert nbytes([f"{m}.{s}" for m in modules for s in ("qweight", "qzeros", "scales")]) == weights * (
        0.5 + (2 + 0.5) / 32)  # 4-bit codes, and per 32 inputs an fp16 scale and a 4-bit zero
    assert quantized / weights <= layer_rate("GPTQ-INT4")
    params = weights + sum(t[n].numel() for n in t if not n.startswith(tuple(modules)))
    assert nbytes(list(t)) <= stored_bytes("GPTQ-INT4", params)
    spec, _ = validate(body("safetensors", "GPTQ-INT4", max(params, 1_000_000)), OperatorSettings())
    assert sum(p.stat().st_size for p in Path(folder).iterdir()) <= limit_bytes(spec)


# -- real models' shapes ---------------------------------------------------------------------------------------------

# config.json: vocabulary, width, layers, heads, KV heads, head width, MLP width, tied embeddings
SHAPES = {
    "SmolLM2-135M": (49152, 576, 30, 9, 3, 64, 1536, True),
    "Qwen2.5-0.5B": (151936, 896, 24, 14, 2, 64, 4864, True),
    "Gemma-3-270M": (262144, 640, 18, 4, 1, 256, 2048, True),
    "Gemma-3-1B": (262144, 1152, 26, 4, 1, 256, 6912, True),
    "Qwen3-0.6B": (151936, 1024, 28, 16, 8, 128, 3072, True),
    "Llama-3.2-1B": (128256, 2048, 16, 32, 8, 64, 8192, True),
    "Gemma-3-4B": (262208, 2560, 34, 8, 4, 256, 10240, True),
    "Phi-3-mini": (32064, 3072, 32, 32, 32, 96, 8192, False),
    "Qwen2.5-7B": (152064, 3584, 28, 28, 4, 128, 18944, False),
    "Llama-3.1-8B": (128256, 4096, 32, 32, 8, 128, 14336, False),
    "Qwen3-8B": (151936, 4096, 36, 32, 8, 128, 12288, False),
    "Qwen3-14B": (151936, 5120, 40, 40, 8, 128, 17408, False),
    "Llama-3.1-70B": (128256, 8192, 80, 64, 8, 128, 28672, False),
}


def shape_tensors(name: str) -> tuple[list[tuple[str, int, int]], int, int]:
    """(GGUF name, N outputs, K inputs) of every matrix, the 1-D norms' parameters, and all the parameters."""
    vocab, d, layers, heads, kv, hd, ffn, tied = SHAPES[name]
    mats = [("token_embd.weight", vocab, d)] + ([] if tied else [("output.weight", vocab, d)])
    for i in range(layers):
        mats += [(f"blk.{i}.{n}", rows, cols) for n, rows, cols in (
            ("attn_q.weight", heads * hd, d), ("attn_k.weight", kv * hd, d), ("attn_v.weight", kv * hd, d),
            ("attn_output.weight", d, heads * hd), ("ffn_gate.weight", ffn, d), ("ffn_up.weight", ffn, d),
            ("ffn_down.weight", d, ffn))]
    norms = d * (2 * layers + 1)
    return mats, norms, sum(n * k for _, n, k in mats) + norms


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_embedding_bound_holds_for_real_models(name):
    mats, norms, params = shape_tensors(name)
    assert sum(n * k for m, n, k in mats if not m.startswith("blk.")) <= embedding_bound(params)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_gptq_and_awq_files_of_real_models_are_within_their_types_size(name):
    """GPTQ's layout: qweight B / 8 bytes a weight, per group of 32 inputs an fp16 scale and a B-bit zero, g_idx
    an int32 per input; embedding, lm_head and norms in fp16. AWQ: the same without g_idx."""
    mats, norms, params = shape_tensors(name)
    for checkpoint_type, bits, g_idx in (("GPTQ-INT4", 4, 4), ("GPTQ-INT8", 8, 4), ("AWQ-INT4", 4, 0)):
        size = 2 * norms
        for m, n, k in mats:
            size += 2 * n * k if not m.startswith("blk.") else n * k * bits / 8 + (n * k / 32) * (2 + bits / 8) + \
                g_idx * k
        assert size <= stored_bytes(checkpoint_type, params), checkpoint_type


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q6_K"])
def test_gguf_files_of_real_models_are_within_their_types_size(name, file_type):
    """llama.cpp's recipe (bench/kquant_recipe.py, with its fallbacks for rows that are not whole super-blocks):
    within the bound itself when every row is, else within the download's limit (its slack)."""
    _, kquant = engine_factories()
    recipe = kquant.bench_module("kquant_recipe")
    mats, norms, params = shape_tensors(name)
    layers, tied = SHAPES[name][2], SHAPES[name][7]
    size = 0  # of the matrices: the F32 norms are left to the slack
    for m, n, k in mats:
        values, block = gguf.GGML_QUANT_SIZES[recipe.recipe_type(file_type, m, (n, k), layers, tied)]
        size += n * k // values * block
    if all(k % 256 == 0 for _, _, k in mats):
        assert size <= stored_bytes(file_type, params)
    spec, _ = validate(body("gguf", file_type, params), OperatorSettings())
    assert size + 4 * norms <= limit_bytes(spec)
    assert math.isclose(stored_bytes(file_type, params) / params, layer_rate(file_type))  # no output term here
