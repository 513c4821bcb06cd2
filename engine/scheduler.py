"""Iteration-level continuous batching with a token budget, chunked prefill, preemption and prefix caching.

One step: `out = scheduler.schedule()`, the runner computes `out` (scheduler_output.py) into a ModelRunnerOutput,
`scheduler.postprocess(out, result)` appends the new tokens. With a drafter (engine/spec/), a running request may
run its last token with a few draft tokens after it; postprocess then appends the accepted ones and the token after
them, and hands back the blocks the rejected ones took. Whether a request ends is decided once, by the
engine's OutputProcessor, which then calls `finish`. The scheduler never imports torch and reaches the KV pool
only through the BlockManager.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import Iterator

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.outputs import ModelRunnerOutput, TokenLogprob
from cpuserve.engine.request import Request, RequestStatus
from cpuserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from cpuserve.engine.spec.drafter import Drafter
from cpuserve.engine.spec.policy import SpecPolicy


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 drafter: Drafter | None = None, spec_policy: SpecPolicy | None = None):
        assert (drafter is None) == (spec_policy is None), "a drafter goes with its policy"
        self.block_manager = block_manager
        self.drafter = drafter
        self.spec_policy = spec_policy
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
        self.num_steps = 0
        self.num_draft_tokens = 0  # since start: draft tokens verified, and of those accepted
        self.num_accepted_tokens = 0
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
        if self.drafter is not None:
            self.drafter.forget(request.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.num_steps += 1
        drafting = self.drafter is not None and self.spec_policy.is_on(len(self.running))
        if drafting:
            self._prepare_drafts(budget)
        i = 0
        while i < len(self.running) and budget > 0:  # running first: decodes and unfinished prefills
            request = self.running[i]
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            draft = self._draft(request, budget, i) if drafting else []
            if draft and not self.block_manager.allocate_slots(request, num_new + len(draft)):
                draft = []  # no room for the draft: the request runs its token alone
            if draft or self._allocate_or_preempt(request, num_new, i, out):
                out.scheduled.append(self._item(request, num_new, draft))
                budget -= num_new + len(draft)
                i += 1
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        out.scheduled.sort(key=lambda s: not s.is_decode)
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, i: int, out: SchedulerOutput) -> bool:
        """Make room for running[i]'s next tokens, preempting the latest-arrived lowest-priority requests from i on
        until they fit; False when running[i] itself was preempted."""
        while not self.block_manager.allocate_slots(request, num_new):
            victim = max(self.running[i:], key=lambda r: (r.priority, r.arrival_time))
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _prepare_drafts(self, budget: int) -> None:
        """Let the drafter make the step's drafts at once (a draft model batches them): for each running request that
        may draft, at most what the whole budget would leave it; _draft cuts that to what is left at its turn."""
        requests, sizes = [], []
        for i, request in enumerate(self.running):
            if num_draft := self.spec_policy.max_draft(request, self.num_steps, budget - (len(self.running) - i - 1)):
                requests.append(request)
                sizes.append(num_draft)
        self.drafter.prepare(requests, sizes)

    def _draft(self, request: Request, budget: int, i: int) -> list[int]:
        """running[i]'s draft, from what the budget and the pool leave after one token for each request after it: a
        draft never takes another request's step, nor makes the scheduler preempt one."""
        num_after = len(self.running) - i - 1
        num_draft = self.spec_policy.max_draft(request, self.num_steps, budget - num_after)
        if not num_draft:
            return []
        draft = self.drafter.propose(request, num_draft)
        bm = self.block_manager
        num_needed = bm.num_blocks_for(request.num_tokens + len(draft)) - len(request.block_ids)
        return draft if num_needed + num_after <= bm.num_free_blocks else []

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
                    ) -> Iterator[tuple[Request, int, TokenLogprob | None]]:
        """Advance counters and append the new tokens, yielding (request, token, logprob) for each.

        A generator: iterate it to the end. Each token is appended just before it is yielded, so a consumer that
        finishes the request on it (a stop) drops the rest of the request's accepted draft. Requests that ended
        while the step ran (aborted) are skipped. Nothing here decides a stop.
        """
        for item, token_ids, logprobs in zip(out.scheduled, result.token_ids, result.logprobs):
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += len(item.token_ids) - item.num_draft_tokens
            self.block_manager.cache_full_blocks(request)
            if item.needs_sample:
                assert token_ids, f"request {item.request_id} sampled no token"
                yield from self._append(request, item, token_ids, logprobs)

    def _append(self, request: Request, item: ScheduledRequest, token_ids: list[int],
                logprobs: list[TokenLogprob | None]) -> Iterator[tuple[Request, int, TokenLogprob | None]]:
        """The new tokens of one request: the accepted draft tokens (their KV is this step's) and the one after."""
        if item.num_draft_tokens:
            request.num_draft_tokens += item.num_draft_tokens
            self.num_draft_tokens += item.num_draft_tokens
        for j, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
            if j:  # the token before this one was an accepted draft token, whose KV this step computed
                request.num_computed_tokens += 1
                self.block_manager.cache_full_blocks(request)
            if j < len(token_ids) - 1:  # an accepted draft token
                request.num_accepted_tokens += 1
                self.num_accepted_tokens += 1
            request.append_token(token_id)
            yield request, token_id, logprob
            if request.status != RequestStatus.RUNNING:  # finished on that token
                return
        if item.num_draft_tokens:
            self.spec_policy.record(request, len(token_ids) - 1, item.num_draft_tokens, self.num_steps,
                                    len(self.running))
            self.block_manager.trim(request, request.num_tokens)  # the rejected draft tokens' blocks

    def _item(self, request: Request, num_tokens: int, draft: list[int] = ()) -> ScheduledRequest:
        return ScheduledRequest.of(request, num_tokens, self.block_manager.block_size, draft)

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
