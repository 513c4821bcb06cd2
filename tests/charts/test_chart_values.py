"""values.schema.json rejects bad values (through helm itself), and every values key is documented."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from chart_tools import CHART, helm

BAD_VALUES = [  # (--set argument, words helm's schema error must contain)
    ("operator.serviceMonitors=sometimes", ["serviceMonitors"]),
    ("operator.resyncSeconds=0", ["resyncSeconds"]),
    ("metrics.port=80", ["port"]),
    ("operator.image.pullPolicy=Sometimes", ["pullPolicy"]),
    ("operator.watchNamespaces={Bad_NS}", ["watchNamespaces"]),
    ("grafana.dashboards.enabled=yes", ["enabled"]),
    ("operator.maxRanksPerReplica=0", ["maxRanksPerReplica"]),
    ("operator.resources.limits.cpu=lots", ["cpu"]),
    ("typo=1", ["typo"]),
]


@pytest.mark.parametrize("setting,words", BAD_VALUES, ids=[b[0].split("=")[0] for b in BAD_VALUES])
def test_schema_rejects_bad_values(setting, words):
    result = helm("template", "rel", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0, f"helm accepted --set {setting}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_defaults_and_ci_values_pass_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(defaults, schema)
    ci = yaml.safe_load((CHART / "ci" / "ci-values.yaml").read_text())
    jsonschema.validate(overlay(defaults, ci), schema)


def overlay(base, top):
    """What helm does with -f: maps merge, everything else replaces."""
    if isinstance(base, dict) and isinstance(top, dict):
        return {**base, **{k: overlay(base.get(k), v) for k, v in top.items()}}
    return top


def test_every_values_key_has_a_helm_docs_comment():
    """A key is documented by a `# --` line right above it, or by its documented parent."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, documented_indents = [], []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w-]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match[1]), match[2], match[3].strip()
        documented_indents = [d for d in documented_indents if d < indent]
        has_doc = i > 0 and lines[i - 1].strip().startswith("# --")
        if has_doc:
            documented_indents.append(indent)
        is_parent = rest == "" and i + 1 < len(lines) and len(lines[i + 1]) - len(lines[i + 1].lstrip()) > indent
        if not is_parent and not has_doc and not documented_indents:
            undocumented.append(key)
    assert undocumented == []
