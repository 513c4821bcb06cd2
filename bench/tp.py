"""Replica groups (tensor parallel): communication and decode speed, 1 rank x 2 threads vs 2 ranks x 1 thread.

    python bench/tp.py allreduce          # all-reduce latency, shm transport vs gloo, 576..65536 floats

Numbers are medians; the machine has 2 cores shared with other work, so compare ratios taken in one run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["allreduce"], nargs="?", default="allreduce")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    if args.part == "allreduce":
        from tp_allreduce import table

        print("\n".join(table(args.iters)))


if __name__ == "__main__":
    main()
