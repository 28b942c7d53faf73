"""Command line of the benchmark: ``python experiments/bench.py --methods vanilla,hf_generate,clasp``.

The flags are generated (`framework.session.flags`) from the `RunConfig` sections every method
shares (`framework.benchmark.bench_config.SHARED_SECTIONS` and `RUNNER_FIELDS`: ``--model``,
``--data``, ``--max-new-tokens``, ``--no-plots``, ...) and from `BenchConfig`'s own fields (``--methods``,
``--repeats``, ``--cost-model``, ...), plus ``--preset-args METHOD=FLAGS`` (repeatable). Bad input
exits with status 2 and a message naming the flag; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from framework.benchmark.bench import run_benchmark
from framework.benchmark.bench_config import (
    BASELINE,
    DEFAULT_METHODS,
    RUNNER_FIELDS,
    SHARED_SECTIONS,
    BenchConfig,
    allowed_methods,
)
from framework.benchmark.hf import HF_METHODS
from framework.config_fields import ConfigError
from framework.session.errors import OneLineParser, guarded, pop_debug
from framework.session.flags import add_config_flags, config_overrides_from_args
from framework.session.run_config import SECTIONS, RunConfig, RunnerConfig

#: BenchConfig fields without a generated flag: ``run`` has its own flags, ``preset_args`` is
#: spelled METHOD=FLAGS, ``command`` is the command line itself.
_NOT_FLAGS = ("run", "preset_args", "command")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``experiments/bench.py`` (the strategies must be registered first)."""
    presets = [m for m in allowed_methods() if m != BASELINE and m not in HF_METHODS]
    p = OneLineParser(
        prog="bench.py",
        description="Spec-Bench-style benchmark: our vanilla baseline, Hugging Face generate (greedy, prompt "
        "lookup, early exit) and any of our presets, interleaved on the same prompts with one model load.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Methods: vanilla, {', '.join(HF_METHODS)}, the presets {', '.join(presets)}, or preset YAML "
        f"files (default {','.join(DEFAULT_METHODS)}). See docs/benchmarks.md.\n\n"
        "examples:\n"
        "  python experiments/bench.py --limit 1 --max-new-tokens 64     # the default methods, 1 prompt per category\n"
        "  python experiments/bench.py --methods vanilla,swift,swift_safe,clasp_safe --raw --repeats 2\n"
        "  python experiments/bench.py --data ../shared/data/spec_bench/question.jsonl --limit 1 "
        "--model qwen2.5-coder-0.5b",
    )
    not_shared = [s for s in SECTIONS if s not in (*SHARED_SECTIONS, "runner")]
    not_shared += [f.name for f in dataclasses.fields(RunnerConfig) if f.name not in RUNNER_FIELDS]
    add_config_flags(p, RunConfig, exclude=not_shared)
    add_config_flags(
        p,
        BenchConfig,
        exclude=_NOT_FLAGS,
        groups={f.name: "benchmark" for f in dataclasses.fields(BenchConfig)},
    )
    p.add_argument(
        "--preset-args",
        action="append",
        default=[],
        metavar="METHOD=FLAGS",
        help="extra run.py flags for one preset, e.g. 'swift=--selector.skip_ratio 0.3' (repeatable)",
    )
    return p


def config_from_args(args: argparse.Namespace, command: str = "") -> BenchConfig:
    """The validated `BenchConfig` of parsed arguments.

    Raises:
        ConfigError: a bad value (the message names the flag).
    """
    pairs = []
    for item in args.preset_args:
        method, sep, flags = item.partition("=")
        if not sep or not method.strip():
            raise ConfigError("--preset-args", item, "METHOD=FLAGS, e.g. 'swift=--selector.skip_ratio 0.3'")
        pairs.append((method.strip(), flags))
    overrides: dict[str, Any] = config_overrides_from_args(args)
    return BenchConfig.from_overrides(**overrides, preset_args=tuple(pairs), command=command)


def main(argv: Sequence[str] | None = None, *, model: Any = None, tokenizer: Any = None) -> int:
    """``experiments/bench.py``; returns the exit status (2 for bad input, 130 when interrupted).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        model: an already loaded model (tests pass a tiny one); default: ``--model`` is loaded.
        tokenizer: its tokenizer.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = pop_debug(argv)
    command = "python experiments/bench.py " + shlex.join(argv)

    def body() -> int:
        cfg = config_from_args(build_parser().parse_args(argv), command.strip())
        run_benchmark(cfg, model, tokenizer)
        return 0

    return guarded(body, "every finished prompt is in <out>/records.jsonl", debug=debug)


__all__ = ["build_parser", "config_from_args", "main"]
