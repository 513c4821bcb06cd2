"""The `cpuserve` command: generate and bench here; serve and operator register themselves when installed."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import types
import typing
from typing import Any, Literal

from cpuserve.engine.config import EngineConfig, engine_option

# Subcommands owned by other packages: each module offers register(subparsers).
_PLUGINS = ("cpuserve.serving.cli", "cpuserve.operator.cli")
# The extra that installs what each subcommand imports (an install with the operator extra alone has no torch)
_EXTRAS = {"generate": "engine", "bench": "engine", "serve": "serve", "drain": "serve", "operator": "operator"}

# The EngineConfig fields that every subcommand starting an engine offers as flags; help, choices, type and default
# come from EngineConfig itself (engine/config.py's option())
ENGINE_FLAGS = ("model", "weights", "group_size", "activations", "kv_cache", "kv_cache_gb", "block_size",
                "max_num_seqs", "max_num_batched_tokens", "max_model_len", "arrival_window_ms", "num_threads")


def add_flag(parser: argparse.ArgumentParser, name: str, annotation: Any, default: Any, help: str | None,
             unset: Any = None, choices: tuple | None = None) -> None:
    """One --flag for a config field: type and choices from its annotation, its default shown in the help.

    Args:
        name: the field; the flag is --name-with-dashes and parses into args.name.
        annotation: the field's type: int, float, str, bool (--flag / --no-flag), Literal[...] (choices),
            optionally `| None`.
        default: the field's default, for the help text.
        unset: what args.name holds when the flag is not given (None: the config's own default applies).
        choices: allowed values, when the annotation does not list them.
    """
    kind, literal = _flag_type(annotation)
    text = (help or "").replace("%", "%%") + f" (default: {'none' if default is None else default})"
    flag = "--" + name.replace("_", "-")
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=unset, help=text.strip())
    else:
        parser.add_argument(flag, type=kind, choices=choices or literal, default=unset, help=text.strip())


def _flag_type(annotation: Any) -> tuple[type, tuple | None]:
    """(argparse type, choices) of a field's annotation; `X | None` is X."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in args if a is not type(None)]
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return type(args[0]), args
    return annotation, None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every subcommand that starts an engine, with EngineConfig's defaults."""
    hints = typing.get_type_hints(EngineConfig)
    for name in ENGINE_FLAGS:
        default, help, choices = engine_option(name)
        add_flag(parser, name, hints[name], default, help, unset=default, choices=choices or None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_FLAGS}


def _generate(args: argparse.Namespace) -> int:
    from cpuserve.engine.distributed.cpus import check_cpu_count
    from cpuserve.engine.errors import InvalidRequest
    from cpuserve.engine.llm import LLM
    from cpuserve.engine.sampling_params import SamplingParams

    try:  # before the model loads: a bad flag costs nothing
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
    except InvalidRequest as e:
        raise ValueError(e.message.replace(e.param, "--" + e.param.replace("_", "-"), 1)) from None
    if args.num_threads is not None:
        check_cpu_count("--num-threads", args.num_threads)
    llm = LLM(**engine_kwargs(args), ranks=args.ranks)
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
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts with the engine")
    gen.add_argument("prompt", nargs="+", help="one or more prompts, each answered on its own")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most per prompt (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0.0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default: 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = off (default: 0)")
    gen.add_argument("--seed", type=int, default=None, help="seed of this run's sampling (default: unseeded)")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text (default: off)")
    gen.add_argument("--ranks", type=int, default=1,
                     help="tensor-parallel ranks (processes; CPU sets from CPUSERVE_CPUS or split from the mask) "
                          "(default: 1)")
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
    if argv is None and importlib.util.find_spec("torch"):  # the console script, with the engine installed:
        from cpuserve.engine.threads import reexec_with_intel_openmp  # steps run off the main thread in serving

        reexec_with_intel_openmp()
    args = build_parser().parse_args(argv)
    args.from_command_line = argv is None  # the `cpuserve` command itself (not a call from Python)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "cpuserve":
            raise
        extra = _EXTRAS.get(args.command, "serve")
        print(f"error: `cpuserve {args.command}` needs {e.name}, which is not installed: install cpuserve with "
              f"its {extra!r} extra (pip install 'cpuserve[{extra}]')", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
