"""Hypothesis settings and value strategies shared by the fuzz tests (HTTP bodies, gRPC messages).

The short form (`make test`) runs a fixed number of examples, derandomized, so CI sees the same inputs every run;
CPUSERVE_FUZZ_SCALE=N (`make fuzz`: 10) runs N times as many, from a random seed (a failure prints the
@reproduce_failure line that replays it).
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from cpuserve.engine.settings import FUZZ_SCALE

SCALE = FUZZ_SCALE.get()


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples * SCALE, deadline=None, derandomize=SCALE == 1, database=None,
                    print_blob=True, suppress_health_check=list(HealthCheck))


# -- values ------------------------------------------------------------------------------------------------------
HUGE_INTS = st.sampled_from([2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100,
                             -(2**31) - 1, -(2**63) - 1, -(2**64)]) | st.integers(min_value=2**64, max_value=2**300)
NUMBERS = (st.integers(-5, 5) | st.integers() | HUGE_INTS | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1e308, 0.5, 1.5, 2.0, 100.0, 101.0]))
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800", "x\ud83d"])  # lone halves: valid JSON escapes
TEXT = st.text(max_size=40) | SURROGATES | st.sampled_from(["", " ", "0", "-1", "null", "true", "[]", "{}",
                                                            "Hello", "system", "user", "auto", "required", "none"])
LONG_TEXT = st.integers(1, 800).map(lambda n: "word " * n)  # past the fuzz app's context from ~40 words on
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT


def json_values(max_leaves: int = 12) -> st.SearchStrategy:
    """Any JSON value: scalars of every kind, lists and objects of them, a few levels deep."""
    return st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                        max_leaves=max_leaves)


def deep(depth: int, kind: str) -> object:
    """A JSON value nested `depth` levels: [[[...]]] or {"a": {"a": ...}}."""
    value: object = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


DEEP = st.builds(deep, st.integers(1, 500), st.sampled_from(["list", "dict"]))  # json.dumps takes it; deeper: raw
# a field's value: any JSON, very long text, very deep nesting
OVERSIZED = st.builds(lambda c, n: c * n, st.characters(), st.integers(1000, 80_000))  # past the body limit too
NASTY = json_values() | LONG_TEXT | OVERSIZED | DEEP


def dumps(value: object) -> bytes:
    """JSON text as a client would send it (ASCII escapes keep lone surrogates expressible)."""
    return json.dumps(value).encode()


@st.composite
def raw_bodies(draw, valid: dict) -> bytes:
    """Bytes for an HTTP body: random bytes, broken JSON, JSON that Python's parser takes but no standard does
    (NaN, huge exponents, 5000-digit integers), deep nesting, invalid UTF-8 spliced into a valid body."""
    text = dumps(valid)
    kind = draw(st.sampled_from(["bytes", "json", "mutate", "splice", "number", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return dumps(draw(json_values()))
    if kind == "mutate":  # a valid body, cut short or with one byte changed
        i = draw(st.integers(0, len(text) - 1))
        return text[:i] if draw(st.booleans()) else text[:i] + bytes([draw(st.integers(0, 255))]) + text[i + 1:]
    if kind == "splice":  # invalid UTF-8 inside a string of the body
        i = text.index(b'"', text.index(b":")) + 1
        return text[:i] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x00"])) \
            + text[i:]
    if kind == "number":
        field = draw(st.sampled_from(["max_tokens", "temperature", "seed", "top_k", "n", "priority", "logprobs"]))
        number = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 5000, "1e-400",
                                       "-0", "0.0e0", "1" * 400]))
        return text[:-1] + f', "{field}": {number}}}'.encode()
    depth = draw(st.integers(1, 40_000))  # past any parser's recursion limit, within the body limit
    if draw(st.booleans()):
        return b"[" * depth + b"]" * depth
    field = draw(st.sampled_from(["metadata", "guided_json", "prompt", "messages", "logit_bias", "tool_choice"]))
    return text[:-1] + f', "{field}": '.encode() + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
