"""Factories for scheduler-level tests: requests without a model."""

from __future__ import annotations

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.output_processor import token_stop
from cpuserve.engine.outputs import ModelRunnerOutput
from cpuserve.engine.request import Request
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler import Scheduler


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float = 0.0) -> Request:
    return Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=max_tokens, temperature=0),
                   eos_token_ids=frozenset({0}), priority=priority, arrival_time=arrival)


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
                   prefix_caching: bool = True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix_caching), max_num_seqs, budget)


def run_step(scheduler: Scheduler, next_token: int = 7):
    """One step where the 'model' emits `next_token` for every sequence that samples; token-level stops
    (eos, max_tokens) are decided as the engine's OutputProcessor decides them."""
    out = scheduler.schedule()
    samplers = out.samplers
    result = ModelRunnerOutput.place(out.scheduled, [next_token] * len(samplers), [None] * len(samplers))
    for request, _, _ in scheduler.postprocess(out, result):
        status = token_stop(request)
        if status is not None:
            scheduler.finish(request, status)
    return out
