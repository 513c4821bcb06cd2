"""The scheduler -> runner hand-off: plain values that a replica group's wire carries whole."""
from cpuserve.engine.distributed import step
from cpuserve.engine.outputs import ModelRunnerOutput
from cpuserve.engine.scheduler_output import ScheduledRequest

from factories import make_request, make_scheduler, run_step


def test_scheduled_items_carry_tokens_positions_blocks_and_sampling_inputs():
    s = make_scheduler(num_blocks=32, block_size=4, budget=12)
    a = make_request("a", list(range(1, 6)), max_tokens=5)
    s.add(a)
    run_step(s)  # a: prefill of 5 and its first token
    s.add(make_request("b", list(range(100, 129)), max_tokens=2))  # shares no block with a
    out = s.schedule()
    decode, chunk = out.scheduled
    assert (decode.request_id, decode.token_ids, list(decode.positions)) == ("a", [7], [5])
    assert decode.block_ids == a.block_ids[:2] and decode.needs_sample
    assert decode.sampling.history == a.all_token_ids and decode.sampling.num_prompt_tokens == 5
    assert (chunk.request_id, len(chunk.token_ids), chunk.start_pos, chunk.needs_sample) == ("b", 11, 0, False)
    assert len(chunk.block_ids) == 3 and chunk.sampling is None  # blocks for positions 0..10 only
    assert (decode.num_scheduled_prompt_tokens, chunk.num_scheduled_prompt_tokens) == (0, 11)
    assert [item.request_id for item in out.samplers] == ["a"]


def test_wire_round_trip_gives_worker_ranks_the_same_items():
    s = make_scheduler(num_blocks=32, block_size=4, budget=40)
    for i, n in enumerate([5, 9, 3]):
        s.add(make_request(f"r{i}", list(range(1, n + 1)), max_tokens=3))
    run_step(s)
    s.add(make_request("late", list(range(1, 14)), max_tokens=3))
    out = s.schedule()
    kind, candidates, back = step.unpack(step.pack(out, step.KIND_SAMPLE, 40))
    assert (kind, candidates) == (step.KIND_SAMPLE, 40)
    fields = lambda x: (x.token_ids, x.start_pos, x.needs_sample, x.block_ids,  # noqa: E731
                        x.num_scheduled_prompt_tokens, x.num_draft_tokens)
    assert [fields(x) for x in back.scheduled] == [fields(x) for x in out.scheduled]
    assert all(isinstance(x, ScheduledRequest) and x.sampling is None for x in back.scheduled)


def test_runner_output_places_one_token_per_sampling_item():
    s = make_scheduler(num_blocks=32, block_size=4, budget=6)
    s.add(make_request("a", [1, 2], max_tokens=3))
    s.add(make_request("b", list(range(1, 10)), max_tokens=3))
    out = s.schedule()  # a samples, b's first chunk does not
    placed = ModelRunnerOutput.place(out.scheduled, [42], [None])
    assert placed.token_ids == [[42], []]
    assert [(r.request_id, t) for r, t, _ in s.postprocess(out, placed)] == [("a", 42)]
