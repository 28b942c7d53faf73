"""Benchmark several methods in one interleaved run, Spec-Bench style (see ``--help`` and docs/benchmarks.md)."""

import sys

from framework.benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main())
