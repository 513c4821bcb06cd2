"""OpenVINO GenAI as a bench/engine.py peer: it loads the GGUF itself, measured as engine_workers measures cpuserve.

Runs in its own venv (peer_envs.py) with that venv's python. The model is the same GGUF file every engine gets:
GenAI's GGUF reader (the default legacy one covers llama) keeps Q4_0/Q4_1/Q8_0 weights quantized, so this is
OpenVINO's int4-weight CPU path, with its default u8 KV cache. Every measure goes through the continuous-batching
pipeline (paged attention, one scheduler step = one forward of every running sequence): it is GenAI's serving
path and the one that batches, so prefill, decode b1 and decode b8/b32 are the same engine, as for cpuserve.
"""
from __future__ import annotations

import os
import time

from workload import kv_tokens, make_prompts


def build_properties(threads: int) -> dict:
    """CPU plugin settings: `threads` inference threads in one stream, pinned, latency-first."""
    return {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "ENABLE_CPU_PINNING": True,
            "PERFORMANCE_HINT": "LATENCY"}


def build_scheduler_config(cfg: dict):
    """KV blocks for the largest measurement (as cpuserve's pool), one step able to take the largest prefill."""
    import openvino_genai as g

    sc = g.SchedulerConfig()
    block_size = 32  # the CPU plugin's paged-attention block
    sc.num_kv_blocks = -(-kv_tokens(cfg) // block_size) + max(cfg["batches"], default=1)
    sc.max_num_seqs = max(cfg["batches"], default=1)
    # a whole prompt (or a whole batch of prompts) per step: chunking it would time the scheduler, not the model
    sc.max_num_batched_tokens = max(cfg.get("prefill_len", 0), max(cfg["batches"], default=1) * cfg["prompt_len"])
    sc.enable_prefix_caching = False  # every prompt is new anyway (random, per repetition)
    return sc


class OpenVINOSession:
    """One loaded ContinuousBatchingPipeline; prefill() and decode() each return one measurement in tokens/s."""

    def __init__(self, cfg: dict):
        import openvino_genai as g

        os.environ.setdefault("OMP_NUM_THREADS", str(cfg["threads"]))
        self.cfg, self.g = cfg, g
        self.pipe = g.ContinuousBatchingPipeline(os.path.abspath(cfg["model"]), build_scheduler_config(cfg), "CPU",
                                                 build_properties(cfg["threads"]))
        self.next_id = 0

    def _params(self, max_new_tokens: int):
        gc = self.g.GenerationConfig()
        gc.max_new_tokens, gc.min_new_tokens = max_new_tokens, max_new_tokens
        gc.do_sample, gc.ignore_eos = False, True  # greedy
        return gc

    def _add(self, prompts: list[list[int]], max_new_tokens: int) -> list:
        import numpy as np
        import openvino as ov

        handles = []
        for p in prompts:
            ids = ov.Tensor(np.asarray([p], dtype=np.int64))  # input_ids: [1, L]
            handles.append(self.pipe.add_request(self.next_id, ids, self._params(max_new_tokens)))
            self.next_id += 1
        return handles

    def _new_tokens(self, handles: list) -> list[int]:
        """Tokens each handle produced since the last read (read() hands out only what is new)."""
        counts = []
        for h in handles:
            counts.append(sum(len(o.generated_ids) for o in h.read().values()) if h.can_read() else 0)
        return counts

    def prefill(self, seed: int) -> float:
        return self.burst(1, self.cfg["prefill_len"], seed)

    def burst(self, count: int, length: int, seed: int) -> float:
        """Prompt tokens/s of `count` prompts of `length` tokens added together, up to every first token."""
        start = time.perf_counter()
        handles = self._add(make_prompts(count, length, seed), 1)
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
        self._new_tokens(handles)
        return count * length / (time.perf_counter() - start)

    def decode(self, batch: int, seed: int) -> float:
        """Aggregate decode tokens/s, counted once every sequence has its first token (as cpuserve_decode)."""
        handles = self._add(make_prompts(batch, self.cfg["prompt_len"], seed), self.cfg["gen_tokens"])
        produced = [0] * batch
        start, num_timed = None, 0
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            new = self._new_tokens(handles)
            if start is not None:
                num_timed += sum(new)
                continue
            produced = [a + b for a, b in zip(produced, new)]
            if all(produced):  # decode starts now
                start = time.perf_counter()
        num_timed += sum(self._new_tokens(handles))  # anything left unread after the last step
        if start is None or num_timed == 0:
            raise RuntimeError("OpenVINO finished every sequence during prefill: nothing to time")
        return num_timed / (time.perf_counter() - start)
