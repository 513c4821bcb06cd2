"""Makes tests/engine/data/autoawq-g64: a tiny random Llama quantized by AutoAWQ's own quantizer on the CPU, and the
SHA-256 of each weight as AutoAWQ's own dequantization (dequantize_gemm, fp16) gives it.

AutoAWQ does not install beside the project (it needs transformers 4.x), so this runs once, by hand, in a venv of its
own; the files it writes are committed and tests/engine/test_quantized_checkpoints.py reads them:

    python3 -m venv /tmp/awqenv
    /tmp/awqenv/bin/pip install torch==2.13.0 transformers==4.51.3 autoawq==0.2.9 accelerate
    cd tests/engine/data && /tmp/awqenv/bin/python make_autoawq_fixture.py   # tokenizer.json: arch_factory's tiny one
"""
import hashlib
import json
import os
import tempfile

import torch
from awq import AutoAWQForCausalLM
from awq.utils.packing_utils import dequantize_gemm
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

OUT, GROUP = "autoawq-g64", 64


def main() -> None:
    src = tempfile.mkdtemp()
    config = LlamaConfig(vocab_size=268, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256, rms_norm_eps=1e-5,
                         initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().eval().save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(OUT, name)) as f, open(os.path.join(src, name), "w") as g:
            g.write(f.read())
    model = AutoAWQForCausalLM.from_pretrained(src, device_map="cpu", torch_dtype=torch.float16)
    calib = [torch.randint(3, 260, (64,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(16)]
    model.quantize(AutoTokenizer.from_pretrained(src), calib_data=calib, max_calib_samples=16, max_calib_seq_len=64,
                   quant_config={"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"})
    model.save_quantized(OUT)
    state = load_file(os.path.join(OUT, "model.safetensors"))
    digests = {}
    for module in sorted(n.removesuffix(".qweight") for n in state if n.endswith(".qweight")):
        w = dequantize_gemm(state[f"{module}.qweight"], state[f"{module}.qzeros"], state[f"{module}.scales"], 4, GROUP)
        digests[f"{module}.weight"] = hashlib.sha256(w.t().contiguous().numpy().tobytes()).hexdigest()  # [N, K] fp16
    with open(os.path.join(OUT, "autoawq_dequantized_fp16.sha256.json"), "w") as f:
        json.dump(digests, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
