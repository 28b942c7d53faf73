"""The Spec-Bench-style benchmark: our vanilla baseline, Hugging Face ``generate`` and any of our
presets, interleaved on the same prompts with one model load (``experiments/bench.py``).

- `framework.benchmark.bench_config`: `BenchConfig` (the methods and the benchmark's knobs around one
  shared `RunConfig`), `parse_methods`;
- `framework.benchmark.hf`: `HFGenerateDecoder` (``hf_generate``, ``hf_prompt_lookup``,
  ``hf_early_exit``);
- `framework.benchmark.bench`: `run_benchmark` (the interleaved run);
- `framework.benchmark.report`: `summarize`, the markdown tables and the plots;
- `framework.benchmark.cli`: `main` (the flags generated from `RunConfig` and `BenchConfig`).

See ``docs/benchmarks.md``.
"""

from framework.benchmark.bench import preset_run_config, run_benchmark
from framework.benchmark.bench_config import (
    BASELINE,
    DEFAULT_METHODS,
    BenchConfig,
    MethodSpec,
    allowed_methods,
    parse_methods,
)
from framework.benchmark.cli import main
from framework.benchmark.hf import HF_METHODS, HFGenerateDecoder
from framework.benchmark.report import make_plots, render_report, summarize

__all__ = [
    "BASELINE",
    "DEFAULT_METHODS",
    "HF_METHODS",
    "BenchConfig",
    "HFGenerateDecoder",
    "MethodSpec",
    "allowed_methods",
    "main",
    "make_plots",
    "parse_methods",
    "preset_run_config",
    "render_report",
    "run_benchmark",
    "summarize",
]
