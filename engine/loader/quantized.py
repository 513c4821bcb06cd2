"""Quantized Hugging Face folders: config.json's quantization_config picks the format (gptq.py, awq.py,
compressed_tensors.py), and each quantized module's tensors become one CodedWeight named `<module>.weight`:

    model.layers.0.self_attn.q_proj.qweight  \\
    model.layers.0.self_attn.q_proj.qzeros    >  ("model.layers.0.self_attn.q_proj.weight", CodedWeight [N, K])
    model.layers.0.self_attn.q_proj.scales   /
    model.layers.0.self_attn.q_proj.g_idx   /
    model.layers.0.input_layernorm.weight    -> as a float checkpoint's (norms, embeddings, biases, ignored modules)

The engine then keeps the codes as it keeps a GGUF file's (engine/layers/linear/coded.py). Every other quant_method
(bitsandbytes, fp8, hqq, eetq, exl2, marlin, torchao, ...) is refused by name with the supported list.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from cpuserve.engine.layers.linear.coded import CodedWeight
from cpuserve.engine.loader import awq, compressed_tensors, gemma3, gptq
from cpuserve.engine.loader.fused import split_fused
from cpuserve.engine.loader.safetensors import (_IGNORED_RE, SafetensorsWeights, _read_json, build_hf_tokenizer,
                                                build_model_args, load_hf_folder)
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.tokenizer import Tokenizer

PARSERS = {"gptq": gptq.parse, "awq": awq.parse, "compressed-tensors": compressed_tensors.parse}
SUPPORTED_METHODS = tuple(PARSERS)


def open_hf_folder(folder: str) -> tuple[ModelArgs, Tokenizer, SafetensorsWeights]:
    """A Hugging Face folder, float (safetensors.load_hf_folder) or quantized (QuantizedWeights)."""
    config = _read_json(os.path.join(folder, "config.json"))
    fmt = parse_quantization(config, folder)
    if fmt is None:
        return load_hf_folder(folder)
    args = build_model_args(config, folder)
    return args, build_hf_tokenizer(folder, config), QuantizedWeights(folder, args, fmt)


def parse_quantization(config: dict[str, Any], folder: str):
    """The checked format of config.json's quantization_config, or None for a float checkpoint.

    Raises:
        ValueError: a quant_method or an option of it that the engine cannot keep exactly, named."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    where = f"{folder}/config.json: quantization_config"
    method = str(qc.get("quant_method", "")).lower()
    if method not in PARSERS:
        raise ValueError(f"{where}.quant_method={qc.get('quant_method')!r} is not supported; supported: "
                         f"{list(SUPPORTED_METHODS)} (or a float checkpoint, which the engine quantizes itself)")
    return PARSERS[method](qc, where)


class QuantizedWeights(SafetensorsWeights):
    """Streams a quantized folder: float tensors as fp32 (SafetensorsWeights'), each quantized module as one
    CodedWeight, in the order the files list them."""

    def __init__(self, folder: str, args: ModelArgs, fmt):
        self.args, self.fmt = args, fmt
        self.files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not self.files:
            raise ValueError(f"{folder}: no *.safetensors files (only safetensors weights are supported, not .bin)")
        where: dict[str, tuple[str, str]] = {}  # tensor name -> (its file, its dtype)
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                where.update((name, (file, f.get_slice(name).get_dtype())) for name in f.keys())
        modules: dict[str, dict[str, str]] = {}  # module -> {its quantized tensors' suffix: name}
        for name in where:
            module, _, suffix = name.rpartition(".")
            if suffix in fmt.tensors:
                modules.setdefault(module, {})[suffix] = name
        quantized = {m: parts for m, parts in modules.items() if fmt.is_quantized(set(parts))}
        self.entries: list[tuple[str, object]] = []  # (name yielded, file of a float tensor | {suffix: (file, name)})
        self.names = []  # (file, name) yielded: SafetensorsWeights' count
        for name, (file, dtype) in where.items():
            module, _, suffix = name.rpartition(".")
            if module not in quantized or suffix not in fmt.tensors:  # a quantized module's bias is float
                self._add_float(file, name, dtype)
            elif suffix == fmt.required[0]:  # one entry per module, where its first required tensor is listed
                self._add_module(module, {s: (where[n][0], n) for s, n in quantized[module].items()}, file)

    def select_experts(self, first: int, stop: int) -> None:
        super().select_experts(first, stop)
        kept = {name for _, name in self.names}
        self.entries = [(name, source) for name, source in self.entries if name in kept]

    def _add_module(self, module: str, parts: dict[str, tuple[str, str]], file: str) -> None:
        name = f"{module}.weight"
        self._check(file, name, "F32", self.args)  # a projection this loader knows
        missing = [s for s in self.fmt.required if s not in parts]
        if missing:
            raise ValueError(f"{file}: {module} has no {', '.join(missing)} ({self.fmt.method} stores "
                             f"{', '.join(self.fmt.required)} for every quantized module)")
        if not (self.args.tie_embeddings and name == "lm_head.weight"):
            self.entries.append((name, parts))
            self.names.append((file, name))

    def _add_float(self, file: str, name: str, dtype: str) -> None:
        self._check(file, name, dtype, self.args)
        if _IGNORED_RE.fullmatch(name) or (self.args.tie_embeddings and name == "lm_head.weight"):
            return
        self.entries.append((name, file))
        self.names.append((file, name))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | CodedWeight]]:
        handles: dict[str, Any] = {}

        def read(file: str, name: str) -> torch.Tensor:
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            return handles[file].get_tensor(name)

        for name, source in self.entries:
            if isinstance(source, dict):
                module = name.removesuffix(".weight")
                tensor = self.fmt.decode(module, {s: read(f, n) for s, (f, n) in source.items()})
            else:
                tensor = read(source, name).to(torch.float32)
                if self.args.arch == "gemma3":
                    tensor = gemma3.norm_multiplier(name, tensor)
            yield from split_fused(name, tensor, self.args)
