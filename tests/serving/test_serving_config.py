"""`cpuserve serve` flags and YAML -> ServeConfig, without Ray: the flags the operator passes, precedence, errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cpuserve.engine.cli import build_parser
from cpuserve.serving.cli import config_from_args
from cpuserve.serving.config import ServeConfig, load_config


def parse(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_serve_the_default_model_on_loopback():
    c = parse()
    assert (c.model, c.host, c.grpc_port, c.http_port, c.metrics_port) == (None, "127.0.0.1", 9000, 8000, 8080)
    assert c.model_name == "SmolLM2-135M-Instruct" and c.ray_address is None and c.replicas == 1


def test_operator_flags_parse(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k1\n\nk2\n")
    c = parse("--weights", "int8", "--group-size", "128", "--kv-cache", "bf16", "--kv-cache-gb", "2.5",
              "--replicas", "3", "--ranks-per-replica", "1", "--cpus-per-rank", "4", "--max-num-seqs", "32",
              "--max-num-batched-tokens", "1024", "--max-queued-requests", "10", "--host", "0.0.0.0",
              "--grpc-port", "9100", "--http-port", "8100", "--metrics-port", "8190", "--ray-address", "auto",
              "--socket-resource", "cpuserve_socket", "--api-key-file", str(keys))
    assert (c.weights, c.group_size, c.kv_cache, c.kv_cache_gb) == ("int8", 128, "bf16", 2.5)
    assert (c.replicas, c.cpus_per_replica, c.max_num_seqs, c.max_queued_requests) == (3, 4, 32, 10)
    assert (c.ray_address, c.socket_resource, c.api_keys()) == ("auto", "cpuserve_socket", frozenset({"k1", "k2"}))
    options = c.engine_options()
    assert options["num_threads"] == 4 and options["max_num_batched_tokens"] == 1024


def test_yaml_with_flags_on_top(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("replicas: 2\ncpusPerRank: 1\nmaxQueuedRequests: 5\nkv_cache: fp32\n")
    c = parse("--config", str(f), "--replicas", "4")
    assert (c.replicas, c.cpus_per_rank, c.max_queued_requests, c.kv_cache) == (4, 1, 5, "fp32")
    assert ServeConfig(**c.model_dump()) == c  # what build_app receives round-trips


@pytest.mark.parametrize("fields,named", [
    ({"ranks_per_replica": 0}, "ranks_per_replica"),
    ({"placement_strategy": "ANYWHERE"}, "placement_strategy"),
    ({"transport": "nccl"}, "transport"),
    ({"tls_cert_file": __file__}, "tls_key_file"),
    ({"model": "/nonexistent/model.gguf"}, "model"),
    ({"replicas": 0}, "replicas"),
    ({"grpc_port": 8000}, "ports must differ"),
    ({"activations": "int8-token"}, "activations='int8-token' (one scale per token) goes with weights='int8'"),
    ({"max_num_batched_tokens": 8}, "max_num_batched_tokens=8 must be >= block_size=16"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"router": "round-robin"}, "router"),
])
def test_bad_config_names_the_field(fields, named):
    with pytest.raises(ValidationError) as info:
        ServeConfig(**fields)
    assert named in str(info.value)


def test_yaml_must_be_a_mapping(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("- replicas\n")
    with pytest.raises(ValueError, match="YAML mapping"):
        load_config(str(f))


def test_replica_group_flags_and_engine_options():
    c = parse("--ranks-per-replica", "3", "--cpus-per-rank", "4", "--placement-strategy", "PACK",
              "--transport", "torch", "--socket-resource", "cpuserve_socket")
    assert (c.ranks_per_replica, c.cpus_per_replica, c.placement_strategy) == (3, 12, "PACK")
    options = c.engine_options()
    assert (options["ranks"], options["num_threads"], options["transport"]) == (3, 4, "torch")
    c.check_model()  # SmolLM2 has 3 KV heads: 3 ranks fit


def test_more_ranks_than_kv_heads_names_the_field(capsys):
    """SmolLM2 has 3 KV heads: 4 ranks cannot split them. Caught before Ray starts: by the CLI, and by build_app
    (what a RayService imports), not by every replica Serve would keep restarting."""
    from cpuserve.engine.cli import main
    from cpuserve.serving.app import build_app

    assert main(["serve", "--ranks-per-replica", "4", "--cpus-per-rank", "1"]) == 2
    err = capsys.readouterr().err
    assert "ranks_per_replica=4" in err and "3 KV heads" in err and "ranks_per_replica <= 3" in err
    with pytest.raises(ValueError, match=r"ranks_per_replica=4 exceeds the model's 3 KV heads"):
        build_app(ServeConfig(ranks_per_replica=4))


def test_every_field_is_a_flag_showing_its_default():
    import argparse

    from cpuserve.serving.cli import register

    sub = argparse.ArgumentParser(prog="cpuserve").add_subparsers()
    register(sub)
    help_text = " ".join(sub.choices["serve"].format_help().split())
    for name in ServeConfig.model_fields:
        assert "--" + name.replace("_", "-") in help_text, name
    assert "Sequences one replica runs at once. (default: 64)" in help_text
    assert "--no-enable-prefix-caching" in help_text
    assert parse().max_num_seqs == ServeConfig().max_num_seqs  # unset flags keep the field's default


def test_engine_options_are_one_declaration_seen_by_the_cli_and_serve_config():
    """EngineConfig's option() fields: ServeConfig's field of that name (or ENGINE_NAMES') shows the same help, the
    same default (but arrival_window_ms: served, a replica waits for requests sent together) and the same choices;
    `cpuserve generate`'s flag the same help; and engine_options() passes every one to the engine."""
    import typing

    from cpuserve.engine.cli import ENGINE_FLAGS
    from cpuserve.engine.config import OPTIONS, EngineConfig
    from cpuserve.serving.config import ARRIVAL_WINDOW_MS, ENGINE_NAMES
    from cli_checks import subcommand

    shared = [name for name in ServeConfig.model_fields if name in OPTIONS]
    assert len(shared) > 10
    for name in shared:
        field, option = ServeConfig.model_fields[name], OPTIONS[name]
        assert field.description == option.metadata["help"], name
        assert field.default == (ARRIVAL_WINDOW_MS if name == "arrival_window_ms" else option.default), name
        literal = [a for a in (field.annotation, *typing.get_args(field.annotation))
                   if typing.get_origin(a) is typing.Literal]
        assert set(typing.get_args(literal[0]) if literal else ()) == set(option.metadata["choices"]), name
    helps = {a.dest: a.help for a in subcommand(build_parser(), "generate")._actions}
    for name in ENGINE_FLAGS:
        assert helps[name].startswith(OPTIONS[name].metadata["help"].replace("%", "%%")), name
    options = ServeConfig().engine_options()
    assert set(options) == set(shared) | set(ENGINE_NAMES.values()) | {"show_progress"}
    EngineConfig(**options)


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_groups_engine_goes_to_a_rank0_pod_of_the_revision(ranks):
    """With the operator's node labels (a revision), bundle 0 (the LLMServer replica: the engine, its HTTP port)
    asks for a Ray node labelled rank 0, the other bundles for any other rank; Serve's own checks accept them."""
    from cpuserve.serving.app import _server
    from cpuserve.serving.names import RANK_LABEL

    config = ServeConfig(ranks_per_replica=ranks, node_labels="cpuserve.dev/revision=abc",
                         socket_resource="cpuserve_socket")
    replica = _server(config)._replica_config
    revision = {"cpuserve.dev/revision": "abc"}
    if ranks == 1:  # no group: the replica's actor on any node of the revision (every rank pod is a rank 0)
        assert replica.ray_actor_options["label_selector"] == revision
        assert replica.placement_group_bundle_label_selector is None
    else:
        assert replica.placement_group_bundle_label_selector == [{**revision, RANK_LABEL: "0"}] + \
            [{**revision, RANK_LABEL: "!0"}] * (ranks - 1)
