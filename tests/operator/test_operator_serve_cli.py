"""The head pod's `cpuserve serve ...` command line parses with the serving layer's own argparse parser."""
from __future__ import annotations

import argparse
import typing

import pytest

from cpuserve.operator.pods import serve_args
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate
from llmservice_factory import make_body


def test_head_command_line_parses_with_cpuserve_serve():
    try:
        from cpuserve.serving.cli import register
    except ImportError as err:  # the serving CLI is another issue's work
        pytest.skip(f"cpuserve.serving.cli not importable yet: {err}")
    body = make_body(model={"source": "pvc", "claimName": "m", "path": "llama/model.gguf", "numParameters": 10**9},
                     replicas=2, quantization={"weights": "int8", "groupSize": 128, "kvCache": "bf16"},
                     resources={"kvCacheGb": 2.5, "cpusPerRank": 8}, security={"tlsSecretName": "tls",
                                                                                "apiKeys": {"name": "keys"}})
    spec, findings = validate(body, OperatorSettings())
    assert findings == []
    parser = argparse.ArgumentParser(prog="cpuserve")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(serve_args(spec)[1:])  # drop the program name
    assert (args.command, args.model, args.weights, args.group_size, args.kv_cache, args.kv_cache_gb) == \
        ("serve", "/models/llama/model.gguf", "int8", 128, "bf16", 2.5)
    assert (args.replicas, args.cpus_per_rank, args.grpc_port, args.ray_address, args.socket_resource) == \
        (2, 8, 9000, "auto", "cpuserve_socket")
    assert args.placement_strategy == "STRICT_SPREAD"  # one rank per pod, each pod its own Ray node
    assert args.tls_cert_file == "/etc/cpuserve/tls/tls.crt" and args.api_key_file == "/etc/cpuserve/api-keys/api-keys"


def test_head_command_line_is_the_validated_serve_config():
    from cpuserve.engine.config import GROUP_SIZES, KV_CACHE_DTYPES, WEIGHT_FORMATS
    from cpuserve.engine.cli import build_parser
    from cpuserve.operator.pods import serve_config
    from cpuserve.operator.spec import QuantizationSpec
    from cpuserve.serving.cli import config_from_args

    # every quantization the CRD offers is one the engine takes
    for name, allowed in (("weights", WEIGHT_FORMATS), ("group_size", GROUP_SIZES), ("kv_cache", KV_CACHE_DTYPES)):
        assert set(typing.get_args(QuantizationSpec.model_fields[name].annotation)) <= set(allowed), name
    spec, _ = validate(make_body(replicas=2, batching={"maxNumSeqs": 8}), OperatorSettings())
    config = serve_config(spec)
    assert (config.replicas, config.max_num_seqs, config.max_num_batched_tokens) == (2, 8, 2048)
    assert config_from_args(build_parser().parse_args(serve_args(spec)[1:])) == config
