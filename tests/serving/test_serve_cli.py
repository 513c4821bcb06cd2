"""`cpuserve serve` as a user types it, failing before anything loads: a missing, malformed or wrong --config, and
too many CPUs per rank, each give one `error:` line naming the file and field, and exit 2 as argparse does. Every
flag has help showing its default, and the example config loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cli_checks import run_cli, subcommand, undocumented_flags
from cpuserve.engine.cli import build_parser
from cpuserve.serving.cli import config_from_args
from cpuserve.serving.config import ServeConfig
from cpuserve.serving.example_config import render

EXAMPLE = Path(__file__).resolve().parents[2] / "serving" / "serve.example.yaml"


@pytest.mark.parametrize("text,message", [
    (None, "config='{path}': no such file or directory"),
    ("replicas: [1\n", "config='{path}' is not valid YAML at line 2, column 1"),
    ("- replicas\n", "config='{path}' must be a YAML mapping of ServeConfig fields"),
    ("kvCacheGb: -1\n", "{path}: kv_cache_gb=-1: Input should be greater than 0"),
    ("replicas: 1\nfrobs: 2\n", "{path}: frobs: not a ServeConfig field"),
    ("grpc_port: 8000\n", "{path}: ports must differ"),
    ("tls_cert_file: /etc/hostname\n", "{path}: tls_cert_file and tls_key_file go together"),
])
def test_bad_config_file_is_one_error_line(tmp_path, text, message):
    path = tmp_path / "serve.yaml"
    if text is not None:
        path.write_text(text)
    out = run_cli("serve", "--config", str(path), timeout=30)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message.format(path=path)}"), out.stderr
    assert "Value error" not in out.stderr and out.stdout == ""


@pytest.mark.parametrize("flags,message", [
    (["--replicas", "0"], "error: replicas=0: Input should be greater than or equal to 1"),
    (["--cpus-per-rank", "100000"], "error: cpus_per_rank=100000 exceeds the"),
    (["--num-threads", "100000"], "error: cpus_per_rank=100000 exceeds the"),
])
def test_bad_serve_flags_are_one_error_line(flags, message):
    out = run_cli("serve", *flags, timeout=30)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(message), out.stderr


def test_every_serve_flag_has_help_with_its_default():
    assert undocumented_flags(subcommand(build_parser(), "serve")) == []


def test_example_config_names_every_field_and_loads_to_the_defaults():
    assert set(yaml.safe_load(EXAMPLE.read_text())) == set(ServeConfig.model_fields)
    config = config_from_args(build_parser().parse_args(["serve", "--config", str(EXAMPLE)]))
    assert config == ServeConfig()


def test_example_config_is_the_rendering_of_serve_config():
    """The committed file is what `python -m cpuserve.serving.example_config` writes (descriptions and defaults)."""
    assert EXAMPLE.read_text() == render(), \
        "rewrite it: python -m cpuserve.serving.example_config > serving/serve.example.yaml"
