"""Benchmark several methods in one interleaved run, Spec-Bench style (see ``--help``).

python experiments/bench.py --methods vanilla,hf_generate,hf_prompt_lookup,hf_early_exit,clasp --limit 1

The logic lives in `framework.benchmark.bench` (importable and tested); docs/benchmarks.md describes the
protocol and how to read the table.
"""

import sys

from framework.benchmark.bench import main

if __name__ == "__main__":
    sys.exit(main())
