"""Plain-dict helpers of the fake API server: merge patch, label selectors, dotted paths."""
from __future__ import annotations

import copy
from typing import Any


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def get_path(obj: dict[str, Any], dotted: str) -> Any:
    for part in dotted.strip(".").split("."):
        obj = (obj or {}).get(part)
    return obj


def set_path(obj: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.strip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value
