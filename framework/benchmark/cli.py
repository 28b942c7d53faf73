"""Command line of the benchmark: ``python experiments/bench.py --methods vanilla,hf_generate,clasp``,
the one pipeline (`framework.runner.pipeline.run`) with several methods and the benchmark's report;
its flags and rules are `framework.runner.cli`'s."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from framework.runner import cli


def build_parser() -> Any:
    """The parser of ``experiments/bench.py`` (the strategies must be registered first)."""
    return cli.build_parser(bench=True)


def main(argv: Sequence[str] | None = None, *, model: Any = None, tokenizer: Any = None) -> int:
    """``experiments/bench.py``; returns the exit status (2 for bad input, 130 when interrupted).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        model: an already loaded model (tests pass a tiny one); default: ``--model`` is loaded.
        tokenizer: its tokenizer.
    """
    return cli.main(argv, bench=True, model=model, tokenizer=tokenizer)


__all__ = ["build_parser", "main"]
