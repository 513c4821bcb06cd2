"""Speculative decoding without a model: the n-gram drafter, the prefix cache's n-gram index, the policy that turns
drafting off, and what the scheduler does with a draft (the step's rows, the budget, the blocks a rejection frees)."""

from __future__ import annotations

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.distributed import step
from cpuserve.engine.outputs import ModelRunnerOutput
from cpuserve.engine.output_processor import token_stop
from cpuserve.engine.request import Request, RequestStatus
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler import Scheduler
from cpuserve.engine.spec.block_index import BlockIndex
from cpuserve.engine.spec.ngram import NgramDrafter
from cpuserve.engine.spec.policy import SpecPolicy

from factories import make_request


def make_spec_scheduler(num_blocks: int = 32, block_size: int = 4, budget: int = 64, k: int = 4, max_batch: int = 8,
                        pause_after: int = 2, pause_steps: int = 3) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    index = BlockIndex(bm.blocks, block_size, 2, 3, max_entries=10_000)
    bm.on_cached = index.add
    return Scheduler(bm, 8, budget, NgramDrafter(2, 3, index), SpecPolicy(k, max_batch, pause_after, pause_steps))


def finish_step(s: Scheduler, out, tokens: dict[str, list[int]]):
    """Run postprocess with the given new tokens per sampling item, deciding stops as the engine does."""
    result = ModelRunnerOutput.place_lists(out.scheduled, [tokens[i.request_id] for i in out.samplers],
                                           [[None] * len(tokens[i.request_id]) for i in out.samplers])
    emitted = []
    for request, token_id, _ in s.postprocess(out, result):
        emitted.append((request.request_id, token_id))
        status = token_stop(request)
        if status is not None:
            s.finish(request, status)
    return emitted


def test_own_context_draft_is_what_followed_the_latest_earlier_match_longest_n_first():
    drafter = NgramDrafter(2, 3)
    # ... 5 6 7 [8 9] ... 6 7 [1 2] ... 6 7: the 3-gram (5 6 7) wins over the later 2-gram (6 7)
    r = Request("r", [5, 6, 7, 8, 9, 3, 6, 7, 1, 2, 4, 5, 6, 7], SamplingParams())
    assert drafter.propose(r, 3) == [8, 9, 3]
    r.append_token(8)  # suffix (6 7 8): continues 9 3 6 ...
    assert drafter.propose(r, 2) == [9, 3]
    r.append_token(0)  # (8 0), (7 8 0): seen nowhere
    assert drafter.propose(r, 4) == []
    fresh = NgramDrafter(2, 3)
    r2 = Request("r2", list(r.all_token_ids) + [6, 7], SamplingParams())
    assert fresh.propose(r2, 3) == drafter.propose(Request("r", r2.all_token_ids, SamplingParams()), 3) == [8, 0, 6]


def test_a_repeating_run_drafts_its_own_period_and_the_suffix_never_matches_itself():
    drafter = NgramDrafter(2, 4)
    assert drafter.propose(Request("a", [1, 2], SamplingParams()), 4) == []
    assert drafter.propose(Request("b", [3, 3, 3, 3], SamplingParams()), 4) == [3]  # (3 3 3) last ended one back


def test_the_prefix_cache_index_drafts_another_requests_text_across_block_boundaries():
    s = make_spec_scheduler(block_size=4, budget=64)
    text = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    s.add(make_request("writer", text, max_tokens=1))
    finish_step(s, s.schedule(), {"writer": [99]})  # prefilled: blocks (10..13), (14..17), (18..21) are cached
    reader = Request("reader", [1, 2, 13, 14], SamplingParams(temperature=0, max_tokens=20))
    assert s.drafter.propose(reader, 6) == [15, 16, 17, 18, 19, 20]  # (13 14) spans two blocks; draft crosses a third
    assert s.drafter.propose(reader, 2) == [15, 16]
    assert s.drafter.propose(Request("x", [1, 21, 22], SamplingParams()), 4) == []  # 22 ends the last full block


def test_an_evicted_block_drafts_nothing():
    bm = BlockManager(4, 4)
    index = BlockIndex(bm.blocks, 4, 2, 2, max_entries=1000)
    bm.on_cached = index.add
    r = make_request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate_slots(r, 9)
    r.num_computed_tokens = 9
    bm.cache_full_blocks(r)
    assert index.lookup((2, 3), 3) == [4, 5, 6] and index.lookup((4, 5), 3) == [6, 7, 8]
    bm.free(r)
    hog = make_request("hog", list(range(50, 66)))
    assert bm.allocate_slots(hog, 16)  # takes every block: the cached ones lose their hashes
    assert index.lookup((2, 3), 3) == [] and index.lookup((4, 5), 3) == []


def test_policy_caps_the_draft_and_pauses_a_request_whose_drafts_keep_failing():
    policy = SpecPolicy(num_tokens=4, max_batch=2, pause_after=2, pause_steps=3)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0), max_model_len=100)
    assert policy.max_draft(r, step=1, budget=64) == 0  # prefill: no output yet
    r.num_computed_tokens = 3
    r.append_token(4)
    assert policy.max_draft(r, 1, 64) == 1  # max_tokens 3, one out: two more, of which the last is never a draft
    assert policy.max_draft(r, 1, 2) == 1 and policy.max_draft(r, 1, 1) == 0  # the budget keeps room for its token
    long = Request("l", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0), max_model_len=7)
    long.num_computed_tokens = 3
    long.append_token(4)
    assert policy.max_draft(long, 1, 64) == 2  # context 7: positions 4, 5 drafted and the token at 6
    seeded = Request("s", [1, 2, 3], SamplingParams(max_tokens=50, seed=1))
    seeded.num_computed_tokens = 3
    seeded.append_token(4)
    assert policy.max_draft(seeded, 1, 64) == 0  # a seeded sampled stream must not depend on the batch
    assert policy.is_on(2) and not policy.is_on(3)
    policy.record(long, 0, 2, step=5, num_running=1)
    assert long.drafts_paused_until == 0
    policy.record(long, 0, 2, step=6, num_running=1)  # second wholly rejected draft in a row: paused for 7, 8, 9
    assert long.drafts_paused_until == 10 and policy.max_draft(long, 9, 64) == 0 and policy.max_draft(long, 10, 64)
    policy.record(long, 0, 2, step=10, num_running=1)
    policy.record(long, 1, 2, step=11, num_running=1)  # an accepted token resets the count
    policy.record(long, 0, 2, step=12, num_running=1)
    assert long.drafts_paused_until == 10


def test_a_request_keeping_little_of_its_drafts_pauses_only_beside_others():
    """Alone, a draft that keeps a quarter of its tokens still saves steps; beside other requests its rejected rows
    cost them, so a running average of the share kept below min_acceptance pauses it (and restarts the average)."""
    policy = SpecPolicy(num_tokens=4, max_batch=8, pause_after=3, pause_steps=5, min_acceptance=0.5)
    alone = Request("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    shared = Request("s", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    for step in range(1, 21):
        policy.record(alone, 1, 4, step=step, num_running=1)  # one of four kept, every time
    assert alone.drafts_paused_until == 0 and alone.draft_acceptance < 0.3
    paused_at = None
    for step in range(1, 21):
        policy.record(shared, 1, 4, step=step, num_running=3)
        if shared.drafts_paused_until and paused_at is None:
            paused_at = step
    # the average falls 1.0 -> 0.81 -> 0.67 -> 0.56 -> 0.48: paused at the fourth draft, for 5 steps
    assert paused_at == 4
    assert shared.draft_acceptance >= 0.5  # restarted at each pause
    keeper = Request("k", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    for step, kept in enumerate([4, 3, 0, 4, 2, 0, 3, 4, 4, 1], start=1):  # most of it kept, two misses apart
        policy.record(keeper, kept, 4, step=step, num_running=3)
    assert keeper.drafts_paused_until == 0


def test_a_draft_is_one_chunk_of_decode_rows_counted_in_the_budget():
    s = make_spec_scheduler(block_size=4, budget=64, k=3)
    s.add(make_request("a", [1, 2, 3, 4, 5, 1, 2], max_tokens=10))
    s.add(make_request("b", [40, 41, 42], max_tokens=10))
    finish_step(s, s.schedule(), {"a": [3], "b": [43]})  # a: ... 1 2 3 -> drafts 4 5 1; b: nothing to match
    out = s.schedule()
    a, b = out.scheduled
    assert (a.token_ids, a.start_pos, a.num_draft_tokens, a.draft, a.is_decode) == ([3, 4, 5, 1], 7, 3, [4, 5, 1], True)
    assert a.num_logit_rows == 4 and a.num_scheduled_prompt_tokens == 0  # draft rows are never prompt rows
    assert (b.token_ids, b.num_draft_tokens, b.num_logit_rows) == ([43], 0, 1)
    assert out.num_batched_tokens == 5
    assert len(a.block_ids) == 3  # positions 0..10
    back = step.unpack(step.pack(out, step.KIND_SAMPLE, 1))[2].scheduled  # the wire carries the draft
    assert [(x.token_ids, x.num_draft_tokens) for x in back] == [([3, 4, 5, 1], 3), ([43], 0)]


def test_a_rejection_keeps_the_accepted_prefix_and_frees_the_draft_blocks():
    s = make_spec_scheduler(block_size=4, budget=64, k=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 1, 2], max_tokens=20)
    s.add(a)
    finish_step(s, s.schedule(), {"a": [3]})  # 9 tokens, 8 computed: 3 blocks
    out = s.schedule()
    assert out.scheduled[0].token_ids == [3, 4, 5, 6, 1] and len(a.block_ids) == 4  # positions 8..12
    free_before = s.block_manager.num_free_blocks
    emitted = finish_step(s, out, {"a": [4, 5, 9]})  # 4 and 5 accepted, 9 instead of 6
    assert emitted == [("a", 4), ("a", 5), ("a", 9)]
    assert a.all_token_ids == [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 9]
    assert a.num_computed_tokens == 11 and len(a.block_ids) == 3  # the block of position 12 went back
    assert s.block_manager.num_free_blocks == free_before + 1
    assert (a.num_draft_tokens, a.num_accepted_tokens, s.num_draft_tokens, s.num_accepted_tokens) == (4, 2, 4, 2)
    bm = s.block_manager
    cached = [bm.blocks[b].token_ids for b in a.block_ids if bm.blocks[b].block_hash is not None]
    assert cached == [(1, 2, 3, 4), (5, 6, 1, 2)]  # the block holding the rejected 6 is not cached
    out = s.schedule()  # next step: 9 and a draft after (5 9)? none: nothing followed it
    assert out.scheduled[0].token_ids == [9]


def test_a_stop_inside_the_accepted_tokens_drops_the_rest():
    s = make_spec_scheduler(block_size=4, budget=64, k=4)
    a = make_request("a", [1, 2, 3, 0, 5, 1, 2], max_tokens=20)  # eos is 0 (factories)
    s.add(a)
    finish_step(s, s.schedule(), {"a": [3]})
    out = s.schedule()
    assert out.scheduled[0].draft == [0, 5, 1, 2]
    emitted = finish_step(s, out, {"a": [0, 5, 1, 2, 7]})  # all accepted, but 0 ends the request
    assert emitted == [("a", 0)] and a.status == RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [3, 0] and a.num_accepted_tokens == 1
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


class FixedDrafter:
    """Proposes the same tokens every step (the Drafter interface is the seam a draft model would use too)."""

    def __init__(self, draft: list[int]):
        self.draft = draft
        self.forgotten: list[str] = []
        self.prepared: list[list[tuple[str, int]]] = []  # per step that drafts: (request id, at most) it was given

    def prepare(self, requests: list[Request], max_tokens: list[int]) -> None:
        self.prepared.append([(r.request_id, n) for r, n in zip(requests, max_tokens)])

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return self.draft[:max_tokens]

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def test_drafting_pauses_after_repeated_rejections_and_is_off_above_the_batch_size():
    drafter = FixedDrafter([42, 43])
    s = Scheduler(BlockManager(32, 4), 8, 64, drafter, SpecPolicy(2, 1, pause_after=2, pause_steps=3))
    s.add(make_request("a", [1, 2, 3], max_tokens=30))
    finish_step(s, s.schedule(), {"a": [5]})
    drafts = []
    for _ in range(9):
        out = s.schedule()
        drafts.append(out.scheduled[0].num_draft_tokens)
        finish_step(s, out, {"a": [1]})  # never 42: every draft wholly rejected
    assert drafts == [2, 2, 0, 0, 0, 2, 2, 0, 0]
    # prepare saw the request exactly in the steps it drafted (not while prefilling nor paused)
    assert drafter.prepared == [[]] + [[("a", n)] if n else [] for n in drafts]
    s.add(make_request("b", [7, 8], max_tokens=30))
    finish_step(s, s.schedule(), {"a": [1], "b": [9]})
    for _ in range(3):
        out = s.schedule()  # two running > max_batch 1: no draft for anyone, paused or not
        assert [x.num_draft_tokens for x in out.scheduled] == [0, 0]
        finish_step(s, out, {"a": [1], "b": [1]})
    s.abort("b")
    assert s.drafter.forgotten == ["b"]


def test_a_draft_never_takes_a_later_requests_place_in_the_budget_or_the_pool():
    s = Scheduler(BlockManager(32, 4), 8, 6, FixedDrafter([42] * 8), SpecPolicy(8, 8, 3, 3))
    for name in "abc":
        s.add(make_request(name, [1, 2], max_tokens=30))
    finish_step(s, s.schedule(), {"a": [5], "b": [5], "c": [5]})
    out = s.schedule()  # budget 6, three running: a may draft 6 - 3 = 3, b what is left, c its token
    assert [(x.request_id, x.num_draft_tokens) for x in out.scheduled] == [("a", 3), ("b", 0), ("c", 0)]
    # one free block left and three running requests: a draft may take it only when no request after it is left
    # (each of those might need a new block for its own token)
    s2 = Scheduler(BlockManager(4, 2), 8, 64, FixedDrafter([42, 42]), SpecPolicy(2, 8, 3, 3))
    for name in "abc":
        s2.add(make_request(name, [1], max_tokens=30))
    finish_step(s2, s2.schedule(), {"a": [5], "b": [5], "c": [5]})  # each: positions 0, 1 in one block
    out = s2.schedule()
    assert [x.num_draft_tokens for x in out.scheduled] == [0, 0, 2] and not out.preempted
    assert s2.block_manager.num_free_blocks == 0
    finish_step(s2, out, {"a": [6], "b": [6], "c": [7]})  # c's draft rejected; its next token (7) is at position 2
    assert [len(s2.requests[n].block_ids) for n in "abc"] == [1, 1, 2] and s2.block_manager.num_free_blocks == 0
