"""Write small synthetic GGUF files for loader tests, with the `gguf` package as llama.cpp's converter does.

    weights = make_llama_weights(TINY, seed=0)           # HF names and layout, fp32 numpy
    write_llama_gguf(path, weights, TINY, qtype="Q8_0")   # permutes Q/K like llama.cpp, quantizes, writes
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType

# a tiny byte-level BPE vocabulary: the 256 byte symbols, three chat control tokens, a few merges
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


@dataclass(frozen=True)
class Shape:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 96
    ctx: int = 256


TINY = Shape()


def byte_alphabet() -> list[str]:
    """GPT-2's 256 byte symbols, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny vocabulary."""
    tokens = _SPECIALS + byte_alphabet() + ["".join(m.split(" ")) for m in _MERGES]
    types = [3] * len(_SPECIALS) + [1] * (len(tokens) - len(_SPECIALS))
    return tokens, types, list(_MERGES)


def make_llama_weights(shape: Shape, vocab_size: int, seed: int = 0, tie: bool = True,
                       qkv_bias: bool = False) -> dict[str, np.ndarray]:
    """Random fp32 weights in HF LlamaForCausalLM names and layout, ~N(0, 0.02) (norms ~1)."""
    rng = np.random.default_rng(seed)
    head_dim = shape.dim // shape.n_heads
    w = lambda *s: rng.normal(0.0, 0.02, size=s).astype(np.float32)  # noqa: E731
    norm = lambda: (1.0 + rng.normal(0.0, 0.1, size=shape.dim)).astype(np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": w(vocab_size, shape.dim)}
    for i in range(shape.n_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm()
        out[p + "self_attn.q_proj.weight"] = w(shape.n_heads * head_dim, shape.dim)
        out[p + "self_attn.k_proj.weight"] = w(shape.n_kv_heads * head_dim, shape.dim)
        out[p + "self_attn.v_proj.weight"] = w(shape.n_kv_heads * head_dim, shape.dim)
        out[p + "self_attn.o_proj.weight"] = w(shape.dim, shape.n_heads * head_dim)
        if qkv_bias:  # Qwen2
            out[p + "self_attn.q_proj.bias"] = w(shape.n_heads * head_dim)
            out[p + "self_attn.k_proj.bias"] = w(shape.n_kv_heads * head_dim)
            out[p + "self_attn.v_proj.bias"] = w(shape.n_kv_heads * head_dim)
        out[p + "post_attention_layernorm.weight"] = norm()
        out[p + "mlp.gate_proj.weight"] = w(shape.ffn_dim, shape.dim)
        out[p + "mlp.up_proj.weight"] = w(shape.ffn_dim, shape.dim)
        out[p + "mlp.down_proj.weight"] = w(shape.dim, shape.ffn_dim)
    out["model.norm.weight"] = norm()
    if not tie:
        out["lm_head.weight"] = w(vocab_size, shape.dim)
    return out


_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert: per head, interleave the two rotary halves into pairs (HF -> GGUF)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tiny_tokenizer(writer: gguf.GGUFWriter, chat_template: str | None = CHAT_TEMPLATE) -> None:
    tokens, types, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def trained_bpe_vocab(corpus: list[str],
                      controls: tuple[str, ...] | list[str] = ()) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE trained on `corpus` with no pre-split, then the controls.

    Unsplit, the merges run across every word, case, digit and space boundary of the corpus, so a pre-tokenizer
    that draws one boundary differently gives different ids on that text.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.train_from_iterator(corpus, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + list(controls)
    types = [1] * (len(tokens) - len(controls)) + [3] * len(controls)
    return tokens, types, [" ".join(pair) for pair in model["merges"]]


def add_bpe_tokenizer(writer: gguf.GGUFWriter, vocab: tuple[list[str], list[int], list[str]], pre: str,
                      eos: str | None = None) -> None:
    """A byte-level BPE vocabulary (tokenizer.ggml.model 'gpt2') with the given pre-tokenizer name."""
    tokens, types, merges = vocab
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if eos is not None:
        writer.add_bos_token_id(tokens.index(eos))
        writer.add_eos_token_id(tokens.index(eos))
    writer.add_add_bos_token(False)


_SPM_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", ",", "he", "ll", "\u2581h", "\u2581he", "hell", "\u2581hell",
               "\u2581hello", "\u2581w", "or", "\u2581wor", "\u2581worl", "\u2581world"]


def spm_vocab(controls: tuple[str, ...] | list[str] = ()) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a tiny SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens, pieces, then
    the given extra control tokens (Gemma's turn markers)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_PIECES + list(controls)
    types = [2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES) + [3] * len(controls)
    # longer pieces score higher so they win merges, as in a trained model
    scores = [0.0] * 259 + [-10.0 + len(p) - i * 0.01 for i, p in enumerate(_SPM_PIECES)] + [0.0] * len(controls)
    return tokens, scores, types


def add_spm_tokenizer(writer: gguf.GGUFWriter, controls: tuple[str, ...] | list[str] = (),
                      chat_template: str | None = None) -> None:
    tokens, scores, types = spm_vocab(controls)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def add_llama_metadata(writer: gguf.GGUFWriter, shape: Shape, vocab_size: int, theta: float = 10000.0,
                       head_dim: int | None = None, norm_eps: float = 1e-5, rope_dims: int | None = None) -> None:
    """head_dim: written as key/value length when it is not dim / n_heads (Qwen3); rope_dims: the dims RoPE rotates
    when not the whole head (Phi-4-mini)."""
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_context_length(shape.ctx)
    writer.add_embedding_length(shape.dim)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.ffn_dim)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_dimension_count(rope_dims or head_dim or shape.dim // shape.n_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(norm_eps)
    writer.add_vocab_size(vocab_size)


def add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: QT) -> None:
    """Quantize (or cast) and add; 1-D norms stay F32 as llama.cpp keeps them."""
    if array.ndim == 1 or qtype == QT.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == QT.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:  # BF16 and block types: uint8 blocks from gguf.quants; the writer derives the element shape from them
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_llama_gguf(path, weights: dict[str, np.ndarray], shape: Shape, qtype: str = "F32", arch: str = "llama",
                     raw_tensors: dict[str, tuple[np.ndarray, QT]] | None = None, theta: float = 10000.0,
                     tokenizer=add_tiny_tokenizer, rope_dims: int | None = None,
                     vocab_size: int | None = None) -> None:
    """Write `weights` (HF layout) as a GGUF with the tiny tokenizer; raw_tensors are added as given.

    Only arch "llama" gets llama.cpp's Q/K permutation (qwen2 files keep HF's order). vocab_size: the count of the
    tokens `tokenizer` writes, when it is neither the tiny nor the SentencePiece vocabulary.
    """
    if vocab_size is None:
        vocab_size = len(tiny_vocab()[0] if tokenizer is add_tiny_tokenizer else spm_vocab()[0])
    writer = gguf.GGUFWriter(str(path), arch)
    add_llama_metadata(writer, shape, vocab_size, theta, rope_dims=rope_dims)
    tokenizer(writer)
    for hf, array in weights.items():
        if arch != "llama":
            pass
        elif hf.endswith("q_proj.weight"):
            array = permute_qk(array, shape.n_heads)
        elif hf.endswith("k_proj.weight"):
            array = permute_qk(array, shape.n_kv_heads)
        add_tensor(writer, gguf_name(hf), array, QT[qtype])
    for name, (data, raw_type) in (raw_tensors or {}).items():  # uint8 blocks [rows, bytes], any type
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
