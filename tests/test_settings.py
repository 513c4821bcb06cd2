"""The CPUSERVE_* environment variables come from one declaration (engine/settings.py): every name the tree mentions
is declared, every declared one is read (through its declaration, never os.environ), a value outside the allowed
ones is refused naming the variable, and README's table is the declaration's rendering."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cpuserve.engine import settings
from cpuserve.engine.settings import OPERATOR_PREFIX, SERVE_PREFIX, SETTINGS, Setting
from cpuserve.operator.settings import OperatorSettings
from cpuserve.serving.config import ServeConfig

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "serving", "operator", "bench", "tests", "charts", "docs")
FILES = ("README.md", "Makefile", "Dockerfile", "pyproject.toml", "setup.py")
CSRC = ROOT / "engine" / "csrc"
NAME = re.compile(r"CPUSERVE_[A-Z0-9_]*")
# the C++ names its macros CPUSERVE_*: what its preprocessor defines or tests is no variable
MACRO = re.compile(r"#\s*(?:define|undef)\s+(CPUSERVE_\w+)|defined\((CPUSERVE_\w+)\)")
GETENV = re.compile(r"getenv\(\"(CPUSERVE_\w+)\"\)")
# a Python read that bypasses the declaration
RAW_READ = re.compile(r"(?:environ\.get\(|environ\[|getenv\()\s*[\"']CPUSERVE_")
CONSTANTS = {s.name: const for const, s in vars(settings).items() if isinstance(s, Setting)}


def tree_files() -> list[Path]:
    files = [ROOT / name for name in FILES if (ROOT / name).exists()]
    for folder in FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix not in (".so", ".o", ".gguf", ".png", ".pyc")]
    return sorted(set(files) - {Path(__file__).resolve()})  # this file's own examples are not the tree's


def macros() -> set[str]:
    return {a or b for p in CSRC.rglob("*") if p.is_file() for a, b in MACRO.findall(p.read_text())}


def family_names() -> set[str]:
    """The pydantic families' variables: a prefix and a field."""
    return ({SERVE_PREFIX + f.upper() for f in ServeConfig.model_fields}
            | {OPERATOR_PREFIX + f.upper() for f in OperatorSettings.model_fields})


def test_every_cpuserve_name_in_the_tree_is_declared():
    known = set(SETTINGS) | family_names() | {"CPUSERVE_", SERVE_PREFIX, OPERATOR_PREFIX}
    skip = macros()
    unknown = []
    for path in tree_files():
        text = path.read_text(errors="replace")
        names = set(GETENV.findall(text)) if CSRC in path.parents else set(NAME.findall(text)) - skip
        unknown += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(names - known)]
    assert unknown == [], "declare these in engine/settings.py (or fix the name)"


def test_no_declared_name_is_also_a_family_field():
    assert set(SETTINGS) & family_names() == set()


def test_every_declared_setting_is_read_through_its_declaration():
    """Read (`CONST.get(`) by Python somewhere, or by the C++ (getenv, with Python checking it where the kernels
    load); a variable the operator only sets on its pods is named there (`CONST.name`)."""
    declaration = ROOT / "engine" / "settings.py"
    python = "\n".join(p.read_text() for p in tree_files() if p.suffix == ".py" and p != declaration)
    cpp = "\n".join(p.read_text() for p in CSRC.rglob("*") if p.is_file())
    unread = []
    for name, setting in SETTINGS.items():
        use = ".name" if setting.scope == "pods" else ".get("
        if not re.search(rf"\b{CONSTANTS[name]}{re.escape(use)}", python):
            unread.append(name)
    assert unread == []
    assert set(GETENV.findall(cpp)) <= {name for name, s in SETTINGS.items() if s.scope == "engine"}


def test_no_code_reads_a_cpuserve_variable_from_the_environment_itself():
    """(Tests may save and restore a variable around a test.)"""
    code = [p for p in tree_files() if p.suffix == ".py" and p.relative_to(ROOT).parts[0] != "tests"]
    raw = [f"{p.relative_to(ROOT)}:{i + 1}" for p in code
           for i, line in enumerate(p.read_text().splitlines()) if RAW_READ.search(line)]
    assert raw == []


def _bad_value(setting: Setting) -> str:
    return "2" if setting.type is bool else "x1" if setting.type is int else "bogus"


CHECKED = [s for s in SETTINGS.values() if s.type is not str or s.choices]


@pytest.mark.parametrize("setting", CHECKED, ids=[s.name for s in CHECKED])
def test_a_value_outside_the_allowed_is_refused_naming_the_variable(setting):
    bad = _bad_value(setting)
    with pytest.raises(ValueError, match=rf"^{setting.name}='{bad}': (allowed values are|must be) "):
        setting.get({setting.name: bad})


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=list(SETTINGS))
def test_unset_or_empty_is_the_default_and_each_allowed_value_reads_as_itself(setting):
    assert setting.get({}) == setting.default and setting.get({setting.name: " "}) == setting.default
    for raw in setting.choices:
        assert setting.get({setting.name: raw}) == raw
    if setting.type is bool:
        assert (setting.get({setting.name: "0"}), setting.get({setting.name: "1"})) == (False, True)
        assert setting.get({setting.name: setting.text(setting.default)}) == setting.default


def test_the_switches_that_took_a_typo_for_the_default_refuse_it(monkeypatch):
    """CPUSERVE_OPENMP, _HUGE_PAGES, _SPLIT_CORES and _AMX read anything but one value as the default before; now
    their readers fail naming the variable."""
    from cpuserve.engine import huge_pages, threads
    from cpuserve.engine.layers import native
    from cpuserve.serving import affinity

    readers = {"CPUSERVE_OPENMP": threads.intel_openmp_library, "CPUSERVE_HUGE_PAGES": huge_pages.enabled,
               "CPUSERVE_SPLIT_CORES": lambda: affinity.split_cores([0, 1, 2, 3], 2),
               "CPUSERVE_AMX": native.available}
    monkeypatch.setenv("CPUSERVE_KERNELS", "auto")
    for name, read in readers.items():
        monkeypatch.setenv(name, "of")
        with pytest.raises(ValueError, match=f"^{name}='of': allowed values are"):
            read()
        monkeypatch.delenv(name)


def test_the_kernel_levels_are_kernel_builds():
    from cpuserve.engine.layers import kernel_build

    assert settings.KERNEL_LEVEL.choices == kernel_build.LEVEL_NAMES


def test_readme_table_is_the_declarations():
    readme = (ROOT / "README.md").read_text()
    start = "<!-- python -m cpuserve.engine.settings -->\n"
    table = readme[readme.index(start) + len(start):readme.index("<!-- end -->")]
    assert table == settings.markdown_table(), "rewrite README's table: python -m cpuserve.engine.settings"
