"""The measuring side of bench/engine.py: each engine runs in its own process so peak RSS is its own.

    python bench/engine_workers.py TASK < config.json     # one-shot TASK (ONE_SHOT): one JSON line back
    python bench/engine_workers.py --serve ENGINE         # a session (SESSIONS): one JSON request per line

Sessions keep a loaded engine alive so bench/engine.py can interleave repetitions across engines: the machine
is shared, and a load that drifts over minutes then hits every engine alike instead of whichever ran last.
Decode speed everywhere is tokens produced after every sequence has its first token, over the time they took:
prefill is measured apart, never mixed in.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import traceback

from workload import kv_tokens, make_prompts

HERE = os.path.dirname(os.path.abspath(__file__))
# The bench's files (synthetic GGUFs, kept between runs), and the folder workers start in, not the caller's: a
# peer's own `python -m` children (vLLM inspects models in one) put the working directory first on sys.path, and
# the repo's top-level operator/ would shadow the standard library's `operator`
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "cpuserve-bench")


def worker_cwd() -> str:
    os.makedirs(CACHE_DIR, exist_ok=True)
    return CACHE_DIR


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# -- cpuserve -------------------------------------------------------------------------------------------
def cpuserve_prefill(llm, *prompts: list[int]) -> float:
    """Prompt tokens/s of prefilling the prompts together, up to each one's first token."""
    from cpuserve.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm.generate(list(prompts), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def cpuserve_decode(llm, prompts: list[list[int]], gen_tokens: int) -> float:
    """Aggregate decode tokens/s of all prompts under continuous batching, counted once all are prefilled."""
    from cpuserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    started, start, num_timed = set(), None, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if start is not None:
            num_timed += sum(len(o.new_token_ids) for o in outputs)
            continue
        started.update(o.request_id for o in outputs if o.new_token_ids)
        if len(started) == len(prompts):  # every sequence has its first token: decode starts now
            start = time.perf_counter()
    return num_timed / (time.perf_counter() - start)


def load_cpuserve(cfg: dict):
    import torch

    from cpuserve.engine.llm import LLM
    from cpuserve.engine.loader import load_checkpoint
    from cpuserve.engine.model_runner import kv_bytes_per_token

    torch.set_num_threads(cfg["threads"])
    # the pool is pre-allocated and touched at start: size it like llama.cpp's context, not the 1 GiB default,
    # so peak RSS compares like with like (one block of slack per sequence for block rounding)
    args = load_checkpoint(cfg["model"], show_progress=False).args
    tokens = kv_tokens(cfg) + 16 * max(cfg["batches"], default=1)
    kv_gb = tokens * kv_bytes_per_token(args, "int8") / (1 << 30)
    # otherwise the engine's defaults: int8 KV cache; int4 weights and int8 activations unless the bench asks for others
    return LLM(model=cfg["model"], num_threads=cfg["threads"], kv_cache_gb=kv_gb, show_progress=False,
               weights=cfg.get("weights", "int4"), activations=cfg.get("activations", "int8"))


class CpuserveSession:
    """One loaded cpuserve engine; prefill() and decode() each return one measurement in tokens/s."""

    def __init__(self, cfg: dict):
        self.cfg, self.llm = cfg, load_cpuserve(cfg)

    def prefill(self, seed: int) -> float:
        return self.burst(1, self.cfg["prefill_len"], seed)

    def burst(self, count: int, length: int, seed: int) -> float:
        return cpuserve_prefill(self.llm, *make_prompts(count, length, seed))

    def decode(self, batch: int, seed: int) -> float:
        return cpuserve_decode(self.llm, make_prompts(batch, self.cfg["prompt_len"], seed), self.cfg["gen_tokens"])


def profile_cpuserve(cfg: dict) -> dict:
    """Where the time goes: torch.profiler over one decode run per batch size, then over prefill (one prompt of
    prefill_len tokens; four of a quarter of it, which a served burst of short prompts puts in one step), top ops by
    self CPU time. Returns {label: {"tok_s_under_profiler", "table"}}."""
    from torch.profiler import ProfilerActivity, profile

    llm = load_cpuserve(cfg)
    tables = {}

    def profiled(label: str, run) -> None:
        log(f"cpuserve profile: {label}")
        run(1)  # warm-up, on prompts of its own (no prefix-cache hits in the profiled run)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rate = run(2)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=cfg.get("top", 15))
        tables[label] = {"tok_s_under_profiler": rate, "table": table}

    for batch in cfg["batches"]:
        profiled(f"decode, batch {batch}",
                 lambda seed: cpuserve_decode(llm, make_prompts(batch, cfg["prompt_len"], seed), cfg["gen_tokens"]))
    for count in (1, 4):
        length = cfg["prefill_len"] // count
        profiled(f"prefill, {count} x {length}-token prompts",
                 lambda seed: cpuserve_prefill(llm, *make_prompts(count, length, 10 + seed)))
    return {"profile": tables}


# -- attention and KV bytes ---------------------------------------------------------------------------
def measure_attention(cfg: dict) -> dict:
    import torch

    from attention import run, tune_malloc

    torch.set_num_threads(cfg["threads"])
    tune_malloc()  # the engine tunes glibc malloc at start; the kernels are measured the same way
    log(f"attention: SlimAttention vs SDPA prefill at {cfg['attn_lens']} tokens")
    rows = run(prefill_lens=tuple(cfg["attn_lens"]), dtypes=(torch.bfloat16,), batches=(), repeats=cfg["reps"])
    return {"attention": rows}


def measure_kv_bytes(cfg: dict) -> dict:
    from cpuserve.engine.loader import load_checkpoint
    from cpuserve.engine.model_runner import kv_bytes_per_token

    args = load_checkpoint(cfg["model"], show_progress=False).args
    return {"kv_bytes": {dtype: kv_bytes_per_token(args, dtype) for dtype in ("int8", "bf16")}}


def _peer(module: str, name: str):
    """Peers import lazily: a peer's venv (peer_envs.py) has its own packages and not cpuserve's."""
    import importlib

    return getattr(importlib.import_module(module), name)


ONE_SHOT = {"profile": profile_cpuserve, "attention": measure_attention, "kv_bytes": measure_kv_bytes,
            "vllm_prepare": lambda cfg: _peer("peer_vllm", "prepare_checkpoint")(cfg)}
SESSIONS = {"cpuserve": CpuserveSession,
            "llama_cpp": lambda cfg: _peer("peers", "LlamaCppSession")(cfg),
            "hf": lambda cfg: _peer("peers", "HFSession")(cfg),
            "vllm": lambda cfg: _peer("peer_vllm", "VllmSession")(cfg),
            "openvino": lambda cfg: _peer("peer_openvino", "OpenVINOSession")(cfg)}


def _error(e: BaseException) -> str:
    if isinstance(e, ImportError):  # an optional peer (llama_cpp, transformers) that is not installed
        return f"not installed: {e}"
    traceback.print_exc()
    return f"{type(e).__name__}: {str(e)[:200]}"


def run_worker(task: str, cfg: dict, timeout: float | None = None, python: str | None = None,
               env: dict | None = None) -> dict:
    """Run a one-shot TASK in a fresh Python process; returns its numbers, or {"error": why} if it failed.

    python: the interpreter (a peer's venv, see peer_envs.py); default ours; env: variables the process must
    start with, as Worker takes them. The child's stderr (progress,
    tracebacks) goes straight to ours; its answer is the last JSON line of stdout.
    """
    try:
        proc = subprocess.run([python or sys.executable, os.path.join(HERE, "engine_workers.py"), task],
                              input=json.dumps(cfg), stdout=subprocess.PIPE, text=True, timeout=timeout,
                              env={**os.environ, **env} if env else None, cwd=worker_cwd())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    answers = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not answers:  # killed (out of memory?) or crashed in native code before answering
        return {"error": f"{task} process died with exit code {proc.returncode} before answering"}
    return json.loads(answers[-1])


class Worker:
    """The parent's handle on a session process: call(op, *args) -> float, close() -> peak RSS in MB.

    After a failure `error` says why and the worker answers nothing more. python: the session's interpreter
    (a peer's venv, see peer_envs.py), default ours; env: variables the process must start with (LD_PRELOAD,
    thread binding). The protocol is JSON lines either way.
    """

    def __init__(self, engine: str, cfg: dict, python: str | None = None, env: dict | None = None):
        self.engine, self.error = engine, None
        self.proc = subprocess.Popen([python or sys.executable, os.path.join(HERE, "engine_workers.py"), "--serve",
                                      engine], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **env} if env else None, cwd=worker_cwd())
        self._send(cfg)

    def _send(self, message: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:  # killed (out of memory?) or crashed in native code
            answer = {"error": f"{self.engine} process died (exit code {self.proc.poll()})"}
        else:
            answer = json.loads(line)
        self.error = self.error or answer.get("error")
        return answer

    def call(self, op: str, *args) -> float | None:
        return None if self.error else self._send({"op": op, "args": list(args)}).get("value")

    def close(self) -> float | None:
        answer = {} if self.proc.poll() is not None else self._send({"op": "done"})
        self.proc.wait()
        return answer.get("peak_rss_mb")


def serve(engine: str) -> None:
    reply = os.fdopen(os.dup(1), "w")  # answers only: anything a library prints goes to stderr instead
    os.dup2(2, 1)

    def send(message: dict) -> None:
        reply.write(json.dumps(message) + "\n")
        reply.flush()

    cfg = json.loads(sys.stdin.readline())
    try:
        session = SESSIONS[engine](cfg)
        send({"ready": True})
    except Exception as e:
        send({"error": _error(e)})
        session = None
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "done":
            break
        try:
            send({"value": getattr(session, request["op"])(*request["args"])})
        except Exception as e:
            send({"error": _error(e)})
    send({"peak_rss_mb": peak_rss_mb()})


def main() -> None:
    if sys.argv[1] == "--serve":
        return serve(sys.argv[2])
    task, cfg = sys.argv[1], json.loads(sys.stdin.read())
    try:
        result = ONE_SHOT[task](cfg)
    except Exception as e:  # reported in the table, never hidden
        result = {"error": _error(e)}
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
