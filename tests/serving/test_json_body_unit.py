"""serving/json_body.py: what Python's json module takes but a request body must not (each found by the fuzz tests in
tests/serving/fuzz, where it answered 500 or named no field), refused with the field or "body" named."""

from __future__ import annotations

import pytest

from cpuserve.serving.json_body import MAX_DEPTH, load_object
from cpuserve.serving.protocol import RequestError

REFUSED = [  # (id, body, param)
    ("not UTF-8", b'{"prompt": "caf\xe9"}', "body"),
    ("not an object", b"[1]", "body"),
    ("deeper than the parser recurses", b"[" * 50_000 + b"]" * 50_000, "body"),
    ("deeper than the limit", b'{"metadata": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", "metadata"),
    ("NaN", b'{"temperature": NaN}', "body"),
    ("Infinity", b'{"temperature": -Infinity}', "body"),
    ("past a double", b'{"temperature": 1e400}', "body"),
    ("5000 digits", b'{"seed": ' + b"9" * 5000 + b"}", "body"),
    ("lone surrogate in a value", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("lone surrogate deep in a value", b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages.0.content"),
    ("lone surrogate in a key", b'{"prompt": "hi", "\\ud800": 1}', "body"),
    ("lone surrogate in a nested key", b'{"metadata": {"\\ud800": 1}}', "metadata"),
]


@pytest.mark.parametrize("body,param", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused(body, param):
    with pytest.raises(RequestError) as info:
        load_object(body)
    assert info.value.param == param and info.value.message


def test_taken():
    body = b'{"prompt": "\\ud83d\\ude00 caf\xc3\xa9", "seed": ' + b"9" * 4000 + b', "x": ' + b"[" * MAX_DEPTH + \
        b"]" * MAX_DEPTH + b', "t": 1e308, "n": -0}'
    data = load_object(body)
    assert data["prompt"] == "\U0001F600 café" and data["seed"] == int("9" * 4000) and data["t"] == 1e308
