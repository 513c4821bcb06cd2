"""ServeConfig: every serving option in one frozen pydantic model, from CLI flags, a YAML file or CPUSERVE_SERVE_* env.

`build_app(args)` takes this model's dict (snake_case or camelCase keys), so the same app runs from
`cpuserve serve` and from a RayService's serveConfigV2 `import_path: cpuserve.serving.app:build_app`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic_settings import BaseSettings, SettingsConfigDict

from cpuserve.engine.config import (ACTIVATION_FORMATS, GROUP_SIZES, KV_CACHE_DTYPES, OPTIONS, SPECULATIVE_METHODS,
                                    WEIGHT_FORMATS, EngineConfig, engine_option)
from cpuserve.engine.settings import SERVE_PREFIX
from cpuserve.serving.serve_options import SERVE_OPTION_HELP, described

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# files the serving host must have
PATH_FIELDS = ("model", "spec_draft_model", "api_key_file", "tls_cert_file", "tls_key_file")
# served, a replica's engine waits this long at most after an idle spell for requests sent together (the
# engine's own default is 0: an offline batch arrives at once); docs/serving.md has the measurement
ARRIVAL_WINDOW_MS = 20.0
# max_queued_tokens' default: the prompt tokens one replica prefills in QUEUED_PREFILL_S, at the engine's prefill
# rate measured per core (docs/engine.md's speed table: 1955 tok/s on the Xeon, 2039 on Zen 4, 512-token prompts
# on 2 threads: about 975 a core). A request admitted behind a full queue waits about that long for its first token.
PREFILL_TOKENS_PER_S_PER_CORE = 975
QUEUED_PREFILL_S = 10.0
# ServeConfig fields that set an EngineConfig field of another name; the others set the one of their own name
ENGINE_NAMES = {"cpus_per_rank": "num_threads", "ranks_per_replica": "ranks"}


def engine_field(name: str, default: Any = ..., **constraints: Any) -> Any:
    """A ServeConfig field that is EngineConfig's `name`: the engine's help, and its default unless one is given."""
    engine_default, help, _ = engine_option(name)
    return Field(engine_default if default is ... else default, description=help, **constraints)


def serve_field(name: str, default: Any, extra: str = "", **constraints: Any) -> Any:
    """A ServeConfig field the LLMService CRD offers too: its help is serve_options.py's, then `extra`."""
    return Field(default, description=described(SERVE_OPTION_HELP[name], extra), **constraints)


class ServeConfig(BaseSettings):
    """What one `cpuserve serve` deploys: the model, its replicas and the endpoints."""

    # field docstrings are the descriptions (`cpuserve serve --help` shows them: serving/cli.py)
    model_config = SettingsConfigDict(env_prefix=SERVE_PREFIX, alias_generator=to_camel,
                                      populate_by_name=True, frozen=True, extra="forbid",
                                      use_attribute_docstrings=True)

    # -- engine (one AsyncLLMEngine per replica): defaults and descriptions are EngineConfig's (engine_field) --------
    model: str | None = engine_field("model")
    served_model_name: str | None = None
    """Name clients pass as `model`; default: the model file's stem (or SmolLM2-135M-Instruct)."""
    weights: Literal[WEIGHT_FORMATS] = engine_field("weights")  # type: ignore[valid-type]
    group_size: Literal[GROUP_SIZES] = engine_field("group_size")  # type: ignore[valid-type]
    activations: Literal[ACTIVATION_FORMATS] = engine_field("activations")  # type: ignore[valid-type]
    kv_cache: Literal[KV_CACHE_DTYPES] = engine_field("kv_cache")  # type: ignore[valid-type]
    kv_cache_gb: float = engine_field("kv_cache_gb", gt=0)
    block_size: int = engine_field("block_size", ge=1)
    max_num_seqs: int = engine_field("max_num_seqs", ge=1)
    max_num_batched_tokens: int = engine_field("max_num_batched_tokens", ge=1)
    arrival_window_ms: float = engine_field("arrival_window_ms", ARRIVAL_WINDOW_MS, ge=0, le=1000)
    max_model_len: int | None = engine_field("max_model_len", ge=2)
    enable_prefix_caching: bool = engine_field("enable_prefix_caching")
    seed: int = engine_field("seed")
    speculative: Literal[SPECULATIVE_METHODS] | None = engine_field("speculative")  # type: ignore[valid-type]
    spec_tokens: int = engine_field("spec_tokens", ge=1)
    spec_max_batch: int = engine_field("spec_max_batch", ge=1)
    spec_draft_model: str | None = engine_field("spec_draft_model")
    spec_draft_weights: Literal[WEIGHT_FORMATS] | None = engine_field("spec_draft_weights")  # type: ignore[valid-type]
    spec_draft_kv_cache_gb: float = engine_field("spec_draft_kv_cache_gb", gt=0)

    # -- replicas and placement ---------------------------------------------------------------------------
    replicas: int = Field(1, ge=1)
    """LLMServer replicas (replica groups), one engine each."""
    ranks_per_replica: int = serve_field("ranks_per_replica", 1, "Rank 0 runs in the LLMServer replica, ranks "
                                         "1..k-1 in Ray actors of the replica's placement group (serving/rank_actors.py).",
                                         ge=1)
    cpus_per_rank: int = serve_field("cpus_per_rank", 2, "Ray reserves them per rank (one placement group bundle "
                                     "each).", ge=1)
    socket_resource: str | None = None
    """Custom Ray resource each rank asks one unit of (Kubernetes: one per NUMA-pinned pod)."""
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    """Ray strategy of a replica group's bundles: STRICT_PACK = one node; PACK lets ranks spill to other nodes
    (one rank per socket_resource pod on Kubernetes needs PACK or STRICT_SPREAD)."""
    transport: Literal["shm", "torch"] | None = engine_field("transport")
    node_labels: str | None = Field(None, pattern=r"^[^=,\s]+=[^=,\s]+(,[^=,\s]+=[^=,\s]+)*$")
    """Ray node labels every rank of a replica must run on, "key=value,...": a Ray label selector (the operator
    names the rank pods' revision here, so replicas of a new model start only on pods made for it)."""
    router: Literal["prefix", "power-of-two", "serve"] = "prefix"
    """How the Ingress picks an LLMServer replica. prefix: a request whose prompt starts like an earlier one goes
    to the replica that got that one (its KV cache holds the prefix) unless it is the busier by more than 4
    requests, others as power-of-two does (serving/router.py); power-of-two: the less busy of two random replicas;
    both only among the replicas serving the model a request names (two models run while one changes in place).
    serve: Ray Serve's own default router, unchanged: power of two choices over every replica, blind to models."""

    # -- admission ----------------------------------------------------------------------------------------
    max_queued_requests: int = serve_field("max_queued_requests", 64, ge=0)
    max_queued_tokens: int | None = serve_field("max_queued_tokens", None, ge=1)
    max_request_bytes: int = Field(1 << 20, ge=1024)
    """Largest HTTP body or gRPC prompt accepted."""
    stream_interval_ms: float = Field(0.0, ge=0, le=1000)
    """Least time between two messages of one stream: tokens arriving sooner are sent together. The last message
    never waits, nor does any before the first with text (serving/pacing.py)."""
    stream_messages_per_s: float = Field(128.0, ge=0)
    """Messages per second one replica sends over all its streams, at most: with n streams open, each stream's
    messages are n / this seconds apart (when that is longer than stream_interval_ms), and tokens arriving
    sooner go out together. Each message costs CPU in three processes (replica, ingress, proxy) that the
    engine's cores also serve, about 1 ms in all: this bounds that to a few percent of a core however many
    streams there are, while a few streams still get every token as its own message. 0: no bound."""

    # -- endpoints ----------------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Address of the HTTP, gRPC (with direct_grpc) and metrics endpoints."""
    grpc_port: int = serve_field("grpc_port", 9000, ge=1, le=65535)
    direct_grpc: bool = True
    """The Ingress replica serves gRPC on grpc_port itself (serving/direct_grpc.py, on `host`), one process hop
    less per message than through Serve's gRPC proxy, which is then not started. False: Serve's proxy listens on
    grpc_port, on all interfaces (what a Serve config applied through Ray's REST API, as the operator's, does)."""
    http_port: int = serve_field("http_port", 8000, ge=1, le=65535)
    direct_http: bool = True
    """The Ingress replica listens on http_port itself (serving/direct_http.py), one process hop less per message
    than through Serve's HTTP proxy. With direct_grpc too, `cpuserve serve` starts no Serve proxy at all; with
    direct_grpc off, the proxy answers HTTP on a free port of 127.0.0.1. False: Serve's proxy listens on http_port
    (what a Serve config applied through Ray's REST API, as the operator's, does)."""
    metrics_port: int = serve_field("metrics_port", 8080, "0 turns it off.", ge=0, le=65535)
    stats_interval_s: float = Field(0.5, gt=0, le=60)
    """How often each replica reports engine gauges to the ingress."""
    ray_address: str | None = None
    """Existing Ray cluster ("auto" on Kubernetes); None starts a local one."""
    api_key_file: str | None = None
    """File with one accepted API key per line; requests must send `Authorization: Bearer <key>`."""
    tls_cert_file: str | None = None
    """TLS certificate (PEM) of the HTTP endpoint; give tls_key_file with it."""
    tls_key_file: str | None = None
    """TLS private key (PEM) of the HTTP endpoint."""
    drain_timeout_s: float = Field(30.0, ge=0, le=3600)
    """On SIGTERM or Ctrl-C, `cpuserve serve` refuses new requests (503 / gRPC UNAVAILABLE, /health 503) and waits
    this long at most for the running ones to finish before it stops (`cpuserve drain` does the same in a pod)."""
    health_timeout_s: float = Field(30.0, gt=0, le=3600)
    """An engine making no progress this long is unhealthy: /health (and gRPC Health) runs one token through an idle
    engine and answers 503 when none comes in this time, or at once while a step has run longer; Serve's own health
    check then replaces the replica. Above the longest step the model takes (a prefill chunk of
    max_num_batched_tokens)."""
    access_log: bool = False
    """Ray Serve's per-request access log (off: it costs CPU per request)."""

    @classmethod
    def for_another_host(cls, **fields: Any) -> "ServeConfig":
        """A validated config that another machine runs (the operator's head pod), with only `fields` set.

        Its files are that machine's, so they are not looked for here, and this process's CPUSERVE_SERVE_*
        environment does not leak into it.
        """
        paths = {name: fields[name] for name in PATH_FIELDS if fields.get(name) is not None}
        checked = cls(**{**fields, **dict.fromkeys(paths, os.devnull)})  # every check but the files' existence
        return cls.model_construct(set(fields), **{**{name: getattr(checked, name) for name in fields}, **paths})

    @model_validator(mode="after")
    def _check(self) -> "ServeConfig":
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        for name in PATH_FIELDS:
            path = getattr(self, name)
            if path is not None and not Path(path).exists():
                raise ValueError(f"{name}={path!r}: no such file or folder")
        ports = {"grpc_port": self.grpc_port, "http_port": self.http_port, "metrics_port": self.metrics_port}
        if len({p for p in ports.values() if p}) != len([p for p in ports.values() if p]):
            raise ValueError(f"ports must differ: {ports}")
        EngineConfig(**self.engine_options())  # the engine's own checks across fields (activations with weights)
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).stem if self.model else DEFAULT_MODEL_NAME

    @property
    def node_label_selector(self) -> dict[str, str]:
        return dict(pair.split("=") for pair in self.node_labels.split(",")) if self.node_labels else {}

    @property
    def cpus_per_replica(self) -> int:
        return self.cpus_per_rank * self.ranks_per_replica

    @property
    def queued_tokens_limit(self) -> int:
        """max_queued_tokens, or its default for this replica size."""
        if self.max_queued_tokens is not None:
            return self.max_queued_tokens
        return int(QUEUED_PREFILL_S * PREFILL_TOKENS_PER_S_PER_CORE * self.cpus_per_replica)

    @property
    def prefill_tokens_per_s(self) -> float:
        """One replica's prefill rate as measured (PREFILL_TOKENS_PER_S_PER_CORE), for Retry-After estimates."""
        return float(PREFILL_TOKENS_PER_S_PER_CORE * self.cpus_per_replica)

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments of AsyncLLMEngine.from_config for one replica: every field that is an engine option
        (by its own name or ENGINE_NAMES')."""
        options = {ENGINE_NAMES.get(name, name): getattr(self, name) for name in type(self).model_fields
                   if name in OPTIONS or name in ENGINE_NAMES}
        return {**options, "show_progress": False}

    def check_model(self) -> None:
        """Checks that need the model's header (not its weights): run before deploying, so a bad value fails
        here, naming its field, instead of in every replica Serve keeps restarting."""
        if self.ranks_per_replica == 1:
            return
        args = _model_args(self.model)
        for count, what, share in ((args.n_kv_heads, "KV heads", "needs at least one"),
                                   (args.n_experts, "experts", "holds at least one whole expert")):
            if count and self.ranks_per_replica > count:
                raise ValueError(f"ranks_per_replica={self.ranks_per_replica} exceeds the model's {count} {what}: "
                                 f"every rank {share}; use ranks_per_replica <= {count}")

    def api_keys(self) -> frozenset[str]:
        if self.api_key_file is None:
            return frozenset()
        keys = frozenset(line.strip() for line in Path(self.api_key_file).read_text().splitlines() if line.strip())
        if not keys:
            raise ValueError(f"api_key_file={self.api_key_file!r} holds no key")
        return keys


def load_config(path: str | None = None, **overrides: Any) -> ServeConfig:
    """A YAML file (keys snake_case or camelCase) with CLI overrides on top; overrides of None are ignored.

    Raises:
        ValueError: one line naming the file (missing, not YAML, not a mapping) or the field and where its value
            came from (the file, a --flag or a CPUSERVE_SERVE_* variable), without pydantic's wrapping.
    """
    data = {} if path is None else _read_yaml(path)
    flags = {k: v for k, v in overrides.items() if v is not None}
    try:
        return ServeConfig(**{**data, **flags})
    except ValidationError as e:
        raise ValueError(describe_error(e, path, file_keys=set(data) - set(flags))) from None


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"config={path!r}: {e.strerror.lower()}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"config={path!r} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config={path!r} must be a YAML mapping of ServeConfig fields")
    return {_snake(str(k)): v for k, v in loaded.items()}


def describe_error(error: ValidationError, path: str | None = None, file_keys: set[str] = frozenset()) -> str:
    """The first error of a ServeConfig validation as one line: `<where>: <field>=<value>: <problem>`.

    Args:
        path: the --config file; fields in file_keys came from it, other fields from flags or the environment.
    """
    err = error.errors()[0]
    msg = err["msg"].removeprefix("Value error, ")  # pydantic's wrapping of a ValueError raised by a validator
    if not err["loc"]:  # a check across fields (_check below): its message names them
        in_file = path and any(name in msg for name in file_keys)
        return f"{path}: {msg}" if in_file else msg
    name = str(err["loc"][0])
    if err["type"] == "extra_forbidden":
        msg = f"{name}: not a ServeConfig field (see `cpuserve serve --help`)"
    else:
        msg = f"{name}={err['input']!r}: {msg}"
    if name in file_keys:
        return f"{path}: {msg}"
    return msg


@functools.lru_cache(maxsize=4)
def _model_args(model: str | None):
    from cpuserve.engine.loader import load_checkpoint

    return load_checkpoint(model, show_progress=False).args


def _snake(key: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in key)
