"""A stand-in for a larger model that shares SmolLM2's tokenizer, for timing a draft model (speculative="draft"):
SmolLM2-135M-Instruct with extra decoder layers whose outputs are zero (o_proj and down_proj all zeros), so its
logits are SmolLM2's while each token costs about (30 + extra) / 30 times as much. No such model can be downloaded
here; with it SmolLM2 drafts for a model several times its cost that agrees with it, the case a draft model is for.

    .venv/bin/python bench/deep_smollm2.py [--extra-layers 90] [--out ~/.cache/cpuserve-bench/smollm2-deep-120]

Writes a Hugging Face folder (config.json, bf16 safetensors, tokenizer.json) that the engine loads as it loads any:
its weights are the embedded GGUF's, dequantized by transformers' own GGUF reader; the added layers' other weights
are transformers' initialisation (they never reach the output). Prints the folder.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def build(extra_layers: int, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from cpuserve.engine.loader import default_model_path

    if (out / "config.json").is_file():
        return out
    gguf = Path(default_model_path())
    base = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = base.config
    num_base = config.num_hidden_layers
    config.num_hidden_layers = num_base + extra_layers
    config.layer_types = None  # recomputed for the new depth where the config has them
    if hasattr(config, "quantization_config"):  # the GGUF reader's note that it dequantized: these are plain floats
        del config.quantization_config
    torch.manual_seed(0)
    deep = LlamaForCausalLM(config)
    missing = deep.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert all(k.startswith("model.layers.") and int(k.split(".")[2]) >= num_base for k in missing), missing
    with torch.no_grad():
        for layer in deep.model.layers[num_base:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    out.mkdir(parents=True, exist_ok=True)
    deep.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extra-layers", type=int, default=90, help="layers added after SmolLM2's 30 (default: 90)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the folder (default: ~/.cache/cpuserve-bench/smollm2-deep-<layers>)")
    args = ap.parse_args()
    out = args.out or Path(os.path.expanduser(f"~/.cache/cpuserve-bench/smollm2-deep-{30 + args.extra_layers}"))
    print(build(args.extra_layers, out))


if __name__ == "__main__":
    main()
