"""What pyproject.toml cannot declare: the packages, found under each top-level folder; the generated gRPC stubs;
and the C++ kernels, compiled for every x86 level (engine/layers/kernel_build.py).

Every folder under engine/, serving/ and operator/ is a package of the wheel (csrc/ too: its sources are package
data), so a new subpackage needs no edit here. The stubs of protos/cpuserve/v1 are generated into the build, never
taken from the checkout (they are not committed; `make protos` makes the editable checkout's own). The kernels'
libraries go to cpuserve/engine/kernels/, so nothing is compiled where the wheel is installed; an editable install
compiles none here (its first use builds its CPU's level).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import Distribution, find_namespace_packages, setup
from setuptools.command.bdist_wheel import bdist_wheel
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


def build_kernels(build_lib: Path) -> None:
    """Every level's library of the kernels into the build (the compiled objects are cached: kernel_build.py)."""
    spec = importlib.util.spec_from_file_location("kernel_build", ROOT / "engine" / "layers" / "kernel_build.py")
    kernel_build = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
    spec.loader.exec_module(kernel_build)
    for level in kernel_build.LEVELS:
        kernel_build.build(level, build_lib / "cpuserve" / "engine" / "kernels", progress=kernel_build.print_progress)


class BuildPy(build_py):
    """build_py, plus the gRPC stubs and the kernels in a wheel (an editable install imports the stubs
    `make protos` made and builds its kernels on first use)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            generate_stubs(Path(self.build_lib))
            build_kernels(Path(self.build_lib))


class BinaryDistribution(Distribution):
    """Not pure Python: the wheel holds the kernels' libraries, built for x86-64 Linux."""

    def has_ext_modules(self) -> bool:
        return True


class BdistWheel(bdist_wheel):
    """Tagged for the platform only (py3-none-linux_x86_64): the libraries link torch's C++ libraries, not
    Python's, so any Python 3 that runs torch takes the wheel."""

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


setup(packages=find_cpuserve_packages(), distclass=BinaryDistribution,
      cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
