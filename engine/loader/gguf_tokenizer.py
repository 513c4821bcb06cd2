"""Build a `tokenizers.Tokenizer` from the vocabulary a GGUF file stores as metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one (tokenizer.ggml.*): the tokens, the
BPE merges (or SentencePiece scores), each token's type, and the name of the pre-tokenizer the merges were
learned with (tokenizer.ggml.pre). We rebuild the Hugging Face tokenizer that description stands for.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from cpuserve.engine.tokenizer import END_OF_TURN_TEXTS, Tokenizer

# llama.cpp token types (llama_token_type): which ids are control tokens or user-added words
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k (GPT-4o, Phi-4-mini): a word is an optional leading non-letter, then upper-case letters and/or lower-case ones
# (an upper-case letter after a lower-case one starts a new word: "HelloWorld" -> "Hello" "World"), with any contraction suffix
# kept on the word ("don't", "I'M"); marks (\p{M}) inside words; 1-3 digit runs
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(split: str | None = None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    # split=None: ByteLevel's built-in GPT-2 regex; otherwise the model's own regex, then bytes -> symbols
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


# tokenizer.ggml.pre -> (pre-tokenizer, ignore_merges). Names as llama.cpp's convert_hf_to_gguf.py writes them.
PRE_TOKENIZERS = {
    "default": lambda: (_byte_level(), False),
    "gpt-2": lambda: (_byte_level(), False),
    "smollm": lambda: (_byte_level(digits=True), False),  # SmolLM's tokenizer.json splits every digit
    "llama-bpe": lambda: (_byte_level(_LLAMA3_SPLIT), True),
    "llama3": lambda: (_byte_level(_LLAMA3_SPLIT), True),
    "llama-v3": lambda: (_byte_level(_LLAMA3_SPLIT), True),
    "qwen2": lambda: (_byte_level(_QWEN2_SPLIT), False),
    "deepseek-r1-qwen": lambda: (_byte_level(_QWEN2_SPLIT), False),
    # merges are applied, not skipped for whole-vocabulary words: llama.cpp ignores merges for the llama3 family only
    "gpt-4o": lambda: (_byte_level(_GPT4O_SPLIT), False),
}


def _bpe_backend(meta: dict[str, Any], path: str) -> BackendTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre={pre!r} is not supported (it decides how text is split before BPE); "
            f"supported: {sorted(PRE_TOKENIZERS)}"
        )
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]()
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    # byte-level symbols never contain a plain space, so each merge line is exactly "left right"
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    if pre in ("qwen2", "deepseek-r1-qwen"):
        backend.normalizer = normalizers.NFC()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    # SentencePiece files store scores, not merges: every split of a token into two vocabulary pieces is a
    # merge, ranked by the merged token's score (higher merges first), as transformers' generate_merges does.
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_backend(meta: dict[str, Any]) -> BackendTokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    vocab = {token: i for i, token in enumerate(tokens)}
    model = BPE(
        vocab=vocab,
        merges=_sentencepiece_merges(tokens, scores),
        unk_token=tokens[unk_id],
        fuse_unk=True,
        byte_fallback=True,  # characters outside the vocabulary become <0xNN> byte tokens
    )
    backend = BackendTokenizer(model)
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    prepend = "first" if add_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1))  # drop the space the encoder prepended
    backend.decoder = decoders.Sequence(steps)
    return backend


def _byte_alphabet() -> set[str]:
    # GPT-2's byte -> printable symbol table: printable Latin-1 map to themselves, the rest to U+0100 onwards
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    return {chr(b) for b in printable} | {chr(256 + n) for n in range(256 - len(printable))}


def _add_special_tokens(backend: BackendTokenizer, meta: dict[str, Any], byte_level: bool) -> None:
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    special_types = (TOKEN_TYPE_CONTROL,) if byte_level else (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
    control = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in special_types]
    # user-defined words (e.g. <think>) are matched whole but are ordinary text
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    if byte_level:
        # a control token spelled outside the byte alphabet is a converter mislabel; it would not round-trip
        alphabet = _byte_alphabet()
        control = [a for a in control if set(a.content) <= alphabet]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _set_post_processor(backend: BackendTokenizer, meta: dict[str, Any], tokens: list[str], add_bos: bool) -> None:
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    add_bos = add_bos and bos_id is not None
    if not (add_bos or add_eos):
        return
    head = [f"{tokens[bos_id]}"] if add_bos else []
    tail = [f"{tokens[eos_id]}"] if add_eos else []
    single = " ".join(head + ["$A"] + tail)
    pair = " ".join(head + ["$A"] + tail + ["$B:1"] + tail)
    special = [(tokens[i], i) for i, on in ((bos_id, add_bos), (eos_id, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_gguf_tokenizer(meta: dict[str, Any], path: str) -> Tokenizer:
    """The Tokenizer a GGUF file's tokenizer.* metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _bpe_backend(meta, path)
    elif kind == "llama":
        backend = _sentencepiece_backend(meta)
    else:
        raise ValueError(
            f"{path}: tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    _add_special_tokens(backend, meta, byte_level=kind == "gpt2")
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise, never to BPE ones
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    _set_post_processor(backend, meta, tokens, add_bos)

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = {meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta}
    types = meta.get("tokenizer.ggml.token_type") or []
    eos_ids |= {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL and tokens[i] in END_OF_TURN_TEXTS}
    texts = {name: tokens[meta[key]] for name, key in _TEMPLATE_TOKENS.items() if meta.get(key) is not None}
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=frozenset(eos_ids),
        chat_template=meta.get("tokenizer.chat_template"),
        special_token_texts=texts,
    )


# template variables -> GGUF keys holding the token id
_TEMPLATE_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
