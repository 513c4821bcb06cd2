"""Prompt rows: the scheduler counts each chunk's prompt tokens, the runner turns them into row ranges, and a linear
layer with a prompt kernel computes those rows by it and every other row by its usual path, into one output."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from cpuserve.engine.distributed import step
from cpuserve.engine.layers import native
from cpuserve.engine.layers.linear import build_linear
from cpuserve.engine.layers.linear.act_int8 import W4A8Linear, W8A8Linear
from cpuserve.engine.layers.linear.int4 import quantize_int4
from cpuserve.engine.layers.linear.stacked import StackedLinear
from cpuserve.engine.model_runner import prompt_row_ranges

from factories import make_request, make_scheduler, run_step

needs_vnni = pytest.mark.skipif(not native.vnni_gemm_enabled(), reason="needs the int8 dot-product kernels")


def _prompt_kernel_here() -> bool:
    """The prompt kernel runs here once chosen (CPUSERVE_PROMPT_GEMM=bf16, which these tests set)."""
    before = os.environ.get("CPUSERVE_PROMPT_GEMM")
    os.environ["CPUSERVE_PROMPT_GEMM"] = "bf16"
    try:
        return native.amx_bf16_gemm_enabled()
    finally:
        if before is None:
            del os.environ["CPUSERVE_PROMPT_GEMM"]
        else:
            os.environ["CPUSERVE_PROMPT_GEMM"] = before


needs_prompt_kernel = pytest.mark.skipif(
    not _prompt_kernel_here(),
    reason="no prompt kernel here: torch.ops.cpuserve.amx_bf16_gemm is not built, or the CPU has no AMX-BF16, or "
           "CPUSERVE_AMX=off")


@pytest.fixture(autouse=True)
def _choose_the_prompt_kernel(monkeypatch):
    """These tests choose the prompt scheme (CPUSERVE_PROMPT_GEMM=bf16, the default) whatever the environment says."""
    monkeypatch.setenv("CPUSERVE_PROMPT_GEMM", "bf16")
K = 576
RANGES = [((0, 40),), ((1, 4), (15, 26)), ((3, 40),), ((0, 1), (39, 40))]


def make_x(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 20  # an outlier channel, as real hidden states have
    return x.to(torch.bfloat16)


def make_weight(n: int, k: int = K, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.05 + torch.randn(n, 1, generator=gen) * 0.02


def layers() -> list:
    """A W4A8 layer with a bias, a W8A8 one, and a StackedLinear of both (each part writes its columns)."""
    stacked = StackedLinear([W4A8Linear.from_float(make_weight(64, seed=3), "int4", 32),
                             W8A8Linear.from_float(make_weight(32, seed=4), "int8", 32)])
    stacked.bias = torch.randn(96).bfloat16()
    return [build_linear(make_weight(192), torch.randn(192), "int4", 32, activations="int8"),
            build_linear(make_weight(160), None, "int8", activations="int8"), stacked]


def gaps(ranges, m: int) -> list[tuple[int, int]]:
    """The row ranges between the prompt ranges: the usual path's."""
    edges = [0, *(e for r in ranges for e in r), m]
    return [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]


def with_bias(layer, y: torch.Tensor) -> torch.Tensor:
    return y + layer.bias if layer.bias is not None else y


def _reference_kernel(part, calls: list, x2: torch.Tensor, y: torch.Tensor) -> None:
    calls.append((x2.data_ptr(), y.data_ptr(), x2.shape[0]))
    y.copy_(part.prompt_reference(x2))


def stand_in_prompt_kernel(layer, calls: list) -> None:
    """The prompt scheme's plain-torch reference where its kernel would run (amx_bf16_gemm is not built here): the
    routing under test is QuantLinear's, whichever kernel computes the rows."""
    for part in getattr(layer, "parts", [layer]):
        part.has_prompt_kernel = lambda: True
        part._prompt_gemm_into = functools.partial(_reference_kernel, part, calls)


# -- the scheduler's counts and the runner's ranges -------------------------------------------------------------------

def mixed_step():
    """A decode, a preempted request's recompute (3 prompt tokens then 11 generated ones), a new prompt's chunk of 10
    and a one-token prompt (a prefill chunk: prompt tokens always run prefill attention), in one step."""
    s = make_scheduler(num_blocks=13, block_size=4, budget=32, prefix_caching=False)
    s.add(make_request("a", list(range(1, 7)), max_tokens=12, arrival=0))
    s.add(make_request("b", list(range(11, 18)), max_tokens=30, arrival=1))
    s.add(make_request("f", list(range(50, 53)), max_tokens=12, arrival=2))
    while not (out := run_step(s)).preempted:
        pass
    assert [r.request_id for r in out.preempted] == ["f"]
    s.add(make_request("c", list(range(21, 31)), max_tokens=2, arrival=3))
    s.add(make_request("one", [40], max_tokens=2, arrival=4))
    for _ in range(8):  # a finishes and frees the blocks f and c need
        out = s.schedule()
        if len(out.scheduled) == 4:
            return out
        run_step_after(s, out)
    raise AssertionError("the mixed step never came")


def run_step_after(s, out) -> None:
    from cpuserve.engine.output_processor import token_stop
    from cpuserve.engine.outputs import ModelRunnerOutput

    samplers = out.samplers
    for request, _, _ in s.postprocess(out, ModelRunnerOutput.place(out.scheduled, [7] * len(samplers),
                                                                    [None] * len(samplers))):
        if (status := token_stop(request)) is not None:
            s.finish(request, status)


def test_chunks_count_their_prompt_tokens_from_the_prompt_length():
    out = mixed_step()
    items = [(x.request_id, len(x.token_ids), x.start_pos, x.num_scheduled_prompt_tokens) for x in out.scheduled]
    assert items == [("b", 1, 18, 0), ("f", 14, 0, 3), ("c", 10, 0, 10), ("one", 1, 0, 1)]
    assert out.scheduled[0].is_decode and not out.scheduled[3].is_decode  # a prompt token: prefill attention, even alone
    s = make_scheduler(num_blocks=32, block_size=4, budget=8)
    s.add(make_request("long", list(range(1, 21)), max_tokens=2))
    assert [run_step(s).scheduled[0].num_scheduled_prompt_tokens for _ in range(4)] == [8, 8, 4, 0]


def test_the_runner_marks_the_prompt_rows_of_a_mixed_step(llm_int4):
    out = mixed_step()
    # rows: b's decode 0 | f's prompt 1..3, its generated tokens 4..14 | c 15..24 | one 25
    assert prompt_row_ranges(out.scheduled) == ((1, 4), (15, 26))
    _, meta, _ = llm_int4.engine.runner.prepare_inputs(out)
    assert meta.prompt_rows == ((1, 4), (15, 26))
    _, _, back = step.unpack(step.pack(out, step.KIND_SAMPLE, 1))  # what a replica group's worker ranks rebuild
    assert prompt_row_ranges(back.scheduled) == ((1, 4), (15, 26))


def test_decode_only_steps_have_no_prompt_rows():
    s = make_scheduler(num_blocks=32, block_size=4, budget=64)
    for i in range(3):
        s.add(make_request(f"r{i}", list(range(1, 6 + i)), max_tokens=5))
    assert prompt_row_ranges(run_step(s).scheduled) == ((0, 18),)  # three whole prompts, adjacent: one range
    assert prompt_row_ranges(run_step(s).scheduled) == ()


# -- QuantLinear's routing --------------------------------------------------------------------------------------------

@needs_vnni
@pytest.mark.parametrize("ranges", RANGES)
def test_each_range_is_written_by_its_path_into_one_output(ranges):
    for layer in layers():
        calls: list = []
        stand_in_prompt_kernel(layer, calls)
        x = make_x(40)
        got = layer(x, prompt_rows=ranges)
        out = torch.full_like(got, float("nan"))
        assert layer(x, out=out, prompt_rows=ranges) is out and torch.equal(out, got)
        for a, b in ranges:
            prompt = with_bias(layer, layer.prompt_reference(x[a:b]))
            assert torch.equal(got[a:b], prompt)
            assert not torch.equal(prompt, layer(x[a:b]))  # the schemes differ: a wrong route would show
        for a, b in gaps(ranges, 40):
            assert torch.equal(got[a:b], layer(x[a:b]))  # the int8 path's rows alone
        # contiguous row slices of x and out, no copies (a StackedLinear's parts write their columns of those rows)
        num_parts = len(getattr(layer, "parts", [layer]))
        row_x, row_y = K * 2, layer.out_features * 2
        want = [(x.data_ptr() + a * row_x, out.data_ptr() + a * row_y, b - a) for a, b in ranges]
        got_calls = [(xp, yp - (yp - out.data_ptr()) % row_y, m) for xp, yp, m in calls[-len(ranges) * num_parts:]]
        assert got_calls == [c for c in want for _ in range(num_parts)]


@needs_vnni
def test_where_the_prompt_kernel_is_absent_prompt_rows_change_no_bit(monkeypatch):
    if native.amx_bf16_gemm_enabled():  # as CPUSERVE_AMX=off or a CPU without AMX-BF16 leaves it
        monkeypatch.setattr(native, "amx_bf16_gemm_enabled", lambda: False)
    x = make_x(40)
    for layer in layers():
        assert not layer.has_prompt_kernel()
        usual = layer(x)
        for ranges in RANGES:
            assert torch.equal(layer(x, prompt_rows=ranges), usual)
            out = torch.empty_like(usual)
            assert torch.equal(layer(x, out=out, prompt_rows=ranges), usual)


@needs_vnni
def test_prompt_reference_is_bf16_weights_times_bf16_activations_summed_in_fp32():
    weight = make_weight(96, 256)
    layer = build_linear(weight, None, "int4", 32, activations="int8")
    codes, scale, zero = quantize_int4(weight, 32)
    # W4A8Linear.from_float's weights: code * scale + zoff, zoff = zero - 8 * scale rounded to fp16, each weight then
    # rounded to bf16 as the prompt kernel does
    zoff = (zero.float() - 8 * scale.float()).half().float()
    w = (codes.float() * scale.float().repeat_interleave(32, 1) + zoff.repeat_interleave(32, 1)).bfloat16()
    assert torch.equal(layer.dequantize().bfloat16(), w)
    x = make_x(17, 256)
    exact = x.double() @ w.double().t()  # bf16 products are exact; sums in double
    got = layer.prompt_reference(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-6)  # fp32 sums, then bf16 rounding
    # better than the int8 path: bf16 activations lose 2^-9 of each value, int8 groups up to 1/254 of their absmax
    full = x.double() @ layer.dequantize().double().t()
    assert (got.double() - full).norm() < (layer(x).double() - full).norm() / 2


@needs_prompt_kernel
@pytest.mark.parametrize("ranges", RANGES)
def test_the_prompt_kernel_computes_the_prompt_rows_and_the_int8_path_the_rest(ranges):
    x = make_x(40)
    for layer in layers():
        assert layer.has_prompt_kernel()
        got = layer(x, prompt_rows=ranges)
        for a, b in ranges:
            alone = torch.empty(b - a, layer.out_features, dtype=torch.bfloat16)
            layer._prompt_gemm_into(x[a:b].contiguous(), alone)
            assert torch.equal(got[a:b], with_bias(layer, alone))
            ref = with_bias(layer, layer.prompt_reference(x[a:b])).float()
            torch.testing.assert_close(got[a:b].float(), ref, rtol=0, atol=2 ** -7 * ref.abs().max().item())
        for a, b in gaps(ranges, 40):
            assert torch.equal(got[a:b], layer(x[a:b]))


@needs_prompt_kernel
def test_cpuserve_amx_off_disables_the_prompt_kernel():
    code = "from cpuserve.engine.layers import native; print(native.amx_bf16_gemm_enabled())"
    env = {**os.environ, "CPUSERVE_AMX": "off", "CPUSERVE_OPENMP": "gnu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "False"


def test_the_prompt_kernel_is_the_default_and_int8_opts_out(monkeypatch):
    """Unset, the prompt kernel runs where it can; CPUSERVE_PROMPT_GEMM=int8 puts every row on the int8 path; a wrong
    value is refused by name."""
    monkeypatch.delenv("CPUSERVE_PROMPT_GEMM")
    assert native.amx_bf16_gemm_enabled() == _prompt_kernel_here()
    monkeypatch.setenv("CPUSERVE_PROMPT_GEMM", "int8")
    assert not native.amx_bf16_gemm_enabled()
    assert not any(layer.has_prompt_kernel() for layer in layers())
    monkeypatch.setenv("CPUSERVE_PROMPT_GEMM", "fp8")
    with pytest.raises(ValueError, match="CPUSERVE_PROMPT_GEMM='fp8': allowed values are int8, bf16"):
        native.amx_bf16_gemm_enabled()
