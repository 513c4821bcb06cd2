"""Rank 0's runner for a replica group: broadcast the step, run shard 0, reduce the candidates, sample.

It is a Runner (engine/runner.py) like the single-rank ModelRunner, so the scheduler, the engine's step and the
sampling path (sampler.sample_scheduled) are the single-rank ones.
"""

from __future__ import annotations

import logging
import time

import torch

from cpuserve.engine.distributed import step
from cpuserve.engine.distributed.communicator import Communicator, RankFailedError
from cpuserve.engine.distributed.worker import contribute, run_shard
from cpuserve.engine.model_runner import ModelRunner
from cpuserve.engine.outputs import ModelRunnerOutput
from cpuserve.engine.sampler import sample_candidates, sample_scheduled
from cpuserve.engine.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)


class TPRunner:
    def __init__(self, runner: ModelRunner, comm: Communicator, vocab_size: int, on_close=None, check=None):
        self.runner = runner
        self.comm = comm
        self.vocab_size = vocab_size
        self.plan = runner.model.plan
        self.num_threads = runner.num_threads  # rank 0's, bound to its CPU set before the runner was built
        self.worker_pids: list[int] = []  # set by start_group
        self._on_close = on_close  # stops the worker processes
        self._check = check  # returns why a worker is gone (it may die while the group idles), or None
        self.broken: str | None = None
        self.use_candidates = True  # False: always gather full logits (the benchmark's baseline)
        self.compute_seconds = 0.0  # forward time outside collectives, accumulated (bench/tp.py)
        self._kv_left = True  # some rank has pool regions not yet faulted in (populate_kv)

    def _step(self, out: SchedulerOutput, kind: int, candidates: int) -> torch.Tensor | None:
        """Run one step on the group; rank 0 gets the gathered candidates (or shards)."""
        if self.broken:
            raise RankFailedError(f"replica group is down ({self.broken}); restart the engine")
        try:
            wire = step.pack(out, kind, candidates)
            self.comm.broadcast_ints(wire)
            comm_before, start = self.comm.stats.seconds, time.perf_counter()
            _, _, logits = run_shard(self.runner, wire)
            self.compute_seconds += time.perf_counter() - start - (self.comm.stats.seconds - comm_before)
            return contribute(self.comm, logits, candidates, self.plan.vocab[0])
        except RankFailedError as e:
            self.broken = str(e)
            log.error("replica group failed: %s", e)
            self.close()
            raise

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        inputs = [item.sampling for item in out.samplers]
        candidates = step.num_candidates(inputs, self.plan.vocab_padded) if self.use_candidates else step.FULL
        gathered = self._step(out, step.KIND_SAMPLE, candidates)
        if not inputs:
            return ModelRunnerOutput.place(out.scheduled, [], [])
        if candidates == step.FULL:
            return sample_scheduled(step.dense_from_shards(gathered, self.vocab_size), out.scheduled)  # [S, V]
        values, ids = step.split_candidates(gathered)  # [S, ranks * candidates] each
        return sample_candidates(values, ids, self.vocab_size, out.scheduled)

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits at every scheduled token, [N, V] float32 (scoring)."""
        return step.dense_from_shards(self._step(out, step.KIND_SCORE, step.FULL), self.vocab_size)

    def health(self) -> str | None:
        """Why this group cannot serve any more (a failed step, a worker gone), or None."""
        return self.broken or (self._check() if self._check is not None else None)

    def populate_kv(self) -> bool:
        """Idle work, as ModelRunner.populate_kv on every rank: each faults in the next 2 MiB of its own pools (one
        broadcast and one gather, then nothing once no rank has any left). Returns whether any rank has more. A rank
        lost meanwhile marks the group down, and the next step says so."""
        if not self._kv_left or self.broken:
            return False
        try:
            left = self._step(SchedulerOutput([]), step.KIND_POPULATE, step.FULL)
        except RankFailedError:
            return False
        self._kv_left = bool(left.any())
        return self._kv_left

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close(self)

