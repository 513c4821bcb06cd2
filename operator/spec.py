"""The LLMService spec (desired state) as pydantic models: the one definition the CRD schema is built from.

Field docstrings become the CRD's descriptions (see crd.py); a field that sets a `cpuserve serve` option
(SERVE_FIELDS_FROM_SPEC) has that option's help first, and its docstring says only what holds on
Kubernetes. Ranges, enums and patterns become its validation, so the API server rejects what these models reject. Cross-field rules that a schema cannot say
(KV budget over the memory, ranks over the sockets allowed, a checkpoint type the format does not have)
live in validation.py and surface as the ValidationFailed condition.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from cpuserve.engine.config import ACTIVATION_FORMATS, KV_CACHE_DTYPES, SPECULATIVE_METHODS, WEIGHT_FORMATS
from cpuserve.operator.checkpoints import ALL_CHECKPOINT_TYPES

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
# SmolLM2-135M-Instruct, the model embedded in the image.
EMBEDDED_NUM_PARAMETERS = 134_515_008


# The LLMService fields the head's ServeConfig takes as they are (serve_document.py), whose CRD descriptions start
# with the option's help (crd.py): ServeConfig field -> the spec's field (snake_case path).
# tests/operator/test_operator_spec_table.py checks both ends, and that every spec field is here or in
# serve_document.SPEC_ELSEWHERE.
SERVE_FIELDS_FROM_SPEC = {
    "weights": "quantization.weights", "group_size": "quantization.group_size",
    "activations": "quantization.activations", "kv_cache": "quantization.kv_cache",
    "kv_cache_gb": "resources.kv_cache_gb", "cpus_per_rank": "resources.cpus_per_rank",
    "ranks_per_replica": "ranks_per_replica",
    "max_num_seqs": "batching.max_num_seqs", "max_num_batched_tokens": "batching.max_num_batched_tokens",
    "max_queued_requests": "batching.max_queued_requests",
    "max_queued_tokens": "batching.max_queued_tokens",  # only when set: a service that never set it keeps its args
    "arrival_window_ms": "batching.arrival_window_ms",  # only when set, as max_queued_tokens
    # only with spec.speculative (and its draft) set: a service without them keeps its args
    "speculative": "speculative.method", "spec_tokens": "speculative.tokens",
    "spec_max_batch": "speculative.max_batch", "spec_draft_weights": "speculative.draft.weights",
    "spec_draft_kv_cache_gb": "speculative.draft.kv_cache_gb",
    "grpc_port": "ports.grpc", "http_port": "ports.http", "metrics_port": "ports.metrics",
}


class Spec(BaseModel):
    """Base: frozen, camelCase in YAML, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True,
                              extra="forbid", use_attribute_docstrings=True)


class ModelSpec(Spec):
    source: Literal["embedded", "pvc", "url"]
    """Where the weights come from: the image's embedded SmolLM2-135M-Instruct, a PersistentVolumeClaim,
    or an HTTP(S) URL downloaded by an init container."""
    format: Literal["gguf", "safetensors"] = "gguf"
    """Checkpoint format: one GGUF file, or a safetensors folder with config.json and tokenizer.json."""
    checkpoint_type: Literal[ALL_CHECKPOINT_TYPES] | None = None  # type: ignore[valid-type]
    """How the checkpoint stores its weights. GGUF: llama.cpp's file type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1, Q2_K, Q2_K_S, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K); safetensors: F32, F16, BF16, GPTQ-INT4, GPTQ-INT8,
    AWQ-INT4, or compressed-tensors W4A16, W8A16, W8A8. Sizes the download (source url): an upper bound of what
    the type stores; omitted: F32."""
    num_parameters: int | None = Field(None, ge=1_000_000, le=2_000_000_000_000)
    """Parameter count; sizes the weights shard in each rank's memory. Required unless source is embedded."""
    claim_name: str | None = Field(None, max_length=253, pattern=DNS_LABEL)
    """PersistentVolumeClaim holding the model (source pvc); mounted read-only."""
    path: str | None = Field(None, min_length=1, max_length=1024, pattern=r"^[^/].*$")
    """Path of the GGUF file or safetensors folder inside the claim (source pvc), relative."""
    url: str | None = Field(None, max_length=2048, pattern=r"^https?://[^\s]+$")
    """HTTP(S) URL of the GGUF file, or of a .tar/.tar.gz of the safetensors folder (source url)."""
    sha256: str | None = Field(None, pattern=r"^[a-f0-9]{64}$")
    """Expected SHA-256 of the downloaded file (source url); the init container fails on a mismatch."""


# A cross-field rule the API server itself enforces (a CEL validation rule, GA in Kubernetes 1.29): one scale per
# token needs per-channel weights. validation.py says the same for a CRD installed before the rule was.
TOKEN_SCALES_NEED_INT8 = {
    "rule": "!has(self.activations) || self.activations != 'int8-token' || "
            "(has(self.weights) && self.weights == 'int8')",
    "message": "activations int8-token (one scale per token) needs weights int8 (per-channel): "
               "set weights: int8, or activations: int8",
    "fieldPath": ".activations",
}
_CEL_BOUND = {"maxLength": 16}  # a string a CEL rule reads needs a bound for the API server's cost estimate


class QuantizationSpec(Spec):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [TOKEN_SCALES_NEED_INT8]})

    # The formats are the engine's (engine/config.py). The group sizes are a subset of the engine's GROUP_SIZES: the
    # API offers the two INT4 recipes of DESIGN.md (32, 128); the engine also takes 64 (`cpuserve serve --group-size
    # 64`). Adding 64 here stays possible; removing a value from a CRD enum is not, as stored objects may hold it.
    weights: Literal[WEIGHT_FORMATS] = Field("int4", json_schema_extra=_CEL_BOUND)  # type: ignore[valid-type]
    group_size: Literal[32, 128] = 32
    activations: Literal[ACTIVATION_FORMATS] = Field("int8", json_schema_extra=_CEL_BOUND)  # type: ignore[valid-type]
    kv_cache: Literal[KV_CACHE_DTYPES] = "int8"  # type: ignore[valid-type]


class ResourcesSpec(Spec):
    cpus_per_rank: int = Field(2, ge=1, le=512)
    """Each rank pod's exclusive cores: one NUMA node's share (Guaranteed QoS, static CPU manager)."""
    kv_cache_gb: float = Field(1.0, gt=0, le=4096)
    """Each rank pod's memory counts all of it."""
    overhead_gb: float = Field(1.0, ge=0, le=256)
    """Runtime overhead per rank (Python, torch, Ray worker, activations), GiB."""
    memory_per_rank_gb: float | None = Field(None, gt=0, le=8192)
    """Memory per rank pod, GiB. Omit to use weights shard + KV budget + overhead; set it to cap that sum."""
    head_cpus: int = Field(1, ge=1, le=64)
    """Cores of the Ray head pod (Serve proxies and ingress)."""
    head_memory_gb: float = Field(2.0, ge=0.5, le=512)
    """Memory of the Ray head pod, GiB."""


class BatchingSpec(Spec):
    # These defaults differ from the engine's and `cpuserve serve`'s (max_num_seqs 64, max_num_batched_tokens 512,
    # max_queued_requests 64: engine/config.py), which are sized for one process on a small box. A rank pod gets a
    # socket's cores: a 2048-token step prefills long prompts in fewer steps, and the time it stalls running
    # streams shrinks with the cores. The models a cluster serves need more KV per sequence, so at the same
    # kvCacheGb 32 sequences run out of blocks (and preempt) less often than 64. One endpoint queues for many
    # clients: 256. The API server stores these defaults in every LLMService created without them, so changing
    # them would restart running services; the head pod always gets all three explicitly (serve_document.serve_fields).
    max_num_seqs: int = Field(32, ge=1, le=4096)
    max_num_batched_tokens: int = Field(2048, ge=16, le=1_048_576)
    max_queued_requests: int = Field(256, ge=0, le=1_000_000)
    max_queued_tokens: int | None = Field(None, ge=1, le=1_000_000_000)
    arrival_window_ms: float | None = Field(None, ge=0, le=1000)
    """Omitted: `cpuserve serve`'s 20 ms. Each replica group's engine waits; requests are not held at the head."""


class DraftModelSpec(Spec):
    path: str | None = Field(None, min_length=1, max_length=1024, pattern=r"^[^/].*$")
    """Path of the draft's GGUF file or safetensors folder inside spec.model.claimName (source pvc), relative; it must
    have the model's tokenizer. Omitted: the image's embedded SmolLM2-135M-Instruct."""
    num_parameters: int | None = Field(None, ge=1_000_000, le=2_000_000_000_000)
    """The draft's parameter count; sizes its weights in the memory of the rank-0 pods. Required with path."""
    weights: Literal[WEIGHT_FORMATS] | None = None  # type: ignore[valid-type]
    """int4 uses spec.quantization.groupSize."""
    kv_cache_gb: float = Field(0.25, gt=0, le=4096)
    """Each rank-0 pod's memory counts all of it."""


class SpeculativeSpec(Spec):
    method: Literal[SPECULATIVE_METHODS]  # type: ignore[valid-type]
    """draft: spec.speculative.draft runs in each replica group's engine, on its rank-0 pod."""
    tokens: int = Field(4, ge=1, le=256)
    """Below spec.batching.maxNumBatchedTokens."""
    max_batch: int = Field(4, ge=1, le=4096)
    draft: DraftModelSpec | None = None
    """The draft model of method draft; omitted: the embedded SmolLM2-135M-Instruct at its defaults."""


class PortsSpec(Spec):
    grpc: int = Field(9000, ge=1024, le=65535)
    http: int = Field(8000, ge=1024, le=65535)
    metrics: int = Field(8080, ge=1024, le=65535)
    engine_metrics: int = Field(8081, ge=1024, le=65535)
    """Port on which each rank pod that runs a replica group's engine serves that engine's gauges in vLLM's names
    (the Gateway API Inference Extension's model-server protocol: what an endpoint picker and an HPA read)."""


class PlacementSpec(Spec):
    mode: Literal["spread", "pack"] = "spread"
    """spread: ranks of one group on distinct nodes (required anti-affinity). pack: on one node, one rank per
    socket, relying on the kubelet's single-numa-node topology policy."""
    sockets_per_node: int = Field(2, ge=1, le=16)
    """Sockets (NUMA nodes) of the target nodes; in pack mode a group may not have more ranks."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Extra node labels the rank pods require (added to the operator's NUMA-pinning label)."""


class SecretKeyRef(Spec):
    name: str = Field(max_length=253, pattern=DNS_LABEL)
    """Secret name (same namespace)."""
    key: str = Field("api-keys", max_length=253, pattern=SECRET_KEY)
    """Key in the Secret."""


class SecuritySpec(Spec):
    tls_secret_name: str | None = Field(None, max_length=253, pattern=DNS_LABEL)
    """kubernetes.io/tls Secret (tls.crt, tls.key) for the gRPC and HTTP endpoints."""
    api_keys: SecretKeyRef | None = None
    """Secret key holding the accepted API keys, one per line."""
    ray_auth_token_secret: str | None = Field(None, max_length=253, pattern=DNS_LABEL)
    """Secret with key `token` for Ray's token authentication (always on); omitted: the operator generates the
    Secret `<name>-ray-token`."""


class LLMServiceSpec(Spec):
    model: ModelSpec
    """The model to serve."""
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    """Runtime weight and KV cache formats."""
    replicas: int = Field(1, ge=0, le=256)
    """Replica groups (each serves the whole model)."""
    ranks_per_replica: int = Field(1, ge=1, le=64)
    """Each rank is a pod of its own."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """CPUs and memory per rank and for the head."""
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    """Continuous batching limits."""
    speculative: SpeculativeSpec | None = None
    """Speculative decoding: n-gram drafts or a draft model; omitted: off."""
    ports: PortsSpec = Field(default_factory=PortsSpec)
    """Service ports."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    """Where rank pods may run."""
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    """TLS, API keys and Ray authentication, from Secrets."""
    image: str | None = Field(None, min_length=1, max_length=512, pattern=r"^[^\s]+$")
    """Serving image; defaults to the operator's."""
    drain_timeout_seconds: int = Field(30, ge=0, le=3600)
    """When a pod stops, how long its running requests may take to finish (`cpuserve serve --drain-timeout-s`): the
    head refuses new requests (503 / gRPC UNAVAILABLE) and each rank pod waits for them, up to this, in their
    preStop; terminationGracePeriodSeconds adds the time Ray takes to stop."""
