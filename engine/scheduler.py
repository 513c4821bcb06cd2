"""Iteration-level continuous batching with a token budget, chunked prefill, preemption and prefix caching.

One step: `out = scheduler.schedule()`, the runner computes `out` (scheduler_output.py) into a ModelRunnerOutput,
`scheduler.postprocess(out, result)` appends the new tokens. Whether a request ends is decided once, by the
engine's OutputProcessor, which then calls `finish`. The scheduler never imports torch and reaches the KV pool
only through the BlockManager.
"""

from __future__ import annotations

import bisect
import itertools
import time

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.outputs import ModelRunnerOutput, TokenLogprob
from cpuserve.engine.request import Request, RequestStatus
from cpuserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # a prompt is not cut to leave a sliver of this many tokens or fewer for the next step: that sliver would cost
        # its sequence a whole step before its first token (8 prompts of 128 arriving together, budget 512: the
        # last one ran 124 tokens in the second step and its last 4, beside 7 decodes, in a third)
        self.max_overrun = max_num_batched_tokens // 16
        self.waiting: list[tuple[tuple, Request]] = []  # sorted by (priority, arrival, seq)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._seq = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use; give each request a unique id")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        assert status.is_finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting = [w for w in self.waiting if w[1] is not request]
        self.block_manager.free(request)
        request.status = status
        self.requests.pop(request.request_id, None)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:  # running first: decodes and unfinished prefills
            request = self.running[i]
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = max(self.running[i:], key=lambda r: (r.priority, r.arrival_time))
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._item(request, num_new))
                budget -= num_new
                i += 1
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        out.scheduled.sort(key=lambda s: not s.is_decode)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0][1]
            computed = self.block_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.block_manager.block_size
            num_new = self._chunk(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(request, num_new, computed):
                if not self.running and self._never_fits(request):
                    self.waiting.pop(0)
                    self.finish(request, RequestStatus.FINISHED_LENGTH)
                    out.finished.append(request)
                    continue
                break
            self.waiting.pop(0)
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(self._item(request, num_new))
            budget -= num_new
        return budget

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens of a sequence to run this step: as many as the budget leaves, or all of them when no more than
        max_overrun would be left over (a step then runs up to max_overrun tokens past the budget)."""
        return remaining if remaining - budget <= self.max_overrun else budget

    def _never_fits(self, request: Request) -> bool:
        return self.block_manager.num_blocks_for(request.num_tokens) > self.block_manager.num_blocks

    def postprocess(self, out: SchedulerOutput, result: ModelRunnerOutput
                    ) -> list[tuple[Request, int, TokenLogprob | None]]:
        """Advance counters and append the sampled tokens; returns (request, token, logprob) per new token.

        Requests that ended while the step ran (aborted) are skipped. Nothing here decides a stop.
        """
        advanced = []
        for item, token_id, logprob in zip(out.scheduled, result.token_ids, result.logprobs):
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += len(item.token_ids)
            self.block_manager.cache_full_blocks(request)
            if item.needs_sample:
                assert token_id is not None, f"request {item.request_id} sampled no token"
                request.append_token(token_id)
                advanced.append((request, token_id, logprob))
        return advanced

    def _item(self, request: Request, num_tokens: int) -> ScheduledRequest:
        return ScheduledRequest.of(request, num_tokens, self.block_manager.block_size)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, queue again at the front of its class."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._seq))
        bisect.insort(self.waiting, (key, request), key=lambda w: w[0])
