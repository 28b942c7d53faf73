"""Each command's ``--help`` ends with examples, and every example parses with that command's own
parser (an example that names a flag the command lost fails here, not in a newcomer's terminal)."""

from __future__ import annotations

import shlex

import pytest

from framework.runner.cli import build_parser as run_parser
from framework.sweep.cli import build_sweep_parser


def bench_parser():
    return run_parser(bench=True)


PARSERS = {"run.py": run_parser, "bench.py": bench_parser, "sweep.py": build_sweep_parser}


def examples(script: str) -> list[list[str]]:
    """The argument lists of the ``python experiments/<script> ...`` lines under "examples:"."""
    epilog = PARSERS[script]().epilog or ""
    assert "examples:" in epilog, f"{script} --help has no examples"
    out = []
    for line in epilog.split("examples:", 1)[1].splitlines():
        words = shlex.split(line.split("#", 1)[0].split("&&", 1)[0])
        if words[:2] == ["python", f"experiments/{script}"]:
            out.append(words[2:])
    return out


@pytest.mark.parametrize("script", sorted(PARSERS))
def test_help_examples_parse(script):
    found = examples(script)
    assert len(found) >= 2, f"{script}: at least two runnable examples"
    for args in found:
        PARSERS[script]().parse_args(args)  # SystemExit (exit 2) on a flag the parser does not know


def test_help_is_printed_with_its_line_breaks(capsys):
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "\nexamples:\n  python experiments/bench.py" in text
