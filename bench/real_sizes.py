"""The models users bring, at their real sizes: random-weight Q4_K_M GGUFs of Llama 3.2 1B / 3B and Llama 3.1 8B
(the real shapes and vocabulary, llama.cpp's Q4_K_M type per tensor: kquant_recipe.py), Qwen3-30B-A3B's shapes with
MOE_LAYERS of its 48 layers (a mixture of experts: 128 experts, 8 used per token), and the machine's memory
bandwidth, so decode at batch 1 can be read as a share of what the memory can deliver.

bench/engine.py --real-sizes 1b,3b,8b,30b-a3b measures cpuserve and llama.cpp on the same file in the same run.
"""
from __future__ import annotations

import os
import statistics
import time

REAL = {"1b": "llama3.2-1b", "3b": "llama3.2-3b", "8b": "llama3.1-8b", "30b-a3b": "qwen3-30b-a3b"}
MOE_LAYERS = 12  # of Qwen3-30B-A3B's 48: ~4.5 GB, so cpuserve and llama.cpp fit in memory side by side
BANDWIDTH_BYTES = 1 << 30  # 1 GiB read per measurement: far beyond any cache


def synthetic_real(size: str, cache_dir: str, log=print, moe_layers: int = MOE_LAYERS) -> str:
    """The Q4_K_M GGUF of REAL[size], written once into cache_dir (1B ~1 GB, 3B ~2 GB, 8B ~5 GB, 30B-A3B ~4.5 GB at
    12 layers); a mixture of experts gets moe_layers of its layers."""
    from synthetic_gguf import (MOE_PRESETS, PRESETS, REAL_TIED, REAL_VOCAB, write_synthetic_llama,
                                write_synthetic_qwen3moe)

    preset = REAL[size]
    moe = preset in MOE_PRESETS
    path = os.path.join(cache_dir, f"{preset}-{moe_layers}l-q4_k_m.gguf" if moe else f"{preset}-q4_k_m.gguf")
    if not os.path.exists(path):
        log(f"writing the synthetic {preset} Q4_K_M to {path} (once)")
        os.makedirs(cache_dir, exist_ok=True)
        if moe:
            write_synthetic_qwen3moe(path + ".part", **dict(MOE_PRESETS[preset], n_layers=moe_layers),
                                     vocab_size=REAL_VOCAB[preset], ctx=8192, qtype="Q4_K_M")
        else:
            write_synthetic_llama(path + ".part", **PRESETS[preset], vocab_size=REAL_VOCAB[preset], ctx=8192,
                                  qtype="Q4_K_M", tie_embeddings=REAL_TIED[preset])
        os.replace(path + ".part", path)
    return path


def bytes_per_token(path: str) -> int:
    """The file's bytes one decode step must read: every weight matrix, the output projection included; of the
    embedding table only its rows (nothing) unless it is also the output projection (tied); of stacked experts
    (ffn_*_exps) the share one token routes to (expert_used_count / expert_count)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    count = reader.fields.get(f"{arch}.expert_count")
    active = reader.fields[f"{arch}.expert_used_count"].contents() / count.contents() if count is not None else 1.0
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return int(sum(int(t.n_bytes) * (active if "_exps." in t.name else 1.0) for t in reader.tensors
                   if t.name != "token_embd.weight" or tied))


def memory_bandwidth(threads: int, reps: int = 5) -> float:
    """Read bandwidth in GB/s: torch summing a 1 GiB fp32 tensor with `threads` threads, median of reps."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(BANDWIDTH_BYTES // 4)
    x.sum()  # pages touched, threads up
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        runs.append(BANDWIDTH_BYTES / (time.perf_counter() - start) / 1e9)
    return statistics.median(runs)


def bandwidth_share(tok_s: float | None, path: str, bandwidth_gb_s: float) -> float | None:
    """tokens/s x bytes read per token over the measured bandwidth (1.0: decode reads at the memory's speed)."""
    return None if not tok_s else tok_s * bytes_per_token(path) / 1e9 / bandwidth_gb_s


FILE_PEERS = ("llama.cpp", "vllm", "vllm-bf16")  # peers that read the file itself or a folder made from it
PEER_KEYS = {"llama.cpp": "llama_cpp", "vllm": "vllm", "vllm-bf16": "vllm_bf16"}


def measure(sizes: list[str], cfg: dict, cache_dir: str, compare, peer_engines, log=print,
            peers: tuple[str, ...] = ("llama.cpp",)) -> dict:
    """Decode at every batch of cfg, cpuserve and each of peers (of FILE_PEERS) on each size's file (compare /
    peer_engines are bench/engine.py's), and prefill of cfg's prompt for all but llama.cpp on the dense sizes
    (without its AMX repack, which dies on our Xeons, a 3B prefill takes it minutes; the mixture of experts reads
    3B parameters a token and its prefill target is against llama.cpp); plus each file's bytes per token and the memory
    bandwidth, sampled before and after each size's measures (a shared machine's bandwidth moves by 1.5x within
    minutes: the median of the samples is used). vLLM reads a Hugging Face folder made from the file (peer_vllm.py):
    the same shapes and values."""
    from synthetic_gguf import MOE_PRESETS

    raw = {"bandwidth_samples_gb_s": [], "real_files": {}}
    peers = [p for p in peers if p in FILE_PEERS]
    for size in sizes:
        path = synthetic_real(size, cache_dir, log, cfg.get("moe_layers", MOE_LAYERS))
        raw["real_files"][size] = {"path": path, "bytes_per_token": bytes_per_token(path)}
        raw["bandwidth_samples_gb_s"].append(memory_bandwidth(cfg["threads"]))
        suffix = f"_q4km_{size}"
        engines = peer_engines(peers, dict(cfg, model=path), suffix)
        moe = REAL[size] in MOE_PRESETS
        prefill = [n for n in engines if moe or n != "llama_cpp" + suffix]
        measures = [("prefill", (), prefill)] if cfg["prefill_len"] else []
        measures += [("decode", (b,), list(engines)) for b in cfg["batches"]]
        raw.update(compare(engines, measures, cfg["reps"]))
        raw["bandwidth_samples_gb_s"].append(memory_bandwidth(cfg["threads"]))
    raw["bandwidth_gb_s"] = statistics.median(raw["bandwidth_samples_gb_s"])
    return raw


def rows(raw: dict, peer_rows, row) -> list[dict]:
    """bench/engine.py's rows for each size (peer_rows / row are its helpers) and the bandwidth shares at batch 1."""
    out = []
    from synthetic_gguf import MOE_PRESETS

    bandwidth = raw.get("bandwidth_gb_s")
    for size, info in raw.get("real_files", {}).items():
        layers = raw["sizes"].get("moe_layers", MOE_LAYERS)
        name = f"{size.upper()} ({layers} of 48 layers)" if REAL[size] in MOE_PRESETS else size.upper()
        # keys apart from engine.py's own synthetic 1B ("cpuserve_1b"), whose rows would otherwise repeat these
        ours, theirs = raw.get(f"cpuserve_q4km_{size}", {}), raw.get(f"llama_cpp_q4km_{size}", {"error": "skipped"})
        for key in PEER_KEYS.values():
            answer = raw.get(f"{key}_q4km_{size}")
            if answer is not None or key == "llama_cpp":
                out += peer_rows(dict(raw, **{key: answer or theirs}), ours, key, raw["sizes"]["batches"],
                                 prefix=f"{name} Q4_K_M ")
        shares = [bandwidth_share(_b1(answer), info["path"], bandwidth) for answer in (ours, theirs)]
        samples = raw.get("bandwidth_samples_gb_s", [bandwidth])
        share = row(f"{name} Q4_K_M decode b1 share of bandwidth", shares[0], shares[1], theirs,
                    f"tok/s x {info['bytes_per_token'] / 1e9:.2f} GB per token / {bandwidth:.1f} GB/s (median of "
                    f"{len(samples)}: {min(samples):.1f}-{max(samples):.1f})")
        share["target_on"] = "cpuserve"  # the target is cpuserve's own share, not the ratio to llama.cpp's
        out.append(share)
    return out


def _b1(answer: dict) -> float | None:
    entry = answer.get("decode", {}).get("1") if isinstance(answer, dict) else None
    return entry["median"] if entry else None
