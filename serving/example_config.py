"""serving/serve.example.yaml, rendered from ServeConfig's fields (their descriptions and defaults), so the example
never drifts from the model: `python -m cpuserve.serving.example_config > serving/serve.example.yaml` rewrites it,
and tests/serving/test_serve_cli.py checks the committed file is this module's output."""

from __future__ import annotations

import re
import sys
import textwrap

import yaml

from cpuserve.serving.config import ServeConfig

WIDTH = 117
YAML_WORDS = {"None": "null", "True": "true", "False": "false"}  # the descriptions' Python words, as YAML spells them
HEADER = """\
# Every ServeConfig field with its default: `cpuserve serve --config serving/serve.example.yaml`.
# Keys may be snake_case or camelCase; flags given with --config override the file's values, and
# CPUSERVE_SERVE_<FIELD> environment variables fill what neither sets. Copy it and keep what you change.
# Generated from serving/config.py: python -m cpuserve.serving.example_config > serving/serve.example.yaml
"""


def render() -> str:
    """The example file: each field's description as a comment, then the field at its default."""
    parts = [HEADER]
    for name, field in ServeConfig.model_fields.items():
        text = re.sub(r"\b(None|True|False)\b", lambda m: YAML_WORDS[m[1]], field.description or "")
        comment = textwrap.fill(text, WIDTH, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
        parts.append(f"{comment}\n{yaml.safe_dump({name: field.default}, default_flow_style=False, width=1000)}")
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render())
