"""Every CPUSERVE_* environment variable cpuserve reads, declared once: name, type, default and help.

Code reads a variable through its declaration (`KERNELS.get()`), never os.environ, so a value outside the allowed
ones fails at once with one line naming the variable and what it takes, instead of meaning the default. README's
table of switches is rendered from here (`python -m cpuserve.engine.settings`), and tests/test_settings.py checks
that every CPUSERVE_ name in the tree is declared here and every declared one is read.

Two families are pydantic settings instead, each field one variable: CPUSERVE_SERVE_<FIELD> (ServeConfig,
serving/config.py) and CPUSERVE_OPERATOR_<FIELD> (OperatorSettings, operator/settings.py).

The standard library only: the operator, the bench scripts and the tests import it without the engine.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVE_PREFIX = "CPUSERVE_SERVE_"  # + a ServeConfig field, upper case
OPERATOR_PREFIX = "CPUSERVE_OPERATOR_"  # + an OperatorSettings field, upper case
# who reads a variable: a user's switch of the engine or of serving, one cpuserve sets for its own processes, or
# one of the bench scripts, the tests, or none (the operator sets it on its pods for people who read their env)
SCOPES = ("engine", "serving", "internal", "bench", "tests", "pods")
FLAG = ("0", "1")


@dataclass(frozen=True, slots=True)
class Setting:
    """One environment variable. Unset or empty means `default`.

    type: str (any text, or one of `choices`), bool ("0" / "1") or int (within `bounds`).
    default: the value unset; None when unset means something no value names (`unset` says what).
    """

    name: str
    type: type
    default: Any
    help: str
    scope: str
    choices: tuple[str, ...] = ()
    bounds: tuple[int, int] | None = None
    unset: str = ""  # what unset means when default is None, for the tables
    values: str = ""  # int settings: what a value must be, for the error

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value in `environ` (default: this process's environment), parsed and checked.

        Raises:
            ValueError: `NAME='value': allowed values are ...` (or `must be ...`).
        """
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        return self.default if raw == "" else self.parse(raw)

    def parse(self, raw: str) -> Any:
        if self.type is bool:
            if raw not in FLAG:
                raise ValueError(f"{self.name}={raw!r}: allowed values are {', '.join(FLAG)}")
            return raw == "1"
        if self.type is int:
            lo, hi = self.bounds or (-sys.maxsize, sys.maxsize)
            if not raw.lstrip("-").isdigit() or not lo <= int(raw) <= hi:
                raise ValueError(f"{self.name}={raw!r}: must be {self.values}")
            return int(raw)
        if self.choices and raw not in self.choices:
            raise ValueError(f"{self.name}={raw!r}: allowed values are {', '.join(self.choices)}")
        return raw

    def text(self, value: Any) -> str:
        """`value` as this variable spells it (what to put in a child process's environment)."""
        return ("1" if value else "0") if self.type is bool else str(value)

    def shown_default(self) -> str:
        if self.default is None:
            return self.unset
        return f"`{self.text(self.default)}`"


SETTINGS: dict[str, Setting] = {}


def _declare(name: str, type: type, default: Any, help: str, scope: str, **more: Any) -> Setting:
    setting = Setting("CPUSERVE_" + name, type, default, help, scope, **more)
    assert setting.name not in SETTINGS and scope in SCOPES, setting
    assert setting.default is None or type is not str or not setting.choices or setting.default in setting.choices
    SETTINGS[setting.name] = setting
    return setting


# -- engine ------------------------------------------------------------------------------------------------------
KERNELS = _declare("KERNELS", str, "auto", "`native`: fail if the C++ kernels do not load (`auto`: plain torch "
                   "then, with a warning); `torch`: plain torch only", "engine",
                   choices=("auto", "native", "torch"))
KERNEL_LEVEL = _declare("KERNEL_LEVEL", str, None, "a lower x86 level's kernels than the CPU's best (one it lacks is "
                        "refused)", "engine",
                        choices=("avx512_bf16", "avx512_vnni", "avx2_vnni", "avx2"), unset="the CPU's best")
KERNEL_CACHE = _declare("KERNEL_CACHE", str, None, "where a checkout builds its kernels", "engine",
                        unset="`~/.cache/cpuserve/kernels`")
PROMPT_GEMM = _declare("PROMPT_GEMM", str, "bf16", "`int8`: prompt rows take the decode rows' int8 scheme, not "
                       "AMX-BF16 tiles", "engine", choices=("int8", "bf16"))
AMX = _declare("AMX", str, "auto", "`off`: the GEMMs keep AVX-512 register blocks, no AMX tiles (the C++ "
               "reads it)", "engine", choices=("auto", "off"))
FUSED_DECODE = _declare("FUSED_DECODE", bool, True, "`0`: decode op by op instead of one C++ call per step",
                        "engine")
HUGE_PAGES = _declare("HUGE_PAGES", bool, True, "`0`: weights and KV pools stay on 4 KiB pages", "engine")
OPENMP = _declare("OPENMP", str, "intel", "`gnu`: keep torch's libgomp, not Intel's OpenMP",
                  "engine", choices=("intel", "gnu"))
CPUS = _declare("CPUS", str, None, "one CPU list per rank of a replica group (`0-27|28-55`)", "engine",
                unset="the affinity mask, split")
COMM = _declare("COMM", str, None, "a replica group's transport: `shm` (one host) or `torch` (gloo / ccl)",
                "engine", choices=("shm", "torch"), unset="`shm` when the ranks share a host")
REEXEC = _declare("REEXEC", bool, False, "`cpuserve` re-executed itself with Intel's OpenMP preloaded "
                  "(engine/threads.py)", "internal")

# -- serving -----------------------------------------------------------------------------------------------------
SPLIT_CORES = _declare("SPLIT_CORES", bool, True, "`0`: Ray's processes share the engines' cores", "serving")
ENGINE_CORES = _declare("ENGINE_CORES", str, None, "the engines' cores `cpuserve serve` hands its replicas, "
                        "comma-separated (serving/affinity.py)", "internal", unset="none: as the replica's mask")
SERVE_SUPERVISED = _declare("SERVE_SUPERVISED", bool, False, "`cpuserve serve` runs under its own supervisor "
                            "(serving/cli.py)", "internal")
ENGINE_METRICS_PORT = _declare("ENGINE_METRICS_PORT", int, None, "the port of a rank pod's engine gauges, set by "
                               "the operator (serving/engine_metrics.py)", "internal", bounds=(0, 65535),
                               unset="none", values="a port number 0-65535 (0 or unset: none)")
ENGINE_HTTP_PORT = _declare("ENGINE_HTTP_PORT", int, None, "the port of a rank pod's own OpenAI HTTP API (its engine "
                            "alone), set by the operator (serving/engine_http.py)", "internal", bounds=(0, 65535),
                            unset="none", values="a port number 0-65535 (0 or unset: none)")

# -- set by the operator on its pods, read by nothing in cpuserve (for the people and tools that read a pod) --------
LLMSERVICE = _declare("LLMSERVICE", str, None, "the LLMService a pod belongs to", "pods", unset="none")
GROUP = _declare("GROUP", int, None, "a rank pod's replica group", "pods", bounds=(0, 1 << 16), unset="none",
                 values="a group number")
RANK = _declare("RANK", int, None, "a rank pod's rank in its group", "pods", bounds=(0, 1 << 16), unset="none",
                values="a rank number")

# -- bench and tests ---------------------------------------------------------------------------------------------
BENCH_PEERS_DIR = _declare("BENCH_PEERS_DIR", str, None, "where bench/peer_envs.py installs the peers' venvs",
                           "bench", unset="`~/.cache/cpuserve-bench/peers`")
BENCH_LLAMA_EXTRA_BUFTS = _declare("BENCH_LLAMA_EXTRA_BUFTS", bool, False, "`1`: llama.cpp's extra buffer types "
                                   "(AMX, repacking) on in the bench's llama.cpp peers", "bench")
FUZZ_SCALE = _declare("FUZZ_SCALE", int, 1, "the fuzz tests run N times their examples, from a random seed "
                      "(`make fuzz`: 10)", "tests", bounds=(1, 1_000_000), values="an integer >= 1")
TEST_SHOW_LOG = _declare("TEST_SHOW_LOG", bool, False, "`1`: the operator tests print the operator's log",
                         "tests")


def markdown_table(scopes: tuple[str, ...] = ("engine", "serving")) -> str:
    """README's table: the switches a user sets, then the two families."""
    rows = [("variable", "default", "what")]
    rows += [(f"`{s.name}`", s.shown_default(), s.help) for s in SETTINGS.values() if s.scope in scopes]
    rows += [(f"`{SERVE_PREFIX}<FIELD>`", "", "any `cpuserve serve` setting (serving/config.py)"),
             (f"`{OPERATOR_PREFIX}<FIELD>`", "", "any operator setting (operator/settings.py; the Helm chart's)")]
    lines = ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join([lines[0], "|---|---|---|", *lines[1:]]) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
