"""`cpuserve generate` as a user types it: bad flags are refused with one `error:` line before the model loads,
and every flag says what it does and its default."""

from __future__ import annotations

import pytest

from cli_checks import run_cli, subcommand, undocumented_flags
from cpuserve.engine.cli import build_parser


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "--temperature=-1.0 is invalid: must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p=0.0 is invalid: must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k=-2 is invalid"),
    (["--max-tokens", "0"], "--max-tokens=0 is invalid"),
    (["--num-threads", "100000"], "--num-threads=100000 exceeds the"),
])
def test_bad_generate_flags_fail_before_the_model_loads(flags, message):
    out = run_cli("generate", "hi", *flags, timeout=30)  # loading SmolLM2 alone takes longer than the checks
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [out.stderr.strip()] and out.stderr.startswith("error: "), out.stderr
    assert message in out.stderr and out.stdout == ""


def test_every_generate_flag_has_help_with_its_default():
    assert undocumented_flags(subcommand(build_parser(), "generate")) == []
