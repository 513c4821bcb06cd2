"""cpuserve against llama.cpp, Hugging Face transformers and torch SDPA: one table of same-run ratios.

    python bench/engine.py [--quick] [--skip-1b] [--skip-hf] [--reps N] [--json FILE]
    python bench/engine.py --profile          # torch.profiler over cpuserve decode at batch 1 and 32

Every engine runs the same GGUF with the same threads, each in its own process (its peak RSS is its own);
cpuserve with its defaults (int4 weights, int8 KV cache). Numbers are medians of --reps repetitions after a
warm-up, repetitions interleaved across engines (same prompts for each). The machine is shared and noisy, so only ratios taken in one run mean much: ratio = cpuserve / peer,
higher is better for speed, lower for memory. A peer that fails shows why in its row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # engine_workers, peers, attention
from engine_workers import Worker, log, run_worker  # noqa: E402

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "cpuserve-bench")  # the 1B GGUF: ~0.6 GB, kept
# (measure, minimum or maximum ratio): the targets
TARGETS = {
    "decode b1 vs llama.cpp": (">=", 0.8),
    "decode b32 vs llama.cpp": (">=", 2.0),
    "prefill vs llama.cpp": (">=", 1.0),
    "kv bytes/token int8 vs bf16": ("<=", 0.55),
    "SlimAttention vs SDPA L=4096": (">=", 1.0),
}


def sizes(quick: bool, reps: int | None, threads: int) -> dict:
    """The workload: --quick is a smoke run (a few tokens), not a measurement."""
    if quick:
        s = dict(reps=2, prefill_len=128, prompt_len=16, gen_tokens=8, attn_lens=[256, 1024])
    else:
        s = dict(reps=3, prefill_len=512, prompt_len=32, gen_tokens=32, attn_lens=[1024, 4096])
    s.update(threads=threads, batches=[1, 8, 32])
    if reps:
        s["reps"] = reps
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
    workers = {}
    for name, (engine, cfg) in engines.items():
        log(f"loading {name}")
        workers[name] = Worker(engine, cfg)
    results = {name: {"decode": {}} for name in engines}
    for op, args, names in measures:
        live = [n for n in names if n in workers and not workers[n].error]
        log(f"{op} {' '.join(map(str, args))}: {', '.join(live)} interleaved, {reps} reps")
        seed = 1000 * (1 + (args[0] if args else 0))  # distinct prompts per measure
        for n in live:
            workers[n].call(op, *args, seed - 1)  # warm-up
        runs = {n: [] for n in live}
        for i in range(reps):
            for n in live:  # round-robin: a drift in machine load hits every engine alike
                runs[n].append(workers[n].call(op, *args, seed + i))
        for n in live:
            if None not in runs[n]:
                entry = {"median": statistics.median(runs[n]), "runs": runs[n]}
                if op == "prefill":
                    results[n]["prefill"] = entry
                else:
                    results[n]["decode"][str(args[0])] = entry
    for name, worker in workers.items():
        results[name]["peak_rss_mb"] = worker.close()
        if worker.error:
            results[name]["error"] = worker.error
    return results


def collect(cfg: dict, model: str, skip_hf: bool, skip_1b: bool, skip_llama_cpp: bool = False,
            save=lambda raw: None) -> dict:
    """Every measurement: {name: answer}; save(raw) after each group so a late failure keeps the rest."""
    base = dict(cfg, model=model)
    raw = {"sizes": base, "kv_bytes": run_worker("kv_bytes", base), "attention": run_worker("attention", base)}
    save(raw)
    peers = [n for n, skip in (("llama_cpp", skip_llama_cpp), ("hf", skip_hf)) if not skip]
    engines = {n: (n, base) for n in ["cpuserve", *peers]}
    measures = [("prefill", (), list(engines))]
    # padded batch generate in HF is slow: batch 1 and 8 only
    measures += [("decode", (b,), [n for n in engines if n != "hf" or b <= 8]) for b in cfg["batches"]]
    raw.update(compare(engines, measures, cfg["reps"]))
    save(raw)
    if not skip_1b:
        big = dict(cfg, model=synthetic_1b(), prefill_len=0)  # decode only; written (once) before measuring
        engines = {n + "_1b": (n, big) for n in ["cpuserve", *peers] if n != "hf"}
        raw.update(compare(engines, [("decode", (b,), list(engines)) for b in cfg["batches"]], cfg["reps"]))
        save(raw)
    for name in ("llama_cpp", "hf") + (() if skip_1b else ("llama_cpp_1b",)):
        raw.setdefault(name, {"error": "skipped"})
    return raw


def _median(answer: dict, *keys: str):
    for k in keys:
        if not isinstance(answer, dict) or k not in answer:
            return None
        answer = answer[k]
    return answer["median"]


def _row(measure: str, ours, peer, peer_answer: dict, unit: str, inverse: bool = False) -> dict:
    """inverse: the peer's number over ours (times in ms: a speed ratio > 1 means cpuserve is faster)."""
    why = peer_answer.get("error") if isinstance(peer_answer, dict) else "not run"
    ratio = None
    if ours and peer:
        ratio = peer / ours if inverse else ours / peer
    return {"measure": measure, "cpuserve": ours, "peer": peer if peer is not None else f"n/a ({why})",
            "unit": unit, "ratio": ratio}


def build_rows(raw: dict) -> list[dict]:
    cs, rows = raw["cpuserve"], []
    for peer_key, peer_name, batches in (("llama_cpp", "llama.cpp", (1, 8, 32)), ("hf", "HF fp32", (1, 8))):
        peer = raw[peer_key]
        rows.append(_row(f"prefill vs {peer_name}", _median(cs, "prefill"), _median(peer, "prefill"), peer,
                         f"tok/s, {raw['sizes']['prefill_len']}-token prompt"))
        rows += [_row(f"decode b{b} vs {peer_name}", _median(cs, "decode", str(b)), _median(peer, "decode", str(b)),
                      peer, "tok/s, aggregate") for b in batches]
        rows.append(_row(f"peak RSS vs {peer_name}", cs.get("peak_rss_mb"), peer.get("peak_rss_mb"), peer,
                         "MB, lower is better"))
    for row in raw["attention"].get("attention", []):
        seq_len = row["case"].split()[0].split("=")[1]
        rows.append(_row(f"SlimAttention vs SDPA L={seq_len}", row["ours_ms"], row["base_ms"], raw["attention"],
                         "ms bf16 prefill, ratio = speed-up", inverse=True))
    kv = raw["kv_bytes"].get("kv_bytes", {})
    rows.append(_row("kv bytes/token int8 vs bf16", kv.get("int8"), kv.get("bf16"), raw["kv_bytes"],
                     "bytes, lower is better"))
    if "cpuserve_1b" in raw:
        big, peer = raw["cpuserve_1b"], raw.get("llama_cpp_1b", {"error": "skipped"})
        rows += [_row(f"1B decode b{b} vs llama.cpp", _median(big, "decode", str(b)),
                      _median(peer, "decode", str(b)), peer, "tok/s, aggregate") for b in raw["sizes"]["batches"]]
        rows.append(_row("1B peak RSS vs llama.cpp", big.get("peak_rss_mb"), peer.get("peak_rss_mb"), peer,
                         "MB, lower is better"))
    for row in rows:
        row["target"], row["met"] = "", ""
        if row["measure"] in TARGETS:
            op, bound = TARGETS[row["measure"]]
            row["target"] = f"{op} {bound}x"
            if row["ratio"] is not None:
                row["met"] = "met" if (row["ratio"] >= bound if op == ">=" else row["ratio"] <= bound) else "NOT MET"
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


def tree_state() -> str:
    """Which engine code ran: the editable install runs the working tree, edits included."""
    import subprocess

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True)
        return r.stdout.strip()

    dirty = git("status", "--porcelain", "--", "../engine")
    return f"engine at {git('rev-parse', '--short', 'HEAD') or '?'}" + (" + uncommitted edits" if dirty else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer reps, a few tokens, small sizes")
    ap.add_argument("--skip-1b", action="store_true", help="skip the synthetic 1B Llama")
    ap.add_argument("--skip-hf", action="store_true", help="skip Hugging Face transformers")
    ap.add_argument("--reps", type=int, help="repetitions per measure (median quoted); default 3, --quick 2")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine")
    ap.add_argument("--model", help="GGUF to compare on (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--json", help="save every raw number (all repetitions) to this file")
    ap.add_argument("--profile", action="store_true", help="profile cpuserve decode at batch 1 and 32 instead")
    a = ap.parse_args(argv)
    from cpuserve.engine.loader import default_model_path

    model = a.model or default_model_path()
    cfg = sizes(a.quick, a.reps, a.threads)
    if a.profile:
        answer = run_worker("profile", dict(cfg, model=model, batches=[1, 32]))
        for batch, prof in answer.get("profile", {}).items():
            print(f"\n== cpuserve decode, batch {batch}: {prof['tok_s_under_profiler']:.1f} tok/s under the profiler")
            print(prof["table"])
        print(answer.get("error", ""))
        return
    def save(raw: dict) -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(raw, f, indent=1)

    raw = collect(cfg, model, a.skip_hf, a.skip_1b, save=save)
    errors = {k: v["error"] for k, v in raw.items() if isinstance(v, dict) and v.get("error", "skipped") != "skipped"}
    print(f"cpuserve / peer, {cfg['threads']} threads, medians of {cfg['reps']} runs after a warm-up; "
          f"model {os.path.basename(model)}; decode: {cfg['prompt_len']}-token prompts, {cfg['gen_tokens']} "
          f"new tokens each; {tree_state()}")
    print(format_table(build_rows(raw), errors))


if __name__ == "__main__":
    main()
