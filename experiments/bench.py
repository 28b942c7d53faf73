"""Benchmark several methods in one interleaved run, Spec-Bench style (see ``--help`` and docs/benchmarks.md)."""

import sys

from framework.runner.cli import bench_main

if __name__ == "__main__":
    sys.exit(bench_main())
