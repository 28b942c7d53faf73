"""Write Spec-Bench answer files (one per method) from an existing results file.

python experiments/specbench_answers.py runs/bench/records.jsonl runs/bench/specbench
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from framework.config_fields import ConfigError
from framework.data.specbench import write_answer_files
from framework.models.loading import model_name
from framework.results.records import read_records

EPILOG = """example:
  python experiments/specbench_answers.py runs/bench/records.jsonl runs/bench/specbench
  # then, in a Spec-Bench checkout:
  python evaluation/speed.py --file-path runs/bench/specbench/swift.jsonl \\
      --base-path runs/bench/specbench/vanilla.jsonl --tokenizer-path HuggingFaceTB/SmolLM2-135M-Instruct

See docs/benchmarks.md, "Spec-Bench's own evaluation"."""


def _meta(results: Path) -> dict:
    """The metadata written beside the results: ``<stem>.meta.json`` (run.py) or ``meta.json``
    (bench.py); ``{}`` when there is none."""
    for path in (results.with_suffix(".meta.json"), results.parent / "meta.json"):
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return {}
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="specbench_answers.py",
        description="Turn a results JSONL of run.py (--output) or bench.py (<out>/records.jsonl) into "
        "Spec-Bench answer files, OUT_DIR/<method>.jsonl (vanilla.jsonl the baseline; OUT_DIR/run_<r>/ per "
        "repeat of a bench.py --repeats run), for Spec-Bench's evaluation/speed.py and equal.py.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "results", metavar="RESULTS.jsonl", help="the results file, or the run's folder holding it"
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="where the answer files go (created)")
    p.add_argument("--model", default=None, help="the model's name in model_id (default: from the metadata)")
    args = p.parse_args(argv)
    results = Path(args.results)
    if results.is_dir():  # a run's folder (run.py and bench.py write one)
        results = results / "records.jsonl"
    try:
        if not results.is_file():
            raise ConfigError("RESULTS.jsonl", str(results), "an existing results file")
        records = read_records(results)
        if not any("turns" in r for r in records):
            raise ConfigError("RESULTS.jsonl", str(results), "a results file with decoded prompts")
        config = _meta(results).get("config", {})
        paths = write_answer_files(
            records,
            args.out_dir,
            model=args.model or (model_name(config.get("model")) if config else None),
            repeats=config.get("repeats"),
            protect=[results],
        )
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
