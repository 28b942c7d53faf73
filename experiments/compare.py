"""Combine result files of several runs into one table (each method against its own run's vanilla).

python experiments/compare.py runs/a.jsonl runs/b.jsonl [--category qa]
"""

import argparse
import json
import sys
from pathlib import Path

from framework.metrics import compare_table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="results JSONL files written by run.py")
    p.add_argument("--category", default="overall", help="category row to report (default overall)")
    args = p.parse_args()
    runs = {}
    for path in args.results:
        if not path.is_file():
            print(f"error: {path}: no such file", file=sys.stderr)
            return 2
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        methods = [r["method"] for r in records if r["method"] != "vanilla"]
        runs[methods[0] if methods else path.stem] = records
    print(compare_table(runs, args.category))
    return 0


if __name__ == "__main__":
    sys.exit(main())
