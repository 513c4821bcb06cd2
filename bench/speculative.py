"""What speculative decoding buys: decode speed with and without it, same run, same prompts (the engine alone).

    flock /tmp/cpuserve-bench.lock .venv/bin/python bench/speculative.py [--streams 1 8 32] [--reps 3]
        [--max-tokens 160] [--spec-tokens K] [--spec-max-batch B] [--spec-pause-after N] [--spec-pause-steps S]
        [--prompts N] [--peers llama-server] [--speculative ngram draft] [--weights W]
        [--spec-draft-model PATH] [--spec-draft-weights W] [--model PATH]

Two prompt sets: copy-heavy (edit this code, fix this JSON, answer quoting a passage, summarise a tool result: the
output repeats the prompt) and open chat (it does not). For each set and each number of streams, the same greedy
requests run on engines loaded side by side, speculative=None and each --speculative drafter ("ngram", the default;
"draft": a draft model, --spec-draft-model at --spec-draft-weights), alternating within each repetition so drift
hits them alike; --weights is every engine's weight format. Every prompt of a set runs at every number of streams:
at fewer streams than prompts, the set in batches of that many (one at a time at one stream). Timed: in each batch,
from the step where every request has its first token (prefill done) to the last token; speed = tokens generated in
those spans / their seconds. The table shows medians over the repetitions and the same-run ratio speculation / off,
with the acceptance (accepted / drafted draft tokens). Greedy outputs must be identical in every mode: the script
checks it. Between runs the prefix cache is emptied, so no run drafts an earlier run's output; within a run,
streams that share a prompt may draft from each other's cached blocks (the prompts are cycled over the streams), as
tenants sending the same document would.

--peers llama-server also runs llama.cpp's llama-server on the same token ids, without speculation and with its
ngram-simple and ngram-mod (bench/spec_peers.py says how it is started and timed), in the same repetitions. Each
speculation's row gives its ratio against its own engine's no-speculation run and how many greedy outputs equal that
run's; a last row per set and streams compares cpuserve's speedup with llama-server's best.

--spec-max-batch defaults to the number of streams measured, so drafting is on at every size (the question the
table answers is where it stops paying); --spec-max-batch 0 keeps the engine's default.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

CODE = '''def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            orders.append({"id": int(fields[0]), "customer": fields[1], "total": float(fields[2])})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["total"]
    return totals
'''
BROKEN_JSON = ('{"service": "billing", "replicas": 3, "ports": [8080, 9090,], "env": {"LOG_LEVEL": "info", '
               '"REGION": "eu-west-1",}, "owners": ["ana", "li", "sam"], "limits": {"cpu": "2", "memory": "4Gi"}}')
PASSAGE = ("The Skerry Point lighthouse was built in 1871 from granite quarried on the island itself. Its first lamp "
           "burned colza oil; paraffin replaced it in 1882, and in 1934 the station was converted to electricity, "
           "with a diesel generator kept as a reserve. The last resident keeper, Margaret Dunn, left in 1989, when the "
           "light was automated and its range reduced from 22 to 18 nautical miles.")
TOOL_RESULT = ('{"query": "open incidents", "results": [{"id": "INC-4411", "service": "checkout", "severity": "high", '
               '"opened": "2026-03-02T09:14Z", "summary": "payment timeouts above 2 s for 4% of requests"}, '
               '{"id": "INC-4415", "service": "search", "severity": "low", "opened": "2026-03-02T11:40Z", '
               '"summary": "stale results for queries with accents"}]}')
COPY_HEAVY = [
    f"Rename the function load_orders to read_orders and the variable totals to sums in this code. Return the "
    f"whole file:\n{CODE}",
    f"This JSON does not parse. Fix it and return the corrected JSON only:\n{BROKEN_JSON}",
    f"Answer by quoting the passage word for word: what happened in 1934 and when did the last keeper leave?\n"
    f"{PASSAGE}",
    f"A tool returned this result:\n{TOOL_RESULT}\nSummarise each incident, repeating its id, service, severity and "
    f"summary exactly.",
    f"Add a docstring to each function in this code and return the whole file:\n{CODE}",
    f"Reformat this JSON with one key per line, keeping every value:\n{BROKEN_JSON.replace(',]', ']').replace(',}', '}')}",
]
OPEN_CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a CPU cache works to a high-school student.",
    "What are three good habits for learning a new language? Explain each.",
    "Describe the water cycle in a few paragraphs.",
    "Give me ideas for a weekend trip in the mountains, with a packing list.",
    "Why is the sky blue? Answer in detail.",
]
SETS = {"copy-heavy": COPY_HEAVY, "open chat": OPEN_CHAT}
TARGET_SPEEDUP = 1.8  # issue 45 item 5: at one stream on the copy-heavy set, and ahead of llama-server's best


def run(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[list[int]], int, int]:
    """(decode seconds, tokens decoded in them, each request's output, drafted, accepted) of one batch."""
    from cpuserve.engine.sampling_params import SamplingParams

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    drafted0, accepted0 = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    requests = [engine.make_request(p, params) for p in prompts]
    outputs = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add(r)
    t0 = None
    while engine.has_unfinished_requests():
        if t0 is None and all(outputs[r.request_id] for r in requests):
            t0, before = time.perf_counter(), sum(len(o) for o in outputs.values())
        for chunk in engine.step():
            outputs[chunk.request_id].extend(chunk.new_token_ids)
    seconds = time.perf_counter() - (t0 if t0 is not None else time.perf_counter())
    decoded = sum(len(o) for o in outputs.values()) - (before if t0 is not None else 0)
    return (seconds, decoded, [outputs[r.request_id] for r in requests],
            engine.scheduler.num_draft_tokens - drafted0, engine.scheduler.num_accepted_tokens - accepted0)


def batches(ids: list[list[int]], streams: int) -> list[list[list[int]]]:
    """The set at `streams` streams: every prompt once, `streams` at a time, or the prompts cycled over the streams
    when there are more streams than prompts."""
    if streams >= len(ids):
        return [[ids[i % len(ids)] for i in range(streams)]]
    return [ids[i:i + streams] for i in range(0, len(ids), streams)]


def measure(runners: dict, ids: list[list[int]], streams: int, reps: int, where: str,
            exact: bool = True) -> tuple[dict, dict]:
    """Each runner on every batch of the set, alternating within a repetition. Returns per label
    {"speed": [tok/s of each repetition], "drafted", "accepted", "same": [greedy outputs equal to its no-speculation
    run's, of]} and {label: why it failed}; with exact, cpuserve's outputs must be equal (SystemExit otherwise)."""
    stats = {label: {"speed": [], "drafted": 0, "accepted": 0, "same": [0, 0]} for label in runners}
    failed = {}
    for _ in range(reps):
        seconds, decoded = dict.fromkeys(runners, 0.0), dict.fromkeys(runners, 0)
        for batch in batches(ids, streams):
            results = {}
            for label, runner in runners.items():
                if label in failed:
                    continue
                try:
                    results[label] = runner(batch)
                except Exception as e:  # noqa: BLE001 - a peer failing must not lose the other numbers
                    if label.startswith("cpuserve"):
                        raise
                    failed[label] = f"{type(e).__name__}: {str(e)[:300]}"
            if exact and any(label.startswith("cpuserve") and outputs != results["cpuserve off"][2]
                   for label, (_, _, outputs, _, _) in results.items()):
                raise SystemExit(f"{where}: greedy outputs differ with speculation")
            for label, (s, n, outputs, drafted, accepted) in results.items():
                seconds[label] += s
                decoded[label] += n
                stats[label]["drafted"] += drafted
                stats[label]["accepted"] += accepted
                off = results.get(label.rsplit(" ", 1)[0] + " off")
                if off is not None:
                    stats[label]["same"][0] += sum(a == b for a, b in zip(outputs, off[2]))
                    stats[label]["same"][1] += len(outputs)
        for label in runners:
            if label not in failed:
                stats[label]["speed"].append(decoded[label] / seconds[label] if seconds[label] > 0 else float("nan"))
    return stats, failed


def rows(set_name: str, streams: int, stats: dict, failed: dict) -> list[str]:
    """The table's rows of one set at one number of streams: each speculation against its engine's own no-speculation
    run (median of the per-repetition ratios), then cpuserve's speedup against llama-server's best."""
    out, speedups = [], {}
    for label in stats:
        engine, mode = label.rsplit(" ", 1)
        if mode == "off":
            continue
        if label in failed or engine + " off" in failed:
            why = failed.get(label) or failed[engine + " off"]
            out.append(f"{set_name:12s} {streams:7d} {label:26s} failed: {why}")
            continue
        off, spec = stats[engine + " off"]["speed"], stats[label]["speed"]
        speedups[label] = statistics.median(s / o for s, o in zip(spec, off))
        drafted, accepted, same = stats[label]["drafted"], stats[label]["accepted"], stats[label]["same"]
        rate = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
        out.append(f"{set_name:12s} {streams:7d} {label:26s} {statistics.median(off):9.1f} "
                   f"{statistics.median(spec):10.1f} {speedups[label]:6.2f} {rate:>9s} {f'{same[0]}/{same[1]}':>11s}")
    peers = {k: v for k, v in speedups.items() if not k.startswith("cpuserve")}
    if peers and "cpuserve ngram" in speedups:
        best = max(peers, key=peers.get)
        ours = speedups["cpuserve ngram"]
        verdict = "ahead" if ours > peers[best] else "behind"
        if set_name == "copy-heavy" and streams == 1:  # issue 45 item 5's target
            met = ours >= TARGET_SPEEDUP and ours > peers[best]
            verdict += f"; target >= {TARGET_SPEEDUP}x and ahead: {'met' if met else 'missed'}"
        spec_speed = {k: statistics.median(stats[k]["speed"]) for k in (best, "cpuserve ngram")}
        out.append(f"{set_name:12s} {streams:7d} cpuserve ngram {ours:.2f}x vs {best} {peers[best]:.2f}x: {verdict} "
                   f"({spec_speed['cpuserve ngram']:.1f} vs {spec_speed[best]:.1f} tok/s)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--prompts", type=int, default=0, help="use only the first N prompts of each set (0: all)")
    ap.add_argument("--spec-tokens", type=int, default=None, help="k (default: the engine's)")
    ap.add_argument("--spec-pause-after", type=int, default=None,
                    help="wholly rejected drafts in a row before a request pauses drafting (default: the engine's)")
    ap.add_argument("--spec-pause-steps", type=int, default=None, help="the pause, in steps (default: the engine's)")
    ap.add_argument("--spec-max-batch", type=int, default=None,
                    help="drafting off above this many running requests (default: the streams measured; 0: the "
                         "engine's default)")
    ap.add_argument("--speculative", nargs="+", default=["ngram"], choices=["ngram", "draft"],
                    help="the drafters measured against no speculation")
    ap.add_argument("--weights", default="int4", help="the model's weight format (every engine's)")
    ap.add_argument("--model", default=None, help="the model every engine serves (default: the embedded SmolLM2; "
                                                  "bench/deep_smollm2.py makes one a draft model pays on)")
    ap.add_argument("--spec-draft-model", default=None, help="the draft model (default: the embedded SmolLM2)")
    ap.add_argument("--spec-draft-weights", default=None, help="the draft model's weights (default: --weights)")
    ap.add_argument("--allow-diverging", action="store_true",
                    help="count the greedy outputs equal to no speculation's instead of stopping at one that is not "
                         "(none should differ: every weight format computes a verification row as a one-token decode; "
                         "this measures a change that breaks that)")
    ap.add_argument("--peers", nargs="*", default=[], choices=["llama-server"],
                    help="also llama-server without speculation and with ngram-simple and ngram-mod "
                         "(bench/spec_peers.py; builds it the first time, ~10 min)")
    args = ap.parse_args()
    from cpuserve.engine.threads import reexec_with_intel_openmp

    reexec_with_intel_openmp()  # what `cpuserve serve` runs
    from machine import describe

    from cpuserve.engine.llm import LLM
    from cpuserve.engine.loader import default_model_path

    spec = {"spec_max_batch": args.spec_max_batch or max(args.streams)}
    if args.spec_max_batch == 0:
        del spec["spec_max_batch"]
    for name in ("spec_tokens", "spec_pause_after", "spec_pause_steps"):
        if getattr(args, name) is not None:
            spec[name] = getattr(args, name)
    common = dict(model=args.model, weights=args.weights, kv_cache="int8", kv_cache_gb=1.0,
                  max_num_seqs=max(args.streams),
                  show_progress=False)
    draft = {"spec_draft_model": args.spec_draft_model, "spec_draft_weights": args.spec_draft_weights}
    engines = {"off": LLM(**common)}
    for method in args.speculative:
        engines[method] = LLM(**common, **spec, speculative=method, **(draft if method == "draft" else {}))
    settings = ("spec_tokens", "spec_max_batch", "spec_pause_after", "spec_pause_steps", "spec_min_acceptance")
    tok, threads = engines["off"].tokenizer, engines["off"].engine.num_threads
    if args.peers:
        import spec_peers
        from peer_llama_server import build

        build()  # before any timing: the first time it compiles for minutes
    print(describe())
    print(f"{threads} threads; greedy, max_tokens {args.max_tokens}; weights {args.weights}; settings "
          f"{ {k: getattr(engines[args.speculative[0]].engine.config, k) for k in settings} }")
    if "draft" in engines:
        print(f"draft model: {args.spec_draft_model or 'the embedded SmolLM2-135M-Instruct'}, weights "
              f"{args.spec_draft_weights or args.weights}")
    if args.peers:
        print("llama-server: the GGUF as stored, no repacking, -fa on, -np = streams, a server per batch; draft "
              "sizes at llama.cpp's defaults")
    print(f"{'set':12s} {'streams':>7s} {'engine, speculation':26s} {'off tok/s':>9s} {'spec tok/s':>10s} "
          f"{'ratio':>6s} {'accepted':>9s} {'same greedy':>11s}")
    for set_name, texts in SETS.items():
        texts = texts[:args.prompts] if args.prompts else texts
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
               for t in texts]
        for streams in args.streams:
            runners = {f"cpuserve {mode}": functools.partial(run, llm, max_tokens=args.max_tokens)
                       for mode, llm in engines.items()}
            for mode in spec_peers.MODES if args.peers else []:
                runners[f"llama-server {mode}"] = functools.partial(
                    spec_peers.run, mode, default_model_path(), threads, streams, max_tokens=args.max_tokens)
            stats, failed = measure(runners, ids, streams, args.reps, f"{set_name}, {streams} streams",
                                    exact=not args.allow_diverging)
            print("\n".join(rows(set_name, streams, stats, failed)), flush=True)


if __name__ == "__main__":
    main()
