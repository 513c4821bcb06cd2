"""Mixture-of-experts models on replica groups (engine/distributed/experts.py): 2 real rank processes against 1 rank,
Qwen3-MoE and Mixtral, GGUF (experts in K-quant / Q4_0 codes) and safetensors (quantized at load)."""

from __future__ import annotations

import pytest
import torch
from arch_factory import build_hf_model, save_hf_folder, tiny_tokenizer, write_gguf
from expert_ranks import expert_bytes, shard_experts
from rank_procs import run_ranks
from torch import nn
from test_tensor_parallel import RoundedPartials

from cpuserve.engine.distributed.sharding import ShardPlan
from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.llm import LLM
from cpuserve.engine.loader import load_checkpoint
from cpuserve.engine.loader.moe import expert_index
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.models.builder import build_model
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.serving.config import ServeConfig

IDS = [5, 17, 99, 3, 250, 42, 42, 7, 130, 64, 8, 200, 11, 77, 150, 23, 5, 90, 31, 260]
PROMPTS = [IDS[:6], IDS[3:12], [250, 4, 9, 31, 77, 123, 8, 8, 15], IDS[10:]]
Q4_K_M_EXPERTS = {"ffn_gate_exps.weight": "Q4_K", "ffn_up_exps.weight": "Q4_K", "ffn_down_exps.weight": "Q6_K"}
MODELS = {  # name: (architecture, config overrides, GGUF expert types or None for a safetensors folder)
    "qwen3moe-gguf-q4_k_m": ("qwen3moe", dict(hidden_size=256, moe_intermediate_size=256, head_dim=64),
                             Q4_K_M_EXPERTS),
    "qwen3moe-safetensors": ("qwen3moe", {}, None),
    "mixtral-gguf-q4_0": ("mixtral", {}, "Q4_0"),
    "mixtral-safetensors": ("mixtral", {}, None),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    out = {}
    for name, (arch, overrides, experts) in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        model = build_hf_model(arch, **overrides)
        out[name] = (write_gguf(model, folder / f"{name}.gguf", arch, expert_qtype=experts, dense_qtype="Q8_0")
                     if experts else save_hf_folder(model, folder / "hf", tokenizer))
    return out


@pytest.fixture(scope="module")
def one_rank(files) -> dict[str, LLM]:
    return {name: LLM(model=path, kv_cache_gb=0.05, show_progress=False) for name, path in files.items()}


def _moe_args(n_experts: int, n_kv_heads: int = 16) -> ModelArgs:
    return ModelArgs("qwen3moe", dim=2048, n_layers=1, n_heads=32, n_kv_heads=n_kv_heads, head_dim=128, ffn_dim=768,
                     vocab_size=151936, max_seq_len=64, n_experts=n_experts, n_experts_used=min(8, n_experts))


def test_shard_plan_gives_each_rank_a_run_of_whole_experts():
    args = _moe_args(128)
    for world in (2, 3, 8):
        plans = [ShardPlan.make(args, r, world) for r in range(world)]
        runs = [p.experts for p in plans]
        assert runs[0][0] == 0 and runs[-1][1] == 128 and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        assert max(b - a for a, b in runs) - min(b - a for a, b in runs) <= 1
        local = [p.local_args(args) for p in plans]
        assert [a.experts_held for a in local] == [b - a for a, b in runs]
        assert all(a.n_experts == 128 and a.ffn_dim == 768 for a in local)  # whole experts: their width uncut
    down = torch.randn(2048, 768)
    assert ShardPlan.make(args, 1, 2).slice("model.layers.0.mlp.experts.70.down_proj.weight", down, args) is down
    with pytest.raises(ValueError, match=r"n_experts=4 cannot be split over ranks=8: every rank holds at least one "
                                         r"whole expert; use ranks <= 4"):
        ShardPlan.make(_moe_args(4), 0, 8)


def test_more_ranks_than_experts_is_refused_before_any_rank_starts(tmp_path):
    model = build_hf_model("qwen3moe", num_experts=2, num_experts_per_tok=1, num_key_value_heads=4)
    path = write_gguf(model, tmp_path / "two-experts.gguf", "qwen3moe")
    with pytest.raises(ValueError, match=r"n_experts=2 cannot be split over ranks=3"):
        LLM(model=path, ranks=3, kv_cache_gb=0.02, show_progress=False)
    with pytest.raises(ValueError, match=r"ranks_per_replica=3 exceeds the model's 2 experts: every rank holds at "
                                         r"least one whole expert; use ranks_per_replica <= 2"):
        ServeConfig(model=path, ranks_per_replica=3).check_model()  # serving: before Ray starts
    ServeConfig(model=path, ranks_per_replica=2).check_model()


@pytest.mark.parametrize("name", ["qwen3moe-gguf-q4_k_m", "mixtral-safetensors"])
def test_a_rank_streams_and_holds_only_its_experts(files, name):
    """select_experts: a GGUF's stacked tensors decode only the rank's rows (the codes' storage holds those alone),
    a folder's other expert tensors are never read; each rank's experts then hold 1/2 of one rank's bytes."""
    checkpoint = load_checkpoint(files[name], show_progress=False)
    total = checkpoint.num_tensors
    checkpoint.select_experts(2, 5)
    seen = set()
    for tensor_name, weight in checkpoint.iter_native_weights():
        e = expert_index(tensor_name)
        if e is None:
            continue
        seen.add(e)
        if isinstance(weight, CodedWeight):  # a view of the decoded stack: 3 experts' rows, not 8
            assert weight.codes.untyped_storage().nbytes() == 3 * weight.codes.numel()
    assert seen == {2, 3, 4}
    assert checkpoint.num_tensors == total - 5 * 3 * checkpoint.args.n_layers

    one = build_model(load_checkpoint(files[name], show_progress=False), "int4", 32, False, "int8")
    whole = sum(expert_bytes(layer.mlp) for layer in one.layers)
    ranks = run_ranks(shard_experts, files[name], "exact", timeout=120)
    assert [ranks[r]["experts"] for r in (0, 1)] == [(0, 4), (4, 8)]
    for r in (0, 1):
        assert ranks[r]["held"] == [4, 4] and ranks[r]["first"] == [4 * r] * 2 and ranks[r]["router_rows"] == [8] * 2
        assert ranks[r]["stacked"] and ranks[r]["bytes"] == whole // 2


@pytest.mark.parametrize("name", list(MODELS))
def test_exact_mode_is_one_rank_to_the_bit(files, one_rank, name):
    """tp_mode "exact": every rank routes alike, runs its experts, all-gathers the pairs' rows and adds them as one
    rank does: the logits of a prompt and 32 greedy tokens of each of 4 batched prompts are one rank's."""
    one = one_rank[name]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm = LLM(model=files[name], kv_cache_gb=0.05, show_progress=False, ranks=2)
    try:
        assert torch.equal(llm.engine.score(IDS), one.engine.score(IDS))
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.close()
    assert got == [o.token_ids for o in one.generate(PROMPTS, params)]
    assert all(len(ids) == 32 for ids in got)


def test_exact_mode_on_the_experts_own_modules(files):
    """fp32 weights (no int8 dot-product layout, so no ExpertStack): each rank runs its experts' modules from Python
    (MoE._rows_reference) and adds the gathered rows as combine_reference does: one rank's logits to the bit."""
    kwargs = dict(model=files["qwen3moe-safetensors"], weights="fp32", kv_cache="fp32", kv_cache_gb=0.02,
                  show_progress=False)
    one = LLM(**kwargs)
    assert all(layer.mlp.stack is None for layer in one.engine.runner.model.layers)
    llm = LLM(**kwargs, ranks=2)
    try:
        assert torch.equal(llm.engine.score(IDS), one.engine.score(IDS))
    finally:
        llm.engine.close()


class SplitCombine(nn.Module):
    """tp_mode "reduce"'s MoE arithmetic on one rank: each rank's experts' pairs added up in fp32, the partial sums
    added in rank order (the all-reduce), rounded once."""

    def __init__(self, moe, bounds: list[int]):
        super().__init__()
        self.moe, self.bounds = moe, bounds

    def forward(self, x, meta):
        ys, routing = self.moe.expert_rows(x, meta)  # every expert's pairs
        start = routing.start.tolist()
        total = None
        for a, b in zip(self.bounds, self.bounds[1:]):
            part = self.moe.combine(ys[start[a]:start[b]], routing, a, b)
            total = part if total is None else total + part
        return total.to(x.dtype)


def _score_as_reduce_mode(llm, ids: list[int]) -> torch.Tensor:
    args = llm.engine.args
    plans = [ShardPlan.make(args, r, 2, exact=False) for r in range(2)]
    heads = [(p.q_heads[1] - p.q_heads[0]) * args.head_dim for p in plans]
    bounds = [p.experts[0] for p in plans] + [args.n_experts]
    layers = llm.engine.runner.model.layers
    saved = [(layer.attention.o_proj, layer.mlp) for layer in layers]
    try:
        for layer, (o_proj, mlp) in zip(layers, saved):
            layer.attention.o_proj, layer.mlp = RoundedPartials(o_proj, heads), SplitCombine(mlp, bounds)
        return llm.engine.score(ids)
    finally:
        for layer, (o_proj, mlp) in zip(layers, saved):
            layer.attention.o_proj, layer.mlp = o_proj, mlp


@pytest.mark.parametrize("name", ["qwen3moe-gguf-q4_k_m", "mixtral-safetensors"])
def test_reduce_mode_is_one_rank_with_the_groups_sums(files, one_rank, name):
    """tp_mode "reduce": o_proj's partial products rounded to bf16 and all-reduced (test_tensor_parallel.py), each
    rank's experts summed in fp32 and all-reduced before one rounding. Its logits are one rank's arithmetic with
    exactly those sums (RoundedPartials, SplitCombine), bit for bit. No fixed bound against one rank's logits holds:
    a token whose top-k router scores nearly tie can take another expert under the changed rounding, and routing is
    a step function (test_moe.py saw 18% of the logits' range at one position from int8 activations)."""
    llm = LLM(model=files[name], kv_cache_gb=0.05, show_progress=False, ranks=2, tp_mode="reduce")
    try:
        two = llm.engine.score(IDS)
        comm = llm.engine.runner.comm
        comm.stats.reset()
        llm.generate([IDS[:5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        copied = comm.stats.copied_bytes
    finally:
        llm.engine.close()
    assert copied == 0  # o_proj's and the experts' partial sums built in their all-reduce's slot, at decode too
    assert torch.equal(two, _score_as_reduce_mode(one_rank[name], IDS))
