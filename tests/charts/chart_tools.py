"""Paths, the tools `make tools` fetches (helm, promtool) and chart rendering for the chart tests."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "cpuserve"
K8S_VERSION = "1.34"


def tool(name: str) -> str:
    """tools/NAME from `make tools`, else NAME on PATH; skip (with the fix) when neither exists."""
    local = ROOT / "tools" / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} not found: run `make tools`")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=60, check=check)


def render(*args: str, namespace: str = "ops") -> list[dict[str, Any]]:
    """`helm template` of the chart (CRDs included) as a list of manifests."""
    out = helm("template", "rel", str(CHART), "--namespace", namespace, "--include-crds", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]
