"""An HTTP request body as a JSON object, strictly: UTF-8, RFC 8259 JSON, bounded nesting, Unicode text.

Python's json module is laxer than the standard in ways that reached the request models: it takes NaN and Infinity,
turns 1e400 into inf, refuses integers of over 4300 digits with a ValueError, recurses until RecursionError on deep
nesting, and decodes "\\ud800" into a lone surrogate that no UTF-8 encoder (the tokenizer's, the response's) takes.
Each is refused here with a RequestError naming the body or the field.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from cpuserve.serving.protocol import RequestError

MAX_DEPTH = 64  # levels of nesting under the body: a JSON schema or tool parameters need far fewer
_INT_DIGITS = sys.get_int_max_str_digits() or 4300


def load_object(body: bytes) -> dict[str, Any]:
    """Bytes of an HTTP body -> the JSON object it holds, or RequestError (param "body", or the field's path)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"body is not valid UTF-8 (byte {e.start})", "body") from None
    try:
        data = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as e:
        raise RequestError(f"body is not valid JSON: {e}", "body") from None
    except RecursionError:
        raise RequestError(f"body is nested too deeply: the limit is {MAX_DEPTH} levels", "body") from None
    if not isinstance(data, dict):
        raise RequestError(f"body must be a JSON object, not {type(data).__name__}", "body")
    _check_tree(data)
    return data


def _constant(name: str) -> float:
    raise RequestError(f"body is not valid JSON: {name} is not a JSON number", "body")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestError(f"body: the number {text[:40]} is out of range of a double", "body")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > _INT_DIGITS:
        raise RequestError(f"body: an integer of {len(text)} digits is out of range", "body")
    return int(text)


def _check_tree(data: dict[str, Any]) -> None:
    """Depth and text of every value, without recursion; errors name the top-level field (messages.0.content)."""
    stack: list[tuple[Any, list[str]]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise RequestError(f"{json.dumps(path[0])}: nested more than {MAX_DEPTH} levels deep", path[0])
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path + [key])
                stack.append((item, path + [key]))
        elif isinstance(value, list):
            stack.extend((item, path + [str(i)]) for i, item in enumerate(value))


def _check_text(text: str, path: list[str]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        while path and not _is_unicode(path[-1]):  # a bad key: name the object holding it
            path = path[:-1]
        where = ".".join(path) or "body"
        raise RequestError(f"{where}: text holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}); send "
                           "valid Unicode", where) from None


def _is_unicode(text: str) -> bool:
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
