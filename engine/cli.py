"""The `cpuserve` command: generate and bench here; serve and operator register themselves when installed."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from cpuserve.engine.config import GROUP_SIZES, KV_CACHE_DTYPES, WEIGHT_FORMATS

# Subcommands owned by other packages: each module offers register(subparsers).
_PLUGINS = ("cpuserve.serving.cli", "cpuserve.operator.cli")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every subcommand that starts an engine."""
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="int4")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=32)
    parser.add_argument("--kv-cache", choices=KV_CACHE_DTYPES, default="int8")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None, help="default: the cores in the affinity mask")


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("model", "weights", "group_size", "kv_cache", "kv_cache_gb", "block_size", "max_num_seqs",
            "max_num_batched_tokens", "max_model_len", "num_threads")
    return {k: getattr(args, k) for k in keys}


def _generate(args: argparse.Namespace) -> int:
    from cpuserve.engine.llm import LLM
    from cpuserve.engine.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(args), ranks=args.ranks)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        _print_generations(llm, args, params)
    finally:
        llm.engine.close()  # a replica group's worker processes stop with it
    return 0


def _print_generations(llm, args: argparse.Namespace, params) -> None:
    for prompt in args.prompt:
        if args.raw:
            ids = llm.tokenizer.encode(prompt)
        else:
            text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = llm.tokenizer.encode(text, add_special_tokens=False)
        out = llm.generate([ids], params)[0]
        print(out.text.strip())
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)


def _bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "engine.py"
    if not script.exists():
        print(f"{script} not found: `cpuserve bench` runs from a source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.bench_args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpuserve", description="Serve LLMs on CPUs.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts with the engine")
    gen.add_argument("prompt", nargs="+")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text")
    gen.add_argument("--ranks", type=int, default=1,
                     help="tensor-parallel ranks (processes; CPU sets from CPUSERVE_CPUS or split from the mask)")
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="run bench/engine.py (options after --)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    for name in _PLUGINS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the console script: steps run off the main thread in serving, see threads.py
        from cpuserve.engine.threads import reexec_with_intel_openmp

        reexec_with_intel_openmp()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
