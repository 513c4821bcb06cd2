"""What pyproject.toml cannot declare: the packages, found under each top-level folder, and the generated gRPC stubs.

Every folder under engine/, serving/ and operator/ is a package of the wheel (csrc/ too: its sources are package
data), so a new subpackage needs no edit here. The stubs of protos/cpuserve/v1 are generated into the build, never taken from the
checkout (they are not committed; `make protos` makes the editable checkout's own).
"""
from __future__ import annotations

from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# import name -> folder: the same mapping as pyproject.toml's [tool.setuptools.package-dir]
PACKAGE_DIRS = {"cpuserve.engine": "engine", "cpuserve.serving": "serving", "cpuserve.operator": "operator",
                "cpuserve.v1": "protos/cpuserve/v1"}
PROTO = "protos/cpuserve/v1/inference.proto"


def find_cpuserve_packages() -> list[str]:
    """Each top-level package and every package found below its folder."""
    return [name for package, folder in PACKAGE_DIRS.items()
            for name in (package, *(f"{package}.{sub}" for sub in
                                  find_namespace_packages(str(ROOT / folder), exclude=["*__pycache__*"])))]


def generate_stubs(build_lib: Path) -> None:
    """protoc's Python, typing and gRPC modules of the proto, written into the build as cpuserve/v1/*."""
    from grpc_tools import protoc

    out = str(build_lib)
    argv = ["protoc", "-Iprotos", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", PROTO]
    if protoc.main(argv) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


class BuildPy(build_py):
    """build_py, plus the gRPC stubs in a wheel (an editable install imports the ones `make protos` made)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            generate_stubs(Path(self.build_lib))


setup(packages=find_cpuserve_packages(), cmdclass={"build_py": BuildPy})
