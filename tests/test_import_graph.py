"""No import cycles among the project's modules (engine, serving, operator, bench), read statically.

A cycle works only as long as every import in it stays where it is (inside a function, after a definition);
moving one line then breaks start-up in a way no unit test of either module sees. Imports inside functions and
under TYPE_CHECKING count too: they are edges of the design all the same.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"engine": "cpuserve.engine", "serving": "cpuserve.serving", "operator": "cpuserve.operator"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    for path in (ROOT / "bench").glob("*.py"):  # bench scripts import each other by bare name (bench/ on sys.path)
        mods[path.stem] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                               for a in node.names)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_checker_finds_a_cycle_and_accepts_a_chain():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert "cpuserve.engine.scheduler" in graph["cpuserve.engine.llm_engine"]
    assert "workload" in graph["peers"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
