"""Bytes of weights one decode step reads, the engine's against the file's (no timing: safe on a busy machine).

    python bench/weight_bytes.py 1b 3b 8b

For each synthetic Q4_K_M file of real_sizes.py (written once into ~/.cache/cpuserve-bench): the nbytes of every
buffer of the decoder layers as the default engine builds them (int4 weights, int8 activations), and of the output
projection, beside the file's bytes of the same tensors (blk.* and output / tied token_embd).
"""
from __future__ import annotations

import argparse
import os

import gguf
import torch
from engine_workers import CACHE_DIR
from real_sizes import REAL, synthetic_real

from cpuserve.engine.loader import load_checkpoint
from cpuserve.engine.models.builder import build_model


def module_bytes(module: torch.nn.Module) -> int:
    return sum(b.nbytes for b in module.buffers()) + sum(p.nbytes for p in module.parameters())


def file_bytes(path: str) -> tuple[int, int]:
    """(the layers' bytes, the output projection's bytes) as the file stores them."""
    reader = gguf.GGUFReader(path)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    head = "token_embd.weight" if tied else "output.weight"
    layers = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk."))
    return layers, sum(int(t.n_bytes) for t in reader.tensors if t.name == head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sizes", nargs="+", choices=sorted(REAL))
    sizes = parser.parse_args().sizes
    print("| file | layers: engine / file (GB) | ratio | lm_head: engine / file (GB) |")
    print("|---|---|---|---|")
    for size in sizes:
        path = synthetic_real(size, os.path.expanduser(CACHE_DIR))
        model = build_model(load_checkpoint(path, show_progress=False), "int4", 32, False, "int8")
        ours, head = sum(module_bytes(layer) for layer in model.layers), module_bytes(model.lm_head)
        theirs, their_head = file_bytes(path)
        print(f"| {REAL[size]} | {ours / 1e9:.3f} / {theirs / 1e9:.3f} | {ours / theirs:.3f} | "
              f"{head / 1e9:.3f} / {their_head / 1e9:.3f} |", flush=True)
        del model


if __name__ == "__main__":
    main()
