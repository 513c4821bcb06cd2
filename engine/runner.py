"""The runner seam: what the engine needs of whatever computes a step, and the one function that builds it.

    run(out) -> ModelRunnerOutput     compute the scheduled chunks and sample (sampler.sample_scheduled)
    forward_logits(out) -> [N, V]      logits at every scheduled token (scoring), float32
    health() -> str | None             why this runner cannot serve any more, or None
    close()                            stop what it started (a replica group's worker ranks)
    populate_kv() -> bool              fault in the next part of the KV pool while idle; whether any is left

A single rank is a ModelRunner (model_runner.py); a replica group is rank 0's TPRunner (distributed/tp_runner.py),
which drives the other ranks' ModelRunners.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cpuserve.engine.config import EngineConfig
from cpuserve.engine.outputs import ModelRunnerOutput
from cpuserve.engine.scheduler_output import SchedulerOutput


class Runner(Protocol):
    num_threads: int  # torch threads of the process that steps

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    def forward_logits(self, out: SchedulerOutput) -> torch.Tensor: ...

    def health(self) -> str | None: ...

    def close(self) -> None: ...

    def populate_kv(self) -> bool: ...


def build_runner(config: EngineConfig, checkpoint, max_model_len: int) -> Runner:
    """The runner for `config` (config.num_blocks already derived): the whole model here, or a replica group
    whose ranks each build only their shard (no rank ever holds the whole model)."""
    if config.ranks > 1 and checkpoint.args.arch == "gemma3":
        raise ValueError(f"ranks={config.ranks}: replica groups do not run gemma3 models yet; use ranks=1")
    if config.ranks > 1:  # rank 0 here, ranks 1..k-1 in their own processes
        from cpuserve.engine.distributed.group import start_group
        from cpuserve.engine.distributed.sharding import ShardPlan

        ShardPlan.make(checkpoint.args, 0, config.ranks)  # what the group cannot split, refused before it starts

        return start_group(config, max_model_len, checkpoint.args.vocab_size)
    from cpuserve.engine.model_runner import ModelRunner
    from cpuserve.engine.models.builder import build_model

    model = build_model(checkpoint, config.weights, config.group_size, config.show_progress, config.activations)
    return ModelRunner(model, config.kv_cache, config.num_blocks, config.block_size, max_model_len)
