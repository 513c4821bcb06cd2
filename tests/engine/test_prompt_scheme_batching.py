"""Prompt rows end to end, with the default engine: in every step each linear layer gets the rows that are prompt tokens
(a row's position below its request's prompt length), the lm_head none, whatever the batch holds; and a prompt's greedy
tokens are the same alone, batched with other requests in chunks of 512 and of 32 tokens, and under preemption.

Where the prompt kernel (amx_bf16_gemm) is not built every row runs the int8 scheme, so the same checks also run with
the prompt scheme's plain-torch reference in the kernel's place: that is what gives the token checks teeth today.

Under preemption the tokens are compared up to each request's first preemption only: a recomputed generated token's
row runs prefill attention where it first ran decode attention, and the two differ in the last bits (on a Xeon with AMX
its logits by up to 0.1 on SmolLM2), so a near-tie after a recompute can go either way whichever GEMM scheme runs.
The roles of the recomputed rows are checked exactly, by the prompt rows each layer gets."""
from __future__ import annotations

import pytest
import torch

from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import QuantLinear
from cpuserve.engine.layers.linear.act_int8 import Int8ActLinear
from cpuserve.engine.llm import LLM

from test_batching import make_prompts, params

pytestmark = pytest.mark.slow
NUM_PROMPTS = 10


class RoleWatch:
    """Wraps an engine's runner: in every step run op by op, each linear layer must get the prompt rows the requests'
    roles give (computed here from positions and prompt lengths, not from the scheduler's counts), the lm_head none."""

    def __init__(self, llm: LLM, prompt_lens: dict[str, int]):
        self.prompt_lens = prompt_lens
        self.expected: tuple = ()
        self.num_checked = 0  # linear calls checked
        self.num_recomputed = 0  # generated tokens recomputed in a prefill chunk (a preempted request's)
        self.first_preempted: dict[str, int] = {}  # request -> output tokens it had when first preempted
        self.runner = runner = llm.engine.runner
        run = runner.run
        runner.run = lambda out: run(self._step(out))
        self.lm_head = runner.model.lm_head
        # every layer (a StackedLinear's parts are not called as modules, the StackedLinear is)
        self.hooks = [m.register_forward_hook(self._check, with_kwargs=True) for m in runner.model.modules()
                      if isinstance(m, QuantLinear)]

    def close(self) -> None:
        del self.runner.run  # the class's again
        for hook in self.hooks:
            hook.remove()

    def _step(self, out):
        rows = []
        for item in out.scheduled:
            num_prompt = self.prompt_lens[item.request_id]
            rows += [p < num_prompt for p in item.positions]
            if not item.is_decode:
                self.num_recomputed += sum(p >= num_prompt for p in item.positions)
        for request in out.preempted:
            self.first_preempted.setdefault(request.request_id, request.num_output_tokens)
        self.expected = tuple(_runs(rows))
        return out

    def _check(self, module, args, kwargs, output) -> None:
        want = () if module is self.lm_head else self.expected
        assert kwargs.get("prompt_rows", ()) == want, (module, kwargs.get("prompt_rows"), want)
        self.num_checked += 1


def _runs(flags: list[bool]):
    """[start, stop) of each run of True in flags."""
    start = None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            yield start, i
            start = None


def alone(llm: LLM, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt on its own, one after the other."""
    tokens = {}
    for request_id, ids in prompts.items():
        llm.engine.add_request(ids, params(int(request_id[1:])), request_id=request_id)
        tokens[request_id] = []
        while llm.engine.has_unfinished_requests():
            for chunk in llm.engine.step():
                tokens[chunk.request_id].extend(chunk.new_token_ids)
    return tokens


def staggered(llm: LLM, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """A new request every step while the earlier ones run (test_batching.run_staggered with these ids)."""
    engine, tokens, pending = llm.engine, {}, list(prompts.items())
    while pending or engine.has_unfinished_requests():
        if pending:
            request_id, ids = pending.pop(0)
            engine.add_request(ids, params(int(request_id[1:])), request_id=request_id)
            tokens[request_id] = []
        for chunk in engine.step():
            tokens[chunk.request_id].extend(chunk.new_token_ids)
    return tokens


def check_roles_and_tokens(roomy: LLM, small: LLM) -> dict[str, list[int]]:
    """roomy: the default engine; small: chunks of 32 tokens and a pool of 12 blocks of 16 tokens, so that the
    requests preempt each other and recompute their generated tokens. Returns the tokens alone."""
    prompts = {f"r{i}": ids for i, ids in enumerate(make_prompts(roomy)[:NUM_PROMPTS])}
    lens = {request_id: len(ids) for request_id, ids in prompts.items()}
    watches = [RoleWatch(roomy, lens), RoleWatch(small, lens)]
    try:
        expected = alone(roomy, prompts)
        assert staggered(roomy, prompts) == expected  # batched, prompts whole (512 tokens a step)
        tokens = staggered(small, prompts)
    finally:
        for w in watches:
            w.close()
    watch = watches[1]
    assert watch.first_preempted and watch.num_recomputed > 0  # preempted requests recomputed generated tokens
    for request_id, want in expected.items():
        n = watch.first_preempted.get(request_id, len(want))
        assert tokens[request_id][:n] == want[:n], f"{request_id} in chunks of 32, first preempted after {n} tokens"
    assert len(tokens) == len(expected) and all(len(tokens[r]) == len(want) for r, want in expected.items())
    assert all(w.num_checked > 0 for w in watches)
    return expected


def small_engine(roomy: LLM) -> LLM:
    gb = 12 * 16 * roomy.engine.kv_bytes_per_token / 2**30
    return LLM(kv_cache_gb=gb, max_num_batched_tokens=32, show_progress=False)


def test_the_default_engine_gives_each_row_its_role_and_each_prompt_its_tokens(llm_int4):
    check_roles_and_tokens(llm_int4, small_engine(llm_int4))  # llm_int4: the default engine's settings


def _reference_prompt_gemm(rows: list[int], self: Int8ActLinear, x2: torch.Tensor, y: torch.Tensor) -> None:
    """The prompt scheme (bf16 weights and activations) with sums in fp64 instead of fp32: bf16 products are exact and
    a sum of a few thousand of them keeps ~40 bits, so after the rounding to bf16 a row's bits never depend on how
    the GEMM blocks the batch (torch's fp32 matmul gives a row other bits at 5 rows than at 17)."""
    w = self.__dict__.get("_stand_in_weight")
    if w is None:
        w = self.__dict__["_stand_in_weight"] = self.dequantize().to(torch.bfloat16)  # as prompt_reference's
    y.copy_((x2.double() @ w.double().t()).to(torch.bfloat16))
    rows.append(x2.shape[0])


def test_with_the_prompt_scheme_each_row_keeps_its_role_and_each_prompt_its_tokens(monkeypatch):
    rows: list[int] = []
    monkeypatch.setattr(Int8ActLinear, "has_prompt_kernel", lambda self: True)
    monkeypatch.setattr(Int8ActLinear, "_prompt_gemm_into",
                        lambda self, x2, y: _reference_prompt_gemm(rows, self, x2, y))
    # gate_up's fused SiLU is the AMX kernel's too: without AMX-BF16 the stand-in GEMM runs and SiLU follows it
    monkeypatch.setattr(Int8ActLinear, "has_prompt_silu_kernel", lambda self: native.amx_bf16_gemm_enabled())
    roomy = LLM(kv_cache_gb=0.25, show_progress=False)
    small = small_engine(roomy)
    expected = check_roles_and_tokens(roomy, small)
    assert sum(rows) > 0
    # the next turn of each chat holds the first turn's output in its prompt: on the engine that generated it (its
    # prefix cache holds those blocks, computed as decodes) it gets the tokens it gets on a fresh engine
    prompts = make_prompts(roomy)[:NUM_PROMPTS]
    turns = {f"t{i}": ids + expected[f"r{i}"] + ids[-4:] for i, ids in enumerate(prompts)}
    fresh = LLM(kv_cache_gb=0.25, show_progress=False)
    assert alone(roomy, turns) == alone(fresh, turns)
