"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE): their hyper-parameters, the expert tensors in one naming, and
every other expert layout refused by name.

Both loaders hand the builder an MoE layer's MLP in these names (model.layers.N. omitted), whatever the file says:

    mlp.gate.weight                  [E, dim]  the router         HF Qwen3-MoE: the same; Mixtral: block_sparse_moe.gate
    mlp.experts.{e}.gate_proj.weight [F, dim]  expert e's SwiGLU  Mixtral: block_sparse_moe.experts.{e}.w1 (up: w3,
    mlp.experts.{e}.up_proj.weight   [F, dim]                     down: w2); GGUF: blk.N.ffn_{gate,up,down}_exps
    mlp.experts.{e}.down_proj.weight [dim, F]                     stacked [E, F, dim] / [E, dim, F], cut by expert

A GGUF's stacked expert tensor is decoded once as [E * rows, K] (its own codes, any type the dense layers take, the
K-quants included) and cut into E row blocks, so each expert keeps the file's codes.

A replica group's rank streams only its experts [first, stop) (select_experts on either loader): a GGUF's stacked
tensors have only those experts' rows decoded (the others' bytes of the file are never read), a folder's other
expert tensors are never opened.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from cpuserve.engine.layers.linear.coded import CodedWeight

SUPPORTED = ("Mixtral (GGUF 'llama' with expert_count; MixtralForCausalLM) and Qwen3-MoE (GGUF 'qwen3moe'; "
             "Qwen3MoeForCausalLM): routed SwiGLU experts with softmax gating, no shared experts")
GGUF_ARCHS = ("llama", "qwen3moe")  # the GGUF architectures whose files may carry experts
HF_ARCHITECTURES = {"MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe"}

GGUF_NAMES = {  # llama.cpp's per-layer names -> ours (the stacked ones before the cut by expert)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.((gate|up|down)_proj\.weight)")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_RE = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.(gate|experts\.(\d+)\.(w[123]))\.weight")
HF_TENSOR_RE = re.compile(r"model\.layers\.\d+\.mlp\.(gate|experts\.\d+\.(gate|up|down)_proj)\.weight")
_OLD_GGUF_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")  # before llama.cpp stacked experts
# llama.cpp tensors of expert layouts we do not run, and what they are
_GGUF_REFUSED_TENSORS = {
    "_shexp.weight": "shared experts", "ffn_gate_inp_shexp.weight": "a shared expert's gate",
    "exp_probs_b.bias": "a routing bias (DeepSeek-V3)", "ffn_gate_up_exps.weight": "fused gate/up experts",
    "_exps.bias": "expert biases (gpt-oss)", "ffn_gate_inp.bias": "a router bias (gpt-oss)",
}
# GGUF MoE metadata (after the "<arch>." prefix): the keys we read, and the values we run of the others we know;
# any other value, or any other key about experts, is another model's routing
_GGUF_READ = ("expert_count", "expert_used_count", "expert_feed_forward_length", "expert_weights_norm")
_GGUF_DEFAULTS = {
    "expert_shared_count": (0,), "expert_shared_feed_forward_length": (0,), "expert_gating_func": (1,),  # 1: softmax
    "expert_weights_scale": (0.0, 1.0), "leading_dense_block_count": (0,), "expert_group_count": (0, 1),
    "expert_group_used_count": (0, 1), "interleave_moe_layer_step": (0, 1), "moe_every_n_layers": (0, 1),
}


def refused(what: str, where: str) -> ValueError:
    return ValueError(f"{where}: {what} is not supported; supported mixture-of-experts models: {SUPPORTED}")


def gguf_fields(meta: dict[str, Any], key: Callable[[str], str], names: set[str], arch: str,
                path: str) -> dict[str, Any]:
    """ModelArgs' expert fields of a GGUF (empty for a dense file), after refusing every expert layout but ours."""
    for name in sorted(names):
        if _OLD_GGUF_EXPERTS.fullmatch(name):
            raise refused(f"tensor {name!r} (one tensor per expert, the layout before llama.cpp stacked them as "
                          "ffn_*_exps; re-convert the model with a current convert_hf_to_gguf.py)", path)
        what = next((w for suffix, w in _GGUF_REFUSED_TENSORS.items() if name.endswith(suffix)), None)
        if what is not None:
            raise refused(f"tensor {name!r} ({what})", path)
    prefix = key("")
    for full in sorted(k for k in meta if k.startswith(prefix)):
        short, value = full[len(prefix):], meta[full]
        is_moe = "expert" in short or short in _GGUF_DEFAULTS
        if is_moe and short not in _GGUF_READ and value not in _GGUF_DEFAULTS.get(short, ()):
            raise refused(f"{full}={value}", path)
    if arch != "qwen3moe" and meta.get(key("expert_weights_norm"), True) is not True:  # Mixtral always renormalises
        raise refused(f"{key('expert_weights_norm')}={meta[key('expert_weights_norm')]} in a {arch!r} file", path)
    count = meta.get(key("expert_count"))
    if not count:
        if arch == "qwen3moe":
            raise ValueError(f"{path}: required GGUF metadata key {key('expert_count')!r} is missing")
        if any(n.split(".", 2)[-1] in GGUF_NAMES for n in names):
            raise ValueError(f"{path}: expert tensors (ffn_*_exps) without {key('expert_count')}")
        return {}
    if arch not in GGUF_ARCHS:
        raise refused(f"{key('expert_count')}={count} in a {arch!r} file", path)
    used = meta.get(key("expert_used_count"))
    if not used:
        raise ValueError(f"{path}: required GGUF metadata key {key('expert_used_count')!r} is missing")
    fields = dict(n_experts=int(count), n_experts_used=int(used))
    if arch == "qwen3moe":  # llama.cpp's qwen3moe always renormalises the top-k weights; the key says otherwise
        fields["norm_topk_prob"] = bool(meta.get(key("expert_weights_norm"), True))
        width = meta.get(key("expert_feed_forward_length"))
        if width is None:
            raise ValueError(f"{path}: required GGUF metadata key {key('expert_feed_forward_length')!r} is missing")
        fields["ffn_dim"] = int(width)
    return fields


def hf_fields(config: dict[str, Any], arch_name: str, path: str) -> dict[str, Any]:
    """ModelArgs' expert fields of a MixtralForCausalLM / Qwen3MoeForCausalLM config.json."""
    where = f"{path}/config.json"
    if config.get("hidden_act", "silu") != "silu":
        raise refused(f"hidden_act={config['hidden_act']!r} in {arch_name}", where)
    if arch_name == "MixtralForCausalLM":
        return dict(n_experts=int(config["num_local_experts"]), n_experts_used=int(config["num_experts_per_tok"]),
                    norm_topk_prob=True)
    for name, default in (("mlp_only_layers", []), ("decoder_sparse_step", 1), ("shared_expert_intermediate_size", 0)):
        value = config.get(name)
        if value not in (None, default):
            raise refused(f"{name}={value} (supported: {default}: every layer's MLP is routed experts only)", where)
    count = config.get("num_experts") or config.get("num_local_experts")
    if not count:
        raise refused(f"num_experts={count} in {arch_name}", where)
    return dict(n_experts=int(count), n_experts_used=int(config["num_experts_per_tok"]),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)), ffn_dim=int(config["moe_intermediate_size"]))


def hf_name(name: str) -> str:
    """A Hugging Face tensor name in our naming (Mixtral's block_sparse_moe.* renamed; anything else unchanged)."""
    match = _MIXTRAL_RE.fullmatch(name)
    if match is None:
        return name
    layer, part, expert, w = match.groups()
    if part == "gate":
        return f"{layer}.mlp.gate.weight"
    return f"{layer}.mlp.experts.{expert}.{_MIXTRAL[w]}.weight"


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..+)")


def num_parts(name: str, n_experts: int) -> int:
    """How many tensors split_experts makes of the tensor named `name` (ours)."""
    return n_experts if _STACKED.fullmatch(name) else 1


def is_stacked(name: str) -> bool:
    """A GGUF's stacked expert tensor (ours, before split_experts)."""
    return _STACKED.fullmatch(name) is not None


def expert_index(name: str) -> int | None:
    """The expert a tensor (ours, after split_experts) belongs to, or None for any other tensor."""
    match = _EXPERT.fullmatch(name)
    return None if match is None else int(match.group(2))


def renumber_expert(name: str, offset: int) -> str:
    """An expert tensor's name with its expert id lowered by offset (a rank's experts counted from 0)."""
    match = _EXPERT.fullmatch(name)
    return f"{match.group(1)}{int(match.group(2)) - offset}{match.group(3)}"


def split_experts(name: str, weight, n_experts: int, first: int = 0) -> list[tuple[str, object]]:
    """[(name, weight)]: a stacked expert tensor [E * rows, K] (a CodedWeight or fp32) cut into its E experts' row
    blocks, named first, first + 1, ... (a rank's run of the experts); any other tensor as it is."""
    match = _STACKED.fullmatch(name)
    if match is None:
        return [(name, weight)]
    prefix, part = match.group(1), match.group(2)
    rows = weight.shape[0] // n_experts
    assert rows * n_experts == weight.shape[0], (name, tuple(weight.shape), n_experts)

    def cut(e: int):
        block = lambda t: t[e * rows:(e + 1) * rows]  # noqa: E731
        return weight.map_rows(block) if isinstance(weight, CodedWeight) else block(weight)

    return [(f"{prefix}.{first + e}.{part}", cut(e)) for e in range(n_experts)]
