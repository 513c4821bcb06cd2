from cpuserve.engine.request import RequestStatus

from factories import make_request, make_scheduler, run_step


def test_prefill_then_decode_one_token_per_step():
    s = make_scheduler(num_blocks=16)
    r = make_request("a", [1, 2, 3, 4, 5], max_tokens=3)
    s.add(r)
    out = run_step(s)
    assert [len(x.token_ids) for x in out.scheduled] == [5] and out.scheduled[0].needs_sample
    out = run_step(s)
    assert out.scheduled[0].token_ids == [7] and out.scheduled[0].start_pos == 5
    run_step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7, 7, 7]
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 16


def test_token_budget_chunks_a_long_prompt():
    s = make_scheduler(num_blocks=32, budget=8)
    r = make_request("a", list(range(1, 21)), max_tokens=1)
    s.add(r)
    chunks = [run_step(s).scheduled[0] for _ in range(3)]
    assert [(c.start_pos, len(c.token_ids), c.needs_sample) for c in chunks] == [(0, 8, False), (8, 8, False),
                                                                                (16, 4, True)]
    assert r.is_finished


def test_decodes_come_first_and_share_the_budget_with_a_new_prefill():
    s = make_scheduler(num_blocks=32, budget=10)
    a = make_request("a", [1, 2, 3], max_tokens=5)
    s.add(a)
    run_step(s)
    s.add(make_request("b", list(range(1, 30)), max_tokens=1))
    out = run_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("a", 1), ("b", 9)]


def test_a_prompt_is_not_cut_to_leave_a_sliver_for_the_next_step():
    s = make_scheduler(num_blocks=64, budget=32)  # max_overrun 2
    for rid in ("a", "b"):
        s.add(make_request(rid, [1, 2, 3], max_tokens=5))
    run_step(s)  # both prefilled: from now on each takes one token of the budget
    s.add(make_request("c", list(range(1, 33)), max_tokens=1))  # 32 tokens, 30 left in the budget: 2 over
    s.add(make_request("d", list(range(101, 134)), max_tokens=1))  # no prefix shared with c
    out = run_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("a", 1), ("b", 1), ("c", 32)]
    assert out.scheduled[-1].needs_sample  # c's first token comes from this step
    out = run_step(s)  # d's 33 tokens: 3 over the 30 left, more than max_overrun, so it is cut at the budget
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("a", 1), ("b", 1), ("d", 30)]
    assert not out.scheduled[-1].needs_sample


def test_pool_exhaustion_preempts_the_latest_and_everything_completes():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=6, arrival=0.0)
    b = make_request("b", [8, 9, 10, 11, 12, 13], max_tokens=6, arrival=1.0)
    s.add(a)
    s.add(b)
    preempted = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        preempted += [r.request_id for r in run_step(s).preempted]
    assert "b" in preempted and "a" not in preempted
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == b.output_token_ids == [7] * 6
    assert s.block_manager.num_free_blocks == 4


def test_request_that_can_never_fit_finishes_with_length_instead_of_spinning():
    s = make_scheduler(num_blocks=2, block_size=4)
    r = make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=10)
    s.add(r)
    for _ in range(10):
        if not s.has_unfinished():
            break
        run_step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens >= 1
    assert s.block_manager.num_free_blocks == 2


def test_abort_returns_blocks_at_any_time():
    s = make_scheduler(num_blocks=8, budget=4)
    a = make_request("a", list(range(1, 11)), max_tokens=5)
    b = make_request("b", [1, 2], max_tokens=5)
    s.add(a)
    s.add(b)
    run_step(s)  # a is mid-prefill, b waits
    s.abort("a")
    s.abort("b")
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert s.block_manager.num_free_blocks == 8 and not s.has_unfinished()
    assert s.abort("missing") is None


def test_eos_stops_and_priority_orders_admission():
    s = make_scheduler(num_blocks=16, max_num_seqs=1)
    low = make_request("low", [1, 2], max_tokens=3, priority=5, arrival=0.0)
    high = make_request("high", [3, 4], max_tokens=3, priority=0, arrival=1.0)
    s.add(low)
    s.add(high)
    out = run_step(s, next_token=0)  # token 0 is eos in the factory
    assert [x.request_id for x in out.scheduled] == ["high"]
    assert high.status == RequestStatus.FINISHED_STOPPED


def test_duplicate_request_id_is_rejected():
    s = make_scheduler(num_blocks=4)
    s.add(make_request("a", [1]))
    try:
        s.add(make_request("a", [2]))
    except ValueError as e:
        assert "request_id='a'" in str(e)
    else:
        raise AssertionError("duplicate id accepted")
