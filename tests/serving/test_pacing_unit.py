"""serving/pacing.py over a scripted stream, in milliseconds: merging, errors after the tokens, and leaving early
closes the engine's stream (which aborts the request). The real engine under it: test_stream_pacing.py."""

from __future__ import annotations

import asyncio

import pytest

from cpuserve.engine.errors import InvalidRequest
from cpuserve.engine.outputs import StepOutput
from cpuserve.serving.pacing import paced


def step(n: int, last: bool = False) -> StepOutput:
    return StepOutput("r", [n], str(n), None, last, "length" if last else None, 3, n)


async def script(items: list, closed: list[bool]):
    """Yields the StepOutputs of `items` 1 ms apart (raising an exception among them)."""
    try:
        for item in items:
            await asyncio.sleep(0.001)
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        closed.append(True)


def collect(items: list, min_interval: float = 0.0) -> tuple[list[StepOutput], BaseException | None, list[bool]]:
    closed: list[bool] = []

    async def run():
        got = []
        try:
            async for chunk in paced(script(items, closed), min_interval):
                got.append(chunk)
                await asyncio.sleep(0.02)  # a slow consumer: what arrives meanwhile is merged
        except Exception as e:  # noqa: BLE001
            return got, e
        return got, None

    got, error = asyncio.run(run())
    return got, error, closed


def test_chunks_waiting_for_a_slow_consumer_go_out_as_one():
    got, error, closed = collect([step(1), step(2), step(3), step(4, last=True)])
    assert error is None and closed == [True]
    assert [c.new_token_ids for c in got] == [[1], [2, 3, 4]]  # the first never waits
    assert got[-1].finished and got[-1].num_generated_tokens == 4


def test_an_error_is_raised_after_the_tokens_before_it():
    got, error, _ = collect([step(1), step(2), step(3), RuntimeError("engine stopped")])
    assert [t for c in got for t in c.new_token_ids] == [1, 2, 3]
    assert isinstance(error, RuntimeError) and str(error) == "engine stopped"


def test_bad_input_is_raised_at_the_first_chunk():
    got, error, _ = collect([InvalidRequest("prompt", "prompt is empty")])
    assert got == [] and isinstance(error, InvalidRequest) and error.param == "prompt"


def test_leaving_early_closes_the_engine_stream():
    closed: list[bool] = []

    async def endless():
        try:
            n = 0
            while True:
                n += 1
                await asyncio.sleep(0.001)
                yield step(n)
        finally:
            closed.append(True)

    async def run():
        stream = paced(endless())
        first = await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0.01)  # the pump's cancellation lands
        return first

    assert asyncio.run(run()).new_token_ids == [1]
    assert closed == [True]


@pytest.mark.parametrize("interval", [0.05, lambda: 0.05])
def test_min_interval_spaces_chunks_but_not_the_first_or_last(interval):
    async def timed():
        for n in range(1, 6):
            await asyncio.sleep(0.01)
            yield step(n, last=n == 5)

    async def run():
        loop = asyncio.get_running_loop()
        return [(loop.time(), c) async for c in paced(timed(), interval)]

    got = asyncio.run(run())
    times = [t for t, _ in got]
    assert [t for _, c in got for t in c.new_token_ids] == [1, 2, 3, 4, 5]
    assert all(b - a >= 0.045 for a, b in zip(times, times[1:-1]))  # the last chunk goes out at once
    assert len(got) < 5


def test_chunks_before_the_first_text_are_not_held_back():
    """A token whose text is not yet whole (a character spanning tokens) has none: the client has seen no first
    token yet, so pacing waits for nothing until a chunk with text went out; then it spaces chunks as before."""
    texts = ["", "", "é", "a", "b", "c"]

    async def timed():
        for n, text in enumerate(texts, 1):
            await asyncio.sleep(0.01)
            yield StepOutput("r", [n], text, None, n == len(texts), "length" if n == len(texts) else None, 3, n)

    async def run():
        loop = asyncio.get_running_loop()
        start = loop.time()
        return [(loop.time() - start, c) async for c in paced(timed(), 0.2)]

    got = asyncio.run(run())
    first_text = next(t for t, c in got if c.new_text)
    assert "".join(c.new_text for _, c in got) == "éabc"
    assert first_text < 0.15  # paced from the first chunk on, "é" waited 0.2 s behind the empty one
    after = [t for t, c in got if t > first_text and not c.finished]
    assert all(t - first_text >= 0.19 for t in after)  # then spaced: "a" waits its interval
