"""The ingress side of serving stays light: importing it, or building the app, does not load torch (the engine lives in
the replicas), and serving/'s modules import each other without cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SERVING = Path(__file__).resolve().parents[2] / "serving"
INGRESS_MODULES = ("cpuserve.serving.ingress", "cpuserve.serving.openai_api", "cpuserve.serving.protocol",
                   "cpuserve.serving.grpc_api", "cpuserve.serving.pacing", "cpuserve.engine.outputs",
                   "cpuserve.engine.errors", "cpuserve.engine")


def test_importing_the_ingress_does_not_import_torch():
    code = (f"import sys\nfor name in {INGRESS_MODULES!r}:\n    __import__(name)\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded[:5]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_building_the_app_does_not_import_torch():
    """`cpuserve serve` builds the app before Ray starts: torch (3-4 CPU-seconds) is the LLMServer replica's alone."""
    code = ("import sys\nfrom cpuserve.serving.app import build_app\nfrom cpuserve.serving.config import ServeConfig\n"
            "assert build_app(ServeConfig()) is not None\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded[:5]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def serving_imports() -> dict[str, set[str]]:
    """serving module -> the serving modules it imports (at any level: a function-local import cycles too)."""
    names = {f.stem for f in SERVING.glob("*.py") if f.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse((SERVING / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "cpuserve.serving":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cpuserve.serving."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("cpuserve.serving.")}
        graph[name] = deps & names - {name}
    return graph


def test_serving_has_no_import_cycles():
    graph = serving_imports()
    assert graph["ingress"] >= {"protocol", "openai_api", "grpc_api"}  # the walk sees imports

    def cycle_from(start: str, path: list[str]) -> list[str] | None:
        for dep in sorted(graph[path[-1]]):
            if dep == start:
                return path + [dep]
            if dep not in path:
                found = cycle_from(start, path + [dep])
                if found:
                    return found
        return None

    cycles = [c for name in sorted(graph) if (c := cycle_from(name, [name]))]
    assert not cycles, " -> ".join(cycles[0])
