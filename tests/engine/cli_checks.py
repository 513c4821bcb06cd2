"""Helpers for the command-line tests: run the installed `cpuserve` script, and find flags a user cannot read."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from cpuserve.serving.ports import free_port

CPUSERVE = str(Path(sys.executable).parent / "cpuserve")  # the console script of this environment


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`cpuserve ARGS` as a user runs it (the console script, so its Intel OpenMP re-exec included)."""
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    return subprocess.run([CPUSERVE, *args], capture_output=True, text=True, timeout=timeout, env=env)


def undocumented_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The options of `parser` whose help is missing or does not show the default."""
    out = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if not action.help or "(default: " not in action.help:
            out.append(action.option_strings[-1])
    return out


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]
