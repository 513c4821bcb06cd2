"""The LLMService spec and the head's ServeConfig agree through one table (serve_document.SERVE_FIELDS_FROM_SPEC):
both ends of every row exist, every spec field is in the table or says where it goes instead, and every value the
CRD allows in a row's field is one ServeConfig's field allows (choices and bounds read from both models), and both
describe it with the one help text the option is declared with."""
from __future__ import annotations

import math
import typing

import annotated_types
import pytest
from pydantic import BaseModel
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from cpuserve.operator.crd import build_crd, option_help
from cpuserve.operator.serve_document import HEAD_FIELDS, SERVE_FIELDS_FROM_SPEC, SPEC_ELSEWHERE, spec_value
from cpuserve.operator.spec import LLMServiceSpec
from cpuserve.serving.config import ServeConfig


def leaves(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    """Every field of the spec that is not itself a spec object, by dotted path."""
    found = {}
    for name, info in model.model_fields.items():
        inner = [a for a in (info.annotation, *typing.get_args(info.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        found.update(leaves(inner[0], f"{prefix}{name}.") if inner else {f"{prefix}{name}": info})
    return found


SPEC_FIELDS = leaves(LLMServiceSpec)


def choices(info: FieldInfo) -> set | None:
    """A Literal's values (None allowed too when optional), or None for a field without choices."""
    args = typing.get_args(info.annotation)
    literal = [a for a in (info.annotation, *args) if typing.get_origin(a) is typing.Literal]
    if not literal:
        return None
    return set(typing.get_args(literal[0])) | ({None} if type(None) in args else set())


def bounds(info: FieldInfo) -> tuple[float, float]:
    """(lowest, highest) value allowed; a strict bound nudged inward by a hair."""
    lo, hi = -math.inf, math.inf
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            lo = max(lo, m.ge)
        elif isinstance(m, annotated_types.Gt):
            lo = max(lo, math.nextafter(m.gt, math.inf))
        elif isinstance(m, annotated_types.Le):
            hi = min(hi, m.le)
        elif isinstance(m, annotated_types.Lt):
            hi = min(hi, math.nextafter(m.lt, -math.inf))
    return lo, hi


def test_both_ends_of_every_row_exist_and_the_head_fields_are_serve_config_fields():
    assert set(SERVE_FIELDS_FROM_SPEC) <= set(ServeConfig.model_fields)
    assert set(SERVE_FIELDS_FROM_SPEC.values()) <= set(SPEC_FIELDS)
    assert set(HEAD_FIELDS) <= set(ServeConfig.model_fields) and not set(HEAD_FIELDS) & set(SERVE_FIELDS_FROM_SPEC)
    ServeConfig.for_another_host(**HEAD_FIELDS)


def test_every_spec_field_is_in_the_table_or_goes_elsewhere():
    def placed(path: str) -> bool:
        return path in SERVE_FIELDS_FROM_SPEC.values() or any(
            path == other or path.startswith(other + ".") for other in SPEC_ELSEWHERE)

    assert [path for path in SPEC_FIELDS if not placed(path)] == []
    assert [other for other in SPEC_ELSEWHERE if not any(p == other or p.startswith(other + ".")
                                                         for p in SPEC_FIELDS)] == []  # no stale row


@pytest.mark.parametrize("serve_name,path", SERVE_FIELDS_FROM_SPEC.items(), ids=list(SERVE_FIELDS_FROM_SPEC))
def test_every_value_the_crd_allows_serve_config_allows(serve_name, path):
    crd, serve = SPEC_FIELDS[path], ServeConfig.model_fields[serve_name]
    if (wanted := choices(serve)) is not None:
        assert choices(crd) is not None and choices(crd) <= wanted
    (crd_lo, crd_hi), (lo, hi) = bounds(crd), bounds(serve)
    assert lo <= crd_lo and crd_hi <= hi, f"{path} allows [{crd_lo}, {crd_hi}], {serve_name} [{lo}, {hi}]"


def test_the_table_reads_the_spec():
    spec = LLMServiceSpec.model_validate({"model": {"source": "embedded"}, "batching": {"maxQueuedTokens": 7},
                                          "ports": {"http": 8100}})
    assert spec_value(spec, SERVE_FIELDS_FROM_SPEC["max_queued_tokens"]) == 7
    assert spec_value(spec, SERVE_FIELDS_FROM_SPEC["http_port"]) == 8100


def test_the_table_reads_nothing_under_an_object_not_set():
    """spec.speculative and its draft are optional objects: a service without them passes none of their options,
    so the head serves with `cpuserve serve`'s defaults and its args stay what they were."""
    spec = LLMServiceSpec.model_validate({"model": {"source": "embedded"}, "speculative": {"method": "ngram"}})
    assert spec_value(spec, SERVE_FIELDS_FROM_SPEC["speculative"]) == "ngram"
    assert spec_value(spec, SERVE_FIELDS_FROM_SPEC["spec_draft_kv_cache_gb"]) is None
    off = LLMServiceSpec.model_validate({"model": {"source": "embedded"}})
    assert [spec_value(off, path) for path in SERVE_FIELDS_FROM_SPEC.values() if path.startswith("speculative.")] == \
        [None] * 5


@pytest.mark.parametrize("serve_name,path", [("spec_tokens", "speculative.tokens"),
                                             ("spec_max_batch", "speculative.max_batch"),
                                             ("spec_draft_kv_cache_gb", "speculative.draft.kv_cache_gb")])
def test_speculative_defaults_are_the_engines(serve_name, path):
    """An omitted spec.speculative.draft passes no option: the engine's defaults then apply, and memory.py sizes the
    draft with the spec's, so they must be one."""
    assert SPEC_FIELDS[path].default == ServeConfig.model_fields[serve_name].default


def crd_description(path: str) -> str:
    node = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for name in path.split("."):
        node = node["properties"][to_camel(name)]
    return node["description"]


@pytest.mark.parametrize("serve_name,path", SERVE_FIELDS_FROM_SPEC.items(), ids=list(SERVE_FIELDS_FROM_SPEC))
def test_the_crd_and_serve_config_describe_a_row_with_the_options_one_help(serve_name, path):
    help = option_help(serve_name)
    assert len(help) > 10
    assert ServeConfig.model_fields[serve_name].description.startswith(help)
    assert crd_description(path).startswith(help)
    own = SPEC_FIELDS[path].description  # only what holds on Kubernetes, never the option's help again
    assert own is None or help not in own
