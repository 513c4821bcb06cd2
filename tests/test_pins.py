"""One torch for every install: pyproject's build requirement (the kernels link it), its engine extra (what runs) and
constraints.txt (what the Makefile, the Dockerfile, the wheel test and bench/report.py hand pip before it resolves)
name the same release, and every install of the project passes the constraints."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torch_pins(requirements: list[str]) -> set[str]:
    return {r.replace(" ", "") for r in requirements if re.match(r"torch\b", r)}


def test_the_build_the_engine_and_the_constraints_pin_one_torch():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lines = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    constraints = torch_pins([line for line in lines if line])
    build = torch_pins(pyproject["build-system"]["requires"])
    engine = torch_pins(pyproject["project"]["optional-dependencies"]["engine"])
    assert len(constraints) == 1 and next(iter(constraints)).startswith("torch=="), constraints
    assert build == engine == constraints, f"build {build}, engine extra {engine}, constraints.txt {constraints}"


def test_every_install_of_the_project_passes_the_constraints():
    """The Makefile's editable installs and the Dockerfile's wheel install: a pip install of the project without
    `-c ...constraints.txt` would let a dependency's looser torch requirement lead the resolver first."""
    installs = []
    for name in ("Makefile", "Dockerfile"):
        text = (ROOT / name).read_text().replace("\\\n", " ")
        installs += [(name, line) for line in text.splitlines()
                     if "pip install" in line and ("cpuserve-" in line or "-e '." in line)]
    assert {name for name, _ in installs} == {"Makefile", "Dockerfile"}, installs
    missing = [f"{name}: {line.strip()}" for name, line in installs if not re.search(r"-c \S*constraints\.txt", line)]
    assert not missing, missing
