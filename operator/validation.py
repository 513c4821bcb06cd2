"""Checks an OpenAPI schema cannot express. Each finding names the field, the value and what would be right."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cpuserve.operator.checkpoints import CHECKPOINT_TYPES
from cpuserve.operator.memory import MIB, plan_memory
from cpuserve.operator.naming import MAX_NAME_LENGTH, RAY_GCS_PORT
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.spec import LLMServiceSpec

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ARCHIVES = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True, slots=True)
class Finding:
    field: str
    value: Any
    message: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}: {self.message}"


def parse_spec(body: dict[str, Any]) -> tuple[LLMServiceSpec | None, list[Finding]]:
    """The typed spec, or the schema findings (these pass the API server only if the CRD is stale)."""
    try:
        return LLMServiceSpec.model_validate(body.get("spec") or {}), []
    except ValidationError as err:
        findings = [Finding("spec." + ".".join(str(p) for p in e["loc"]), e.get("input"), e["msg"])
                    for e in err.errors()]
        return None, findings


def check_name(name: str) -> list[Finding]:
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035.match(name):
        return [Finding("metadata.name", name, f"must be a DNS-1035 label of at most {MAX_NAME_LENGTH} "
                        "characters (lower-case letters, digits, '-', starting with a letter)")]
    return []


def _check_model(spec: LLMServiceSpec) -> list[Finding]:
    m, out = spec.model, []
    if m.source == "embedded" and m.format != "gguf":
        out.append(Finding("spec.model.format", m.format, "the embedded model is gguf"))
    if m.source == "pvc":
        if not m.claim_name:
            out.append(Finding("spec.model.claimName", None, "required when spec.model.source is pvc"))
        if not m.path:
            out.append(Finding("spec.model.path", None, "required when spec.model.source is pvc"))
    if m.source == "url":
        if not m.url:
            out.append(Finding("spec.model.url", None, "required when spec.model.source is url"))
        elif m.format == "safetensors" and not m.url.split("?")[0].endswith(_ARCHIVES):
            out.append(Finding("spec.model.url", m.url, "a safetensors folder is fetched as .tar, .tar.gz or .tgz"))
    if m.checkpoint_type and m.checkpoint_type not in CHECKPOINT_TYPES[m.format]:
        out.append(Finding("spec.model.checkpointType", m.checkpoint_type,
                           f"not a {m.format} type; use one of {', '.join(CHECKPOINT_TYPES[m.format])}"))
    if m.source != "embedded" and m.num_parameters is None:
        out.append(Finding("spec.model.numParameters", None,
                           f"required when spec.model.source is {m.source} (it sizes each rank's memory)"))
    return out


def _check_quantization(spec: LLMServiceSpec) -> list[Finding]:
    q = spec.quantization
    if q.activations == "int8-token" and q.weights != "int8":
        return [Finding("spec.quantization.activations", q.activations,
                        f"one scale per token needs per-channel weights: set spec.quantization.weights int8 "
                        f"(it is {q.weights}), or activations int8")]
    return []


def _check_speculative(spec: LLMServiceSpec) -> list[Finding]:
    """The engine's own refusals (engine/config.py EngineConfig._check_speculative), and a draft's place: the model's
    claim, the only volume of the pods' /models that a path can name."""
    s, out = spec.speculative, []
    if s is None:
        return out
    if s.draft is not None and s.method != "draft":
        out.append(Finding("spec.speculative.draft", s.draft.model_dump(by_alias=True, exclude_unset=True),
                           f"a draft model is method draft's (it is {s.method}): set spec.speculative.method draft, "
                           "or remove spec.speculative.draft"))
    if s.draft is not None and s.draft.path is not None:
        if spec.model.source != "pvc":
            out.append(Finding("spec.speculative.draft.path", s.draft.path,
                               f"a draft path is inside spec.model.claimName, so it needs spec.model.source pvc (it "
                               f"is {spec.model.source}); omit the path to draft with the embedded "
                               "SmolLM2-135M-Instruct"))
        if s.draft.num_parameters is None:
            out.append(Finding("spec.speculative.draft.numParameters", None,
                               "required when spec.speculative.draft.path is set (it sizes the rank-0 pods' memory)"))
    if s.tokens >= spec.batching.max_num_batched_tokens:
        out.append(Finding("spec.speculative.tokens", s.tokens, f"must be below spec.batching.maxNumBatchedTokens "
                           f"({spec.batching.max_num_batched_tokens}): a request's drafts run in one step"))
    return out


def _check_shape(spec: LLMServiceSpec, settings: OperatorSettings) -> list[Finding]:
    out, ranks = [], spec.ranks_per_replica
    if ranks > settings.max_ranks_per_replica:
        out.append(Finding("spec.ranksPerReplica", ranks,
                           f"this cluster allows at most {settings.max_ranks_per_replica} sockets per group"))
    if spec.placement.mode == "pack" and ranks > spec.placement.sockets_per_node:
        out.append(Finding("spec.ranksPerReplica", ranks, f"placement pack puts a group on one node of "
                           f"{spec.placement.sockets_per_node} sockets; use at most that or placement spread"))
    p = spec.ports
    ports = {"grpc": p.grpc, "http": p.http, "metrics": p.metrics, "engineMetrics": p.engine_metrics}
    if len(set(ports.values())) < len(ports) or RAY_GCS_PORT in ports.values():
        out.append(Finding("spec.ports", ports, f"must be {len(ports)} distinct ports, none {RAY_GCS_PORT} (Ray GCS)"))
    b = spec.batching
    if b.max_num_batched_tokens < b.max_num_seqs:
        out.append(Finding("spec.batching.maxNumBatchedTokens", b.max_num_batched_tokens,
                           f"must be at least spec.batching.maxNumSeqs ({b.max_num_seqs}): one token per sequence"))
    plan = plan_memory(spec)
    if plan is not None and not plan.fits:
        out.append(Finding("spec.resources.kvCacheGb", spec.resources.kv_cache_gb,
                           f"KV budget does not fit: {plan.arithmetic}; needs {plan.required_bytes // MIB}Mi, "
                           f"over spec.resources.memoryPerRankGb={spec.resources.memory_per_rank_gb}"))
    return out


def validate(body: dict[str, Any], settings: OperatorSettings) -> tuple[LLMServiceSpec | None, list[Finding]]:
    """Parse and check an LLMService. Returns (spec, []) when valid, else (spec or None, findings)."""
    findings = check_name(body["metadata"]["name"])
    spec, parse_findings = parse_spec(body)
    if spec is None:
        return None, findings + parse_findings
    findings += _check_model(spec) + _check_quantization(spec) + _check_speculative(spec) + _check_shape(spec, settings)
    return spec, findings
