"""The operator stands alone: it imports nothing of serving or the engine but shared, dependency-free constants, so
the `operator` extra alone runs it without torch, Ray or uvicorn (tests/test_wheel_install.py installs it so)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the modules of serving and the engine the operator may import: constants, and only the standard library's
SHARED = {"cpuserve.engine.config": ROOT / "engine" / "config.py",
          "cpuserve.engine.settings": ROOT / "engine" / "settings.py",
          "cpuserve.serving.names": ROOT / "serving" / "names.py",
          "cpuserve.serving.ray_env": ROOT / "serving" / "ray_env.py",
          "cpuserve.serving.serve_options": ROOT / "serving" / "serve_options.py"}
# importing a shared module runs its package's __init__ too
PACKAGE_INITS = [ROOT / "engine" / "__init__.py", ROOT / "serving" / "__init__.py"]
# what the operator extra does not install
ABSENT = ("torch", "ray", "uvicorn", "fastapi", "numpy", "grpc", "gguf", "tokenizers", "transformers")


def imported_modules(path: Path, module_level_only: bool = False) -> set[str]:
    """Every module a file imports (in functions too, unless module_level_only)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_operator_imports_only_shared_constants_of_serving_and_the_engine():
    for path in sorted((ROOT / "operator").rglob("*.py")):
        reached = {m for m in imported_modules(path) if m.startswith(("cpuserve.engine", "cpuserve.serving"))}
        assert reached <= set(SHARED), f"{path.relative_to(ROOT)} imports {sorted(reached - set(SHARED))}"


def test_the_shared_modules_need_only_the_standard_library():
    for path in [*SHARED.values(), *PACKAGE_INITS]:
        top = {m.split(".")[0] for m in imported_modules(path, module_level_only=True)}
        assert top <= set(sys.stdlib_module_names) | {"__future__"}, \
            f"{path.relative_to(ROOT)} imports {sorted(top - set(sys.stdlib_module_names))} when imported"


def test_every_operator_module_imports_with_the_engine_and_ray_absent():
    """In a process where torch, Ray, uvicorn ... cannot be imported (as with the operator extra alone)."""
    code = f"""
import importlib, importlib.abc, pkgutil, sys
ABSENT = {ABSENT!r}

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Absent())
import cpuserve.operator
for info in pkgutil.walk_packages(cpuserve.operator.__path__, "cpuserve.operator."):
    if not info.name.endswith("__main__"):  # that one runs the operator
        importlib.import_module(info.name)
from cpuserve.engine.cli import build_parser
build_parser().parse_args(["operator", "--standalone"])  # the `cpuserve operator` command is there
print(sorted(m for m in sys.modules if m.startswith("cpuserve")))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "cpuserve.operator.handlers" in run.stdout and "cpuserve.operator.reconcile" in run.stdout
