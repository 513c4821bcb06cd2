"""The synchronous engine: validate and queue requests, then step: schedule -> run -> postprocess."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.config import EngineConfig
from cpuserve.engine.errors import InvalidRequest
from cpuserve.engine.grammar import GrammarCompiler
from cpuserve.engine.loader import load_checkpoint
from cpuserve.engine.model_runner import kv_bytes_per_token
from cpuserve.engine.models.rope import long_rope_factors
from cpuserve.engine.output_processor import OutputProcessor
from cpuserve.engine.outputs import StepOutput
from cpuserve.engine.request import Request
from cpuserve.engine.runner import build_runner
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler import Scheduler
from cpuserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from cpuserve.engine.spec.drafter import build_drafter, check_rows_verify_exactly
from cpuserve.engine.spec.policy import SpecPolicy
from cpuserve.engine.threads import (allocator_for_loading, configure_threads, release_free_memory,
                                     slow_openmp_warning, tune_allocator)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of the block pool in use
    num_preemptions: int  # since start
    last_step_seconds: float
    num_free_blocks: int
    num_blocks: int
    num_draft_tokens: int = 0  # since start: speculative draft tokens verified ...
    num_accepted_tokens: int = 0  # ... and of those accepted


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.num_threads = configure_threads(config.num_threads)
        if (warning := slow_openmp_warning()) is not None:
            log.warning("%s", warning)
        check_rows_verify_exactly(config)  # before the model loads
        allocator_for_loading()
        checkpoint = load_checkpoint(config.model, show_progress=False)  # the builder's bar covers the stream
        self.tokenizer = checkpoint.tokenizer
        self.args = checkpoint.args
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.max_model_len = min(config.max_model_len or self.args.max_seq_len, self.args.max_seq_len)
        if (rope := self.args.long_rope) is not None:  # one factor set for the whole run
            is_long = long_rope_factors(rope, self.max_model_len) is rope.long_factor
            log.info("LongRoPE: the %s factors at every position (max_model_len %d %s original_max_position_embeddings "
                     "%d)", "long" if is_long else "short", self.max_model_len, ">" if is_long else "<=",
                     rope.original_max_position_embeddings)
        self.kv_bytes_per_token = kv_bytes_per_token(self.args, config.kv_cache)
        config.num_blocks = int(config.kv_cache_gb * (1 << 30)) // (self.kv_bytes_per_token * config.block_size)
        if config.num_blocks < 1:
            raise ValueError(f"kv_cache_gb={config.kv_cache_gb} holds no block of {config.block_size} tokens "
                             f"({self.kv_bytes_per_token} bytes per token); raise it")
        self.runner = build_runner(config, checkpoint, self.max_model_len)
        self.num_threads = self.runner.num_threads
        # keyed by role: a generated token's KV (decode attention) is not the bits its prefill would give
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          key_by_role=True)
        drafter = build_drafter(config, self.block_manager, self.tokenizer, self.args.vocab_size, self.max_model_len)
        release_free_memory()  # loading (the model's, a draft model's) left fp32 copies of every weight in the heap
        tune_allocator()  # from here on keep freed activations for the next step
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, drafter,
                                   SpecPolicy.from_config(config) if drafter is not None else None)
        self.outputs = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.args.vocab_size,
                                        self.tokenizer.eos_token_ids)
        self._rng = torch.Generator().manual_seed(config.seed)
        self._next_id = 0
        self.last_step_seconds = 0.0
        log.info("engine ready: %s, weights=%s, kv=%s, %d blocks x %d tokens (%.2f GiB), threads=%d",
                 self.model_name, config.weights, config.kv_cache, config.num_blocks, config.block_size,
                 config.kv_cache_gb, self.num_threads)

    # -- requests -------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                     priority: int = 0) -> Request:
        """Validate and tokenize; touches no engine state, so any thread may call it."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or (isinstance(prompt, str) and not prompt):
            raise InvalidRequest("prompt", "prompt is empty: give at least one token of text")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.args.vocab_size]
        if bad:
            raise InvalidRequest("prompt", f"prompt token id {bad[0]!r} is out of range: ids must be in "
                                           f"[0, {self.args.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest("prompt", f"prompt is {len(ids)} tokens: the context holds {self.max_model_len}, so "
                                           f"the prompt must be at most {self.max_model_len - 1} tokens to leave room "
                                           "for one new token")
        if self.block_manager.num_blocks_for(len(ids) + 1) > self.block_manager.num_blocks:
            raise InvalidRequest("prompt", f"prompt is {len(ids)} tokens but the KV pool holds only "
                                           f"{self.block_manager.num_blocks * self.config.block_size}; raise "
                                           "kv_cache_gb")
        bad = [t for t in params.logit_bias if t >= self.args.vocab_size]
        if bad:
            raise InvalidRequest("logit_bias", f"logit_bias: token id {bad[0]} is out of range: ids must be in "
                                               f"[0, {self.args.vocab_size})")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else
                              int(torch.randint(0, 2**62, (1,), generator=self._rng)))
        grammar = self.grammars.matcher(params.structured_output) if params.structured_output is not None else None
        return Request(request_id, ids, params, eos_token_ids=self.tokenizer.eos_token_ids,
                       max_model_len=self.max_model_len, priority=priority, generator=generator, grammar=grammar)

    def add(self, request: Request) -> None:
        self.scheduler.add(request)
        self.outputs.add(request)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        request = self.make_request(prompt, params, request_id, priority)
        self.add(request)
        return request.request_id

    def abort_request(self, request_id: str) -> StepOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self.outputs.finished_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        outputs = [self.outputs.finished_output(r) for r in out.finished]
        if out.is_empty:
            return outputs
        start = time.perf_counter()
        result = self.runner.run(out)
        self.last_step_seconds = time.perf_counter() - start
        for request, token_id, logprob in self.scheduler.postprocess(out, result):
            text, status = self.outputs.decode(request, token_id)
            if status is not None:
                self.scheduler.finish(request, status)
            chunk = self.outputs.token_output(request, token_id, text, logprob)
            if outputs and outputs[-1].request_id == request.request_id:  # accepted draft tokens: one chunk a step
                chunk = outputs.pop().merge(chunk)
            outputs.append(chunk)
        return outputs

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position of a prompt, [L, V] float32 (for perplexity and reference checks).

        Runs chunked prefill through the same pool and kernels as generation, outside the scheduler's queues.
        """
        request = self.make_request(token_ids, SamplingParams(max_tokens=1))
        if not self.block_manager.allocate_slots(request, request.num_tokens):
            raise ValueError(f"the KV pool has no room for {request.num_tokens} tokens now; retry when idle")
        logits = []
        try:
            step = self.config.max_num_batched_tokens
            for start in range(0, request.num_tokens, step):
                request.num_computed_tokens = start
                item = ScheduledRequest.of(request, min(step, request.num_tokens - start), self.config.block_size)
                logits.append(self.runner.forward_logits(SchedulerOutput([item])))
        finally:
            self.block_manager.free(request)
        return torch.cat(logits)

    def health(self) -> str | None:
        """Why this engine cannot serve any more (a replica group's failed step or dead rank), or None."""
        return self.runner.health()

    def populate_kv(self) -> bool:
        """Idle work: fault in the next part of the KV pools (ModelRunner.populate_kv), the model's (every rank's in
        a replica group), then a draft model's; whether any is left."""
        drafter = self.scheduler.drafter
        return self.runner.populate_kv() or (drafter is not None and drafter.populate_kv())

    def close(self) -> None:
        """Stop the replica group's worker processes (a single-rank engine has nothing to stop)."""
        self.runner.close()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        s = self.scheduler
        return EngineStats(s.num_running, s.num_waiting, bm.usage, s.num_preemptions, self.last_step_seconds,
                           bm.num_free_blocks, bm.num_blocks, s.num_draft_tokens, s.num_accepted_tokens)
