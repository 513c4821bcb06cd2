"""The peers bench/engine.py compares cpuserve with, measured the same way (see engine_workers.py).

llama.cpp runs in its fastest CPU configuration (flash attention on) through llama-cpp-python's low-level API:
the high-level `Llama` class runs one sequence, so several sequences are one llama_batch with one seq_id each,
one llama_decode per step and a greedy argmax of each sequence's logits. Hugging Face transformers runs eager
fp32, the reference implementation.
"""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np

from cpuserve.engine.settings import BENCH_LLAMA_EXTRA_BUFTS
from workload import kv_tokens, make_prompts


# -- llama.cpp ------------------------------------------------------------------------------------------
class LlamaCpp:
    """One llama.cpp model; a fresh context per measurement, sized for it."""

    def __init__(self, path: str, threads: int):
        import llama_cpp as L

        self.L, self.threads = L, threads
        self._quiet = L.llama_log_callback(lambda level, text, data: None)  # keep a reference: C holds it
        L.llama_log_set(self._quiet, ctypes.c_void_p())
        L.llama_backend_init()
        params = L.llama_model_default_params()
        # ggml's AMX buffer type (built in when the build machine reports AMX) crashes in its mul_mat on some
        # VMs that advertise AMX; CPUSERVE_BENCH_LLAMA_EXTRA_BUFTS=1 turns extra buffer types (AMX, repacking) on
        params.use_extra_bufts = BENCH_LLAMA_EXTRA_BUFTS.get()
        self.model = L.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.ctx = None

    def new_context(self, num_seqs: int, n_ctx: int, n_batch: int) -> None:
        L = self.L
        self.free_context()
        p = L.llama_context_default_params()
        p.n_ctx, p.n_seq_max = n_ctx, num_seqs  # each sequence gets n_ctx / n_seq_max cells
        p.n_batch, p.n_ubatch = n_batch, min(n_batch, 512)
        p.n_threads = p.n_threads_batch = self.threads
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = L.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {p.n_ctx} tokens, {num_seqs} sequences")
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def free_context(self) -> None:
        if self.ctx:
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.ctx = None

    def decode(self, seqs: list[list[int]], start_pos: int) -> np.ndarray:
        """Append each sequence's tokens at start_pos; returns the argmax of each one's last logits."""
        b = self.batch
        i = 0
        for seq_id, tokens in enumerate(seqs):
            for j, token in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i] = token, start_pos + j, 1
                b.seq_id[i][0] = seq_id
                b.logits[i] = j == len(tokens) - 1  # logits only where a token is sampled
                i += 1
        b.n_tokens = i
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(len(seqs), self.n_vocab))
        return logits.argmax(axis=1)

    def prefill(self, prompt: list[int]) -> float:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        self.decode([prompt], 0)
        return len(prompt) / (time.perf_counter() - start)

    def decode_rate(self, prompts: list[list[int]], gen_tokens: int) -> float:
        """Prefill every prompt in one batch, then time gen_tokens - 1 steps of one token per sequence."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        next_ids = self.decode(prompts, 0)
        start = time.perf_counter()
        for step in range(gen_tokens - 1):
            next_ids = self.decode([[int(t)] for t in next_ids], len(prompts[0]) + step)
        return len(prompts) * (gen_tokens - 1) / (time.perf_counter() - start)


class LlamaCppSession:
    """The session bench/engine.py drives (see engine_workers.serve): one measurement per call."""

    def __init__(self, cfg: dict):
        self.cfg, self.llama = cfg, LlamaCpp(cfg["model"], cfg["threads"])
        self.n_ctx = kv_tokens(cfg)  # the same capacity as cpuserve's pool: room for the largest measurement
        self.shape = None  # (sequences, n_batch) of the current context

    def _context(self, num_seqs: int, n_batch: int) -> None:
        if self.shape != (num_seqs, n_batch):  # a new context only when the measure changes, not per repetition
            self.llama.new_context(num_seqs, self.n_ctx, n_batch)
            self.shape = (num_seqs, n_batch)

    def prefill(self, seed: int) -> float:
        self._context(1, self.cfg["prefill_len"])
        return self.llama.prefill(make_prompts(1, self.cfg["prefill_len"], seed)[0])

    def decode(self, batch: int, seed: int) -> float:
        self._context(batch, batch * self.cfg["prompt_len"])
        return self.llama.decode_rate(make_prompts(batch, self.cfg["prompt_len"], seed), self.cfg["gen_tokens"])


# -- Hugging Face transformers --------------------------------------------------------------------------
class StepClock:
    """A logits processor that only notes the time: it is called once per generated token, after the forward."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_decode_rate(model, prompts: list[list[int]], gen_tokens: int) -> float:
    import torch
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts)  # same-length prompts: the padded batch needs no padding, mask is all ones
    clock = StepClock()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_tokens, min_new_tokens=gen_tokens,
                   do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    # call 1 follows the prefill; calls 2..N follow the N - 1 decode forwards we time
    return len(prompts) * (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])


def hf_prefill(model, prompt: list[int]) -> float:
    import torch

    start = time.perf_counter()
    model(torch.tensor([prompt]), logits_to_keep=1)  # as generate's prefill: logits of the last token only
    return len(prompt) / (time.perf_counter() - start)


class HFSession:
    def __init__(self, cfg: dict):
        import torch
        import transformers

        torch.set_num_threads(cfg["threads"])
        transformers.utils.logging.disable_progress_bar()
        folder, file = os.path.split(os.path.abspath(cfg["model"]))
        self.cfg, self.model = cfg, transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=file, dtype=torch.float32, attn_implementation="eager").eval()

    def prefill(self, seed: int) -> float:
        import torch

        with torch.inference_mode():
            return hf_prefill(self.model, make_prompts(1, self.cfg["prefill_len"], seed)[0])

    def decode(self, batch: int, seed: int) -> float:
        import torch

        with torch.inference_mode():
            return hf_decode_rate(self.model, make_prompts(batch, self.cfg["prompt_len"], seed), self.cfg["gen_tokens"])
