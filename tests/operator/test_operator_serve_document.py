"""The Serve config the operator applies to the head through Ray Serve's REST API: Ray's own schema accepts it,
serving's ServeConfig accepts its args for every value the CRD allows (the operator builds them without serving
installed), and what a change touches follows Serve's in-place update rules."""
from __future__ import annotations

import typing

import pytest
from ray.serve.schema import ServeDeploySchema

from cpuserve.operator.serve_api import app_status, is_deployed
from cpuserve.operator.serve_document import build_serve_document, serve_fields
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate
from cpuserve.serving.config import ServeConfig
from llmservice_factory import make_body

SETTINGS = OperatorSettings()
URL_MODEL = {"source": "url", "url": "https://example.invalid/m.tar.gz", "format": "safetensors",
             "numParameters": 1_000_000_000, "sha256": "a" * 64}
SECURITY = {"tlsSecretName": "tls", "apiKeys": {"name": "keys", "key": "keys.txt"}}
PVC_MODEL = {"source": "pvc", "claimName": "models", "path": "llama/model.gguf", "numParameters": 8_000_000_000}
DRAFT = {"path": "llama/draft.gguf", "numParameters": 1_000_000_000, "weights": "int8", "kvCacheGb": 0.5}


def document(**spec):
    parsed, findings = validate(make_body(**spec), SETTINGS)
    assert findings == []
    return build_serve_document(parsed), parsed


def test_the_document_is_a_valid_serve_deploy_config():
    doc, _ = document(model=URL_MODEL, security=SECURITY, replicas=2, ranksPerReplica=2,
                      quantization={"weights": "int8", "groupSize": 128, "activations": "int8-token", "kvCache": "fp32"},
                      resources={"kvCacheGb": 2.5, "cpusPerRank": 16}, batching={"maxNumSeqs": 64},
                      ports={"grpc": 9100, "http": 8100, "metrics": 8180})
    ServeDeploySchema.model_validate(doc)  # Ray Serve's own schema of PUT /api/serve/applications/
    ingress, engine = doc["applications"]
    assert (ingress["name"], ingress["import_path"], ingress["route_prefix"]) == \
        ("cpuserve", "cpuserve.serving.app:build_ingress_app", "/")
    assert ingress["args"] == {"host": "0.0.0.0", "metrics_port": 8180,
                               "api_key_file": "/etc/cpuserve/api-keys/keys.txt",
                               "direct_http": False, "direct_grpc": False}  # Serve's proxies own the ports here
    assert ingress["deployments"] == [{"name": "Ingress", "user_config": {"replicas": 2, "max_num_seqs": 64,
                                                                          "max_queued_requests": 256}}]
    assert (engine["name"], engine["import_path"], engine["route_prefix"]) == \
        ("cpuserve-engine", "cpuserve.serving.app:build_engine_app", None)  # no HTTP route of its own
    assert engine["args"] == {"model": "/models/model", "weights": "int8", "group_size": 128,
                              "activations": "int8-token", "kv_cache": "fp32",
                              "kv_cache_gb": 2.5, "ranks_per_replica": 2, "cpus_per_rank": 16, "max_num_seqs": 64,
                              "max_num_batched_tokens": 2048, "max_queued_requests": 256, "host": "0.0.0.0",
                              "socket_resource": "cpuserve_socket", "placement_strategy": "STRICT_SPREAD",
                              "direct_http": False, "direct_grpc": False,
                              # each replica's own HTTP API on its rank pod (serving/engine_http.py) takes them too
                              "api_key_file": "/etc/cpuserve/api-keys/keys.txt",
                              "tls_cert_file": "/etc/cpuserve/tls/tls.crt", "tls_key_file": "/etc/cpuserve/tls/tls.key"}
    # one new replica starts before an old one stops (2 x 50% = 1), old ones drain their streams
    assert engine["deployments"] == [{"name": "LLMServer", "num_replicas": 2, "graceful_shutdown_timeout_s": 300.0,
                                      "max_surge_percent": 50}]
    assert doc["http_options"] == {"host": "0.0.0.0", "port": 8100, "ssl_certfile": "/etc/cpuserve/tls/tls.crt",
                                   "ssl_keyfile": "/etc/cpuserve/tls/tls.key"}
    assert doc["grpc_options"]["port"] == 9100 and doc["proxy_location"] == "HeadOnly"


def test_every_quantization_the_crd_offers_is_one_the_engine_takes():
    from cpuserve.engine.config import ACTIVATION_FORMATS, GROUP_SIZES, KV_CACHE_DTYPES, WEIGHT_FORMATS
    from cpuserve.operator.spec import QuantizationSpec

    for name, allowed in (("weights", WEIGHT_FORMATS), ("group_size", GROUP_SIZES), ("kv_cache", KV_CACHE_DTYPES),
                          ("activations", ACTIVATION_FORMATS)):
        assert set(typing.get_args(QuantizationSpec.model_fields[name].annotation)) <= set(allowed), name


# the CRD's extremes: every value a valid LLMService may carry into the head's ServeConfig
EXTREMES = [
    {},
    {"replicas": 0, "ranksPerReplica": 1, "resources": {"cpusPerRank": 1, "kvCacheGb": 0.001}},
    {"replicas": 256, "ranksPerReplica": 2, "resources": {"cpusPerRank": 512, "kvCacheGb": 0.5}},
    {"batching": {"maxNumSeqs": 1, "maxNumBatchedTokens": 16, "maxQueuedRequests": 0}},
    {"batching": {"maxNumSeqs": 4096, "maxNumBatchedTokens": 1_048_576, "maxQueuedRequests": 1_000_000,
                  "maxQueuedTokens": 1_000_000_000}},
    {"batching": {"maxQueuedTokens": 1}},
    {"ports": {"grpc": 1024, "http": 65535, "metrics": 1025}},
    {"model": URL_MODEL, "security": SECURITY},
    {"model": {"source": "pvc", "claimName": "models", "path": "llama/model.gguf", "numParameters": 8_000_000_000}},
    *({"quantization": {"weights": w, "groupSize": g, "kvCache": kv}}
      for w in ("int4", "int8", "bf16", "fp32") for g in (32, 128) for kv in ("int8", "bf16", "fp32")),
    *({"quantization": {"weights": w, "activations": a}} for w in ("int4", "int8", "bf16", "fp32") for a in ("int8", "bf16")),
    {"quantization": {"weights": "int8", "activations": "int8-token", "groupSize": 128, "kvCache": "bf16"}},
    {"batching": {"arrivalWindowMs": 0}}, {"batching": {"arrivalWindowMs": 1000}},
    {"speculative": {"method": "ngram", "tokens": 15, "maxBatch": 1},
     "batching": {"maxNumSeqs": 1, "maxNumBatchedTokens": 16}},
    {"speculative": {"method": "ngram", "tokens": 1, "maxBatch": 1}},
    {"speculative": {"method": "ngram", "tokens": 256, "maxBatch": 4096}},
    {"speculative": {"method": "draft"}},
    *({"model": PVC_MODEL, "speculative": {"method": "draft", "draft": {**DRAFT, "weights": w, "kvCacheGb": kv}}}
      for w in ("int4", "int8", "bf16", "fp32") for kv in (0.001, 4096)),
]


@pytest.mark.parametrize("spec", EXTREMES, ids=range(len(EXTREMES)))
def test_serving_accepts_the_fields_for_every_value_the_crd_allows(spec):
    parsed, findings = validate(make_body(**spec), SETTINGS)
    assert findings == []
    fields = serve_fields(parsed)
    config = ServeConfig.for_another_host(**fields)  # the head's own checks, but the pod's files' existence
    assert {name: getattr(config, name) for name in fields} == fields
    for app in build_serve_document(parsed, revision="0123abcd")["applications"]:
        args = app["args"]
        rebuilt = ServeConfig.for_another_host(**args)  # what build_*_app validates again on the head
        assert {k: getattr(rebuilt, k) for k in args} == {k: getattr(config, k) for k in args if k in fields} | {
            "direct_http": False, "direct_grpc": False} | ({"node_labels": "cpuserve.dev/revision=0123abcd"}
                                                          if app["name"] == "cpuserve-engine" else {})
    assert ("model" in args) is ("source" in spec.get("model", {}) and spec["model"]["source"] != "embedded")


@pytest.mark.parametrize("change,lightweight", [
    ({"replicas": 3}, True),  # num_replicas and user_config only: no replica restarts
    ({"batching": {"maxNumSeqs": 8}}, False),  # args: Serve replaces LLMServer replicas, a new one first
    ({"quantization": {"weights": "int8"}}, False),
    ({"batching": {"maxQueuedTokens": 4096}}, False),  # a replica's admission bound: new args
    ({"drainTimeoutSeconds": 120}, True),  # the pods' preStop only
    ({"quantization": {"weights": "int8", "activations": "int8-token"}}, False),  # the engine's scheme: new args
    ({"model": {"source": "pvc", "claimName": "models", "path": "b.gguf", "numParameters": 10**9}}, False),
    ({"batching": {"arrivalWindowMs": 5}}, False),  # the engine's own option: new args
    ({"speculative": {"method": "ngram"}}, False),
])
def test_what_a_change_touches(change, lightweight):
    """No change ever touches the Ingress's application's args: Serve restarts an application's every deployment
    when its args change (their code version is the args' hash)."""
    before, _ = document(replicas=2)
    after, _ = document(**{"replicas": 2, **change})
    (ingress_before, engine_before), (ingress_after, engine_after) = before["applications"], after["applications"]
    assert ingress_before["args"] == ingress_after["args"]
    assert (engine_before["args"] == engine_after["args"]) is lightweight
    assert before["http_options"] == after["http_options"] and before["grpc_options"] == after["grpc_options"]


def test_max_queued_tokens_reaches_the_args_only_when_set():
    # the engine's application (LLMServer refuses a prompt past it)
    assert "max_queued_tokens" not in document()[0]["applications"][1]["args"]  # the serving default applies
    args = document(batching={"maxQueuedTokens": 4096})[0]["applications"][1]["args"]
    assert args["max_queued_tokens"] == 4096 and ServeConfig.for_another_host(**args).queued_tokens_limit == 4096


def test_the_arrival_window_reaches_the_engines_args_only_when_set():
    assert "arrival_window_ms" not in document()[0]["applications"][1]["args"]  # `cpuserve serve`'s 20 ms applies
    ingress, engine = document(batching={"arrivalWindowMs": 5})[0]["applications"]
    assert engine["args"]["arrival_window_ms"] == 5 and "arrival_window_ms" not in ingress["args"]
    assert ServeConfig.for_another_host(**engine["args"]).engine_options()["arrival_window_ms"] == 5


@pytest.mark.parametrize("speculative,expected", [
    (None, {}),  # off: none of the engine's spec_* options, so a service that never set it keeps its args
    ({"method": "ngram"}, {"speculative": "ngram", "spec_tokens": 4, "spec_max_batch": 4}),
    ({"method": "ngram", "tokens": 6, "maxBatch": 2}, {"speculative": "ngram", "spec_tokens": 6, "spec_max_batch": 2}),
    ({"method": "draft"}, {"speculative": "draft", "spec_tokens": 4, "spec_max_batch": 4}),  # the embedded draft
    ({"method": "draft", "draft": DRAFT}, {"speculative": "draft", "spec_tokens": 4, "spec_max_batch": 4,
                                           "spec_draft_model": "/models/llama/draft.gguf", "spec_draft_weights": "int8",
                                           "spec_draft_kv_cache_gb": 0.5}),  # the pod's path in the model's claim
    ({"method": "draft", "draft": {"kvCacheGb": 1}}, {"speculative": "draft", "spec_tokens": 4, "spec_max_batch": 4,
                                                      "spec_draft_kv_cache_gb": 1.0}),
])
def test_speculative_decoding_reaches_the_engines_args(speculative, expected):
    doc, _ = document(model=PVC_MODEL, **({"speculative": speculative} if speculative else {}))
    ingress, engine = doc["applications"]
    assert {k: v for k, v in engine["args"].items() if k.startswith("spec")} == expected
    assert not any(k.startswith("spec") for k in ingress["args"])
    config = ServeConfig.for_another_host(**engine["args"]).engine_options()
    assert {k: config[k] for k in expected} == expected


def test_is_deployed_compares_what_the_head_reports():
    doc, _ = document(replicas=2)
    details = {"applications": {app["name"]: {"status": "RUNNING", "deployed_app_config": {**app, "runtime_env": {}}}
                                for app in doc["applications"]},
               "http_options": {"host": "0.0.0.0", "port": 8000}, "grpc_options": {"port": 9000}}
    assert is_deployed(details, doc)
    scaled, _ = document(replicas=3)
    assert not is_deployed(details, scaled)
    assert not is_deployed({"applications": {}}, doc)  # a new head: nothing deployed yet
    assert not is_deployed({**details, "applications": {"cpuserve": details["applications"]["cpuserve"]}}, doc)
    assert not is_deployed({**details, "http_options": {"port": 8001}}, doc)


@pytest.mark.parametrize("statuses,expected", [
    (("RUNNING", "RUNNING"), ("RUNNING", "")),
    (("RUNNING", "DEPLOYING"), ("DEPLOYING", "engine")),
    (("DEPLOYING", "DEPLOY_FAILED"), ("DEPLOY_FAILED", "engine")),  # a failure first
    (("RUNNING", None), ("DEPLOYING", "")),  # not there yet
])
def test_the_status_of_both_applications(statuses, expected):
    apps = {name: {"status": st, "message": name.split("-")[-1] if st != "RUNNING" else ""}
            for name, st in zip(("cpuserve", "cpuserve-engine"), statuses) if st}
    assert app_status({"applications": apps}, ["cpuserve", "cpuserve-engine"]) == expected


def test_the_ingress_admission_limit_follows_the_replicas_in_place():
    """Ray Serve calls reconfigure(user_config) on a lightweight update: replicas x max_num_seqs + queue."""
    from cpuserve.serving.ingress import IngressCore
    from cpuserve.serving.scalable_ingress import ScalableIngress

    config = ServeConfig(metrics_port=0, max_num_seqs=4, max_queued_requests=3)
    ingress = IngressCore(config.model_dump(), llm_server=None)
    assert ingress.max_in_flight == 1 * 4 + 3
    ScalableIngress.reconfigure(ingress, {"replicas": 3})
    assert ingress.max_in_flight == 3 * 4 + 3
    ScalableIngress.reconfigure(ingress, {"replicas": 0})  # no rank pods: the one waiting replica still admits
    assert ingress.max_in_flight == 1 * 4 + 3
    ScalableIngress.reconfigure(ingress, {"replicas": 2, "max_num_seqs": 8, "max_queued_requests": 0})
    assert ingress.max_in_flight == 2 * 8 + 0  # a batching change: no restart either
    with pytest.raises(ValueError, match="user_config.replicas=-1"):
        ScalableIngress.reconfigure(ingress, {"replicas": -1})
    with pytest.raises(ValueError, match="user_config.max_num_seqs=0"):
        ScalableIngress.reconfigure(ingress, {"max_num_seqs": 0})
    with pytest.raises(ValueError, match="user_config.model: not one of"):
        ScalableIngress.reconfigure(ingress, {"model": "x"})


def test_the_ingress_reports_the_replicas_applied_in_place():
    import asyncio

    from cpuserve.serving.ingress import IngressCore
    from cpuserve.serving.protocol import ModelInfo
    from cpuserve.serving.scalable_ingress import ScalableIngress

    class Ingress(IngressCore):  # the core with ScalableIngress's two methods, outside Ray Serve's wrapper
        reconfigure = ScalableIngress.reconfigure
        _model_info = ScalableIngress._model_info
        _replicas = None

    class Server:  # what LLMServer.info answers: its args carry no replicas under a Serve config
        class info:  # noqa: N801 (a DeploymentHandle method: .remote())
            @staticmethod
            async def remote():
                return ModelInfo(name="m", max_model_len=8, weights="int4", kv_cache="int8", replicas=1,
                                 tool_format="hermes")

    ingress = Ingress(ServeConfig(metrics_port=0).model_dump(), llm_server=Server())
    assert asyncio.run(ingress._model_info()).replicas == 1
    ingress.reconfigure({"replicas": 3})
    assert asyncio.run(ingress._model_info()).replicas == 3
