"""Structured outputs: a request's constraint compiled once per spec, one matcher per request, token masks.

    StructuredOutput(kind, spec)  --grammar_of (cached; no tokenizer)-->  llguidance grammar text
    GrammarCompiler.matcher(so)   --one pristine LLMatcher per spec (cached), deep-copied per request-->  matcher
    sampler: fill_bitmasks(matchers) -> [R, V/32] int32, apply_bitmasks(logits rows) -> disallowed = -inf
    output processor: matcher.consume_token(token) after each sampled token

The engine is llguidance (docs/structured-outputs.md says why, with the measurements): it compiles a JSON schema
in ~1 ms and computes a mask over SmolLM2's 49152 tokens in ~11 us, with no GPU compiler among its dependencies.
Importing this module imports no torch: serving's ingress validates specs with `grammar_of` alone.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from cpuserve.engine.errors import InvalidRequest

KINDS = ("json_schema", "json_object", "regex", "grammar")
# JSON as json.dumps writes it: ", " and ": " and no other whitespace, so a small model cannot wander off into
# endless blank lines inside an object (flexible whitespace lets it)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARAM = "structured_output"  # the engine's name of the field; serving renames it to the client's (response_format)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output.

    kind: "json_schema" (spec = the schema as JSON text), "json_object" (any JSON object; spec unused),
    "regex" (spec = a regular expression the whole output matches) or "grammar" (spec = a Lark or GBNF grammar).
    """

    kind: str
    spec: str = ""

    @classmethod
    def of(cls, value: "StructuredOutput | dict") -> "StructuredOutput":
        return value if isinstance(value, cls) else cls(**value)


@functools.lru_cache(maxsize=512)
def grammar_of(kind: str, spec: str) -> str:
    """The llguidance grammar of a spec, checked (without a tokenizer); InvalidRequest names what is wrong."""
    if kind not in KINDS:
        raise InvalidRequest(PARAM, f"{PARAM}: kind={kind!r} is not one of {', '.join(KINDS)}")
    if kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    elif kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidRequest(PARAM, f"{PARAM}: the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(PARAM, f"{PARAM}: a JSON schema is an object, not {type(schema).__name__}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (TypeError, ValueError) as e:  # a value serde cannot take: an integer past 64 bits, ...
            raise InvalidRequest(PARAM, f"{PARAM}: the JSON schema is not usable: {e}") from None
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    else:
        try:
            lark = any_to_lark(spec)  # GBNF (llama.cpp's, vLLM's xgrammar form) becomes Lark; Lark stays as it is
        except Exception as e:  # noqa: BLE001 (the converter raises plain exceptions on bad GBNF)
            raise InvalidRequest(PARAM, f"{PARAM}: the grammar does not parse: {e}") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        what = {"json_schema": "the JSON schema", "regex": "the regex", "grammar": "the grammar"}.get(kind, kind)
        raise InvalidRequest(PARAM, f"{PARAM}: {what} is not usable: {error.strip()[:400]}")
    return grammar


class GrammarCompiler:
    """Matchers for one model's tokenizer: each spec compiled once (LRU), a deep copy per request.

    Thread-safe: requests are made on the serving loop's thread while the engine steps on its own.

    Args:
        tokenizer_json: the model's `tokenizers` tokenizer serialized (Tokenizer.backend.to_str()).
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the ids that end generation; a finished grammar allows only these.
        max_cached: how many compiled specs to keep.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: frozenset[int], max_cached: int = 256):
        self._args = (tokenizer_json, vocab_size, sorted(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use: ~0.2 s for 49k tokens
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def matcher(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one request's constraint (raises InvalidRequest for a bad spec)."""
        grammar = grammar_of(so.kind, so.spec)
        key = (so.kind, so.spec)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is None:
                pristine = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
                if pristine.is_error():
                    raise InvalidRequest(PARAM, f"{PARAM}: {pristine.get_error().strip()[:400]}")
                self._cache[key] = pristine
                if len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return pristine.deep_copy()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            text, vocab_size, eos = self._args
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        return self._tokenizer
