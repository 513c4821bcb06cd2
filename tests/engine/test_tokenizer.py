"""Tokenizers built from GGUF metadata (the SmolLM2 file; synthetic SentencePiece and o200k files) vs transformers'
tokenizer loaded from the same file."""

from __future__ import annotations

import os
from functools import partial

import pytest

from cpuserve.engine.loader import default_model_path, load_checkpoint
from cpuserve.engine.detokenizer import IncrementalDetokenizer
from cpuserve.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "3.14159265358979 and 1,000,000 and 2024-06-01",
    "Numbers: 0123456789 9876543210",
    "naïve café résumé — “quotes” ‘single’",
    "日本語のテキストと中文文本",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "   leading spaces and trailing   ",
    "tabs\tand\n\nnewlines\r\n mixed  \t ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text <|endoftext|> more text",
    "I'm sure you're right, they'll see we've done it.",
    "ALL CAPS and MiXeD CaSe and snake_case_names",
    "URL: https://example.com/path?query=1&x=2#frag",
    "Математика и физика",
    "مرحبا بالعالم",
    "",
    " ",
    "a" * 50,
    "x = [1, 2, 3]  # comment\n\t\tindented",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke 😀"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_checkpoint(show_progress=False).tokenizer


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, reference, text):
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours, reference, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens_stay_whole(ours):
    im_start, im_end = ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")
    assert ours.encode("<|im_start|>x<|im_end|>")[0] == im_start
    assert ours.encode("<|im_start|>x<|im_end|>")[-1] == im_end
    assert ours.is_special(im_end) and not ours.is_special(ours.encode("x")[0])
    assert ours.decode([im_start] + ours.encode("x") + [im_end]) == "x"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, messages, add_generation_prompt):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_special_ids(ours, reference):
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
    assert reference.eos_token_id in ours.eos_token_ids
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.vocab_size == len(reference) == 49152


def test_missing_chat_template_is_a_clear_error(ours):
    bare = Tokenizer(ours.backend, bos_token_id=None, eos_token_ids=frozenset(), chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


STREAM_TEXTS = ["Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷!", "日本語のテキストと中文文本。", "mixed ascii ✓ and 한국어 and 🦀 rust", "plain"]


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_incremental_detokenizer(ours, text, with_prompt):
    ids = ours.encode(text, add_special_tokens=False)
    # the test must exercise split characters: some token must decode to a partial character on its own
    if text != "plain":
        assert any("\ufffd" in ours.decode([i]) for i in ids)
    prompt = ours.encode("<|im_start|>assistant\n") if with_prompt else None
    detok = IncrementalDetokenizer(ours, prompt_ids=prompt)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == ours.decode(ids) == text


def test_incremental_detokenizer_skips_special_tokens(ours):
    ids = ours.encode("hi 😀") + [ours.token_to_id("<|im_end|>")]
    detok = IncrementalDetokenizer(ours)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == "hi 😀"
    keep = IncrementalDetokenizer(ours, skip_special_tokens=False)
    assert "".join(keep.add(i) for i in ids) + keep.flush() == "hi 😀<|im_end|>"


def test_incremental_detokenizer_flushes_an_unfinished_character(ours):
    ids = ours.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(ours)
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)  # held back, not emitted broken
    assert detok.flush() == ours.decode(ids[:-1])


SPM_TEXTS = ["hello world", "hello, wörld 😀", "  hello  world ", "hell", "</s>hello<s>", "\n", "h", "world hello"]


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    """A SentencePiece-style GGUF (tokenizer.ggml.model 'llama': scores, byte fallback), ours and transformers'."""
    transformers = pytest.importorskip("transformers")
    import gguf_factory as gf

    folder = tmp_path_factory.mktemp("spm")
    tokens, _, _ = gf.spm_vocab()
    weights = gf.make_llama_weights(gf.TINY, len(tokens))
    gf.write_llama_gguf(folder / "spm.gguf", weights, gf.TINY, tokenizer=gf.add_spm_tokenizer)
    ours = load_checkpoint(str(folder / "spm.gguf"), show_progress=False).tokenizer
    return ours, transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="spm.gguf")


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_gguf_matches_transformers(spm_pair, text):
    ours, reference = spm_pair
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ids[0] == ours.bos_token_id == 1  # SentencePiece vocabularies get BOS unless the file says not
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(ours)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert not any("\ufffd" in d for d in deltas) and "".join(deltas) == ours.decode(ids)


# Phi-4-mini's GGUF: tokenizer.ggml.pre 'gpt-4o' (o200k). The comments name what o200k splits unlike llama3.
O200K_TEXTS = [
    "HelloWorld and camelCaseName and XMLHttpRequest",  # a new word at each lower -> upper change
    "don't DON'T I'M she's HE'LL we'VE",  # the contraction stays on its word, in any case
    "I'm sure you're right, they'll see we've done it.",
    "1234567 and 3.14159 and 2024-06-01",
    "日本語のテキストと中文文本",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "naïve ÉCOLE Élan cafe\u0301",  # non-ASCII cases; a combining mark (\p{M}) inside a word
    "   leading spaces and trailing   ",
    "\n\n  x",
    "tabs\tand\n\nnewlines\r\n mixed  \t ",
    "!!! ?!... --- a//b ///path/to\n(x)",
    "<|user|>Hi there<|end|><|assistant|>",
    "",
    " ",
]
O200K_CONTROLS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]


def _write_bpe_gguf(folder, pre: str) -> str:
    import gguf_factory as gf

    vocab = gf.trained_bpe_vocab(O200K_TEXTS, O200K_CONTROLS)
    tokenizer = partial(gf.add_bpe_tokenizer, vocab=vocab, pre=pre, eos="<|endoftext|>")
    path = folder / f"{pre}.gguf"
    gf.write_llama_gguf(path, {}, gf.TINY, arch="phi3", tokenizer=tokenizer, vocab_size=len(vocab[0]))
    return str(path)


@pytest.fixture(scope="module")
def o200k_pair(tmp_path_factory):
    """A phi3 GGUF with a byte-level BPE vocabulary and pre 'gpt-4o', ours and transformers'."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("o200k")
    path = _write_bpe_gguf(folder, "gpt-4o")
    ours = load_checkpoint(path, show_progress=False).tokenizer
    return ours, transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("text", O200K_TEXTS)
def test_gpt4o_gguf_matches_transformers(o200k_pair, text):
    ours, reference = o200k_pair
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def llama3_split(tmp_path_factory) -> Tokenizer:
    """The same vocabulary under pre 'llama-bpe'."""
    path = _write_bpe_gguf(tmp_path_factory.mktemp("llama3"), "llama-bpe")
    return load_checkpoint(path, show_progress=False).tokenizer


@pytest.mark.parametrize("text", [*O200K_TEXTS[:3], O200K_TEXTS[6], "XMLHttpRequest", "don't", "I'M", "HE'LL"])
def test_gpt4o_is_not_llama3s_split(o200k_pair, llama3_split, text):
    # the vocabulary's merges cross llama3's boundaries, so its split gives other ids where the two regexes differ:
    # a case change inside a word, a contraction, a combining mark
    ours, reference = o200k_pair
    assert ours.encode(text) == reference.encode(text) != llama3_split.encode(text)


def test_unsupported_pre_tokenizer_is_refused(tmp_path):
    path = _write_bpe_gguf(tmp_path, "tekken")
    with pytest.raises(ValueError) as err:
        load_checkpoint(path, show_progress=False)
    message = str(err.value)
    assert path in message and "tokenizer.ggml.pre='tekken'" in message
    assert "supported: [" in message and "'gpt-4o'" in message and "'llama-bpe'" in message
