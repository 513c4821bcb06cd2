"""The pod memory the operator computes (limit = request) against what the engine measurably holds: its weights
against the plan's weights term, and each rank's peak RSS against the pod's limit, for the embedded SmolLM2 on one
rank and on a 2-rank group, for a file laid out as llama.cpp's Q4_K_M, and with a draft model. An under-estimate is an
OOM kill.

The engine runs in a process of its own (as in a rank pod, without Ray), sized as the LLMService asks, and serves
a batch of prompts, so the peak includes a step's activations. Ray's own processes are not measured here.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpuserve.operator.memory import plan_memory
from cpuserve.operator.settings import OperatorSettings
from cpuserve.operator.validation import validate
from llmservice_factory import make_body

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KV_GB = 0.25
# the engine as a rank pod runs it, then its weights' bytes and the peak RSS of every rank process
MEASURE = """
import json, resource, sys
from cpuserve.engine.llm import LLM
from cpuserve.engine.sampling_params import SamplingParams
model, ranks, kv_gb, spec = sys.argv[1] or None, int(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(model=model, ranks=ranks, num_threads=1, kv_cache_gb=kv_gb, show_progress=False, **spec)
runner = llm.engine.runner
while llm.engine.populate_kv():  # served, an idle engine faults its KV pools in (engine/huge_pages.py), a draft's too
    pass
tensors = {t.data_ptr(): t.nbytes for t in [*runner.model.parameters(), *runner.model.buffers()]} if ranks == 1 else {}
llm.generate([f"Tell me story number {i} about a cat." for i in range(8)], SamplingParams(max_tokens=48))
llm.engine.close()  # the other ranks' processes end: their peak is the children's
# this process's own peak: VmHWM starts afresh at exec, where ru_maxrss keeps the peak of the process that forked it
# (pytest's, 4 GiB by the end of the whole suite)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"weights": sum(tensors.values()), "rank0": hwm * 1024,
                  "others": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> tuple[str, int]:
    """A tiny Llama laid out as llama.cpp's Q4_K_M, and its parameter count."""
    import gguf

    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    import kquant_factory

    path = tmp_path_factory.mktemp("q4km") / "model.gguf"
    kquant_factory.write_q4_k_m(path)
    return str(path), sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


def measure(model: str | None, ranks: int, **engine) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", MEASURE, model or "", str(ranks), str(KV_GB), json.dumps(engine)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def plan(model: dict, ranks: int, **spec):
    spec, findings = validate(make_body(model=model, ranksPerReplica=ranks,
                                        resources={"kvCacheGb": KV_GB, "cpusPerRank": 1}, **spec), OperatorSettings())
    assert findings == []
    return plan_memory(spec)


@pytest.mark.parametrize("case", ["embedded", "q4_k_m"])
def test_the_weights_term_and_the_pod_hold_the_engine_on_one_rank(case, q4_k_m):
    if case == "embedded":
        model, source = None, {"source": "embedded"}
    else:
        model, params = q4_k_m
        source = {"source": "pvc", "claimName": "models", "path": "model.gguf", "numParameters": params}
    memory, got = plan(source, 1), measure(model, 1)
    assert got["weights"] <= memory.weights_shard_bytes, memory.arithmetic
    assert got["rank0"] <= memory.limit_bytes, (got, memory.arithmetic)


def test_the_pod_holds_each_rank_of_a_2_rank_group():
    memory, got = plan({"source": "embedded"}, 2), measure(None, 2)
    assert got["others"] > 0  # rank 1 ran as a child process and was measured
    assert max(got["rank0"], got["others"]) <= memory.limit_bytes, (got, memory.arithmetic)


def test_the_rank_0_pod_holds_a_draft_model_too():
    """The embedded SmolLM2 drafting for itself (the spec's defaults: int4 weights, a 0.25 GiB draft KV pool), with
    both KV pools faulted in: rank 0's peak within the pod's limit, which counts the draft's weights and KV."""
    memory = plan({"source": "embedded"}, 1, speculative={"method": "draft"})
    got = measure(None, 1, speculative="draft", spec_draft_kv_cache_gb=0.25)
    assert memory.draft_bytes > 0.25 * 2**30
    assert got["rank0"] <= memory.limit_bytes, (got, memory.arithmetic)
