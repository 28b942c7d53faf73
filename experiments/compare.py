"""Combine result files of several runs into one table (each method against its own run's vanilla).

python experiments/compare.py runs/a runs/b [--category qa] [--details] [--cost-model F]

Each argument is a run's folder (what run.py and bench.py write) or a results JSONL (an earlier
run.py's ``x.jsonl``, or a folder's ``records.jsonl``).

``--details`` adds, per run, the scalar fields of the selector's summary after the run's last
generation (e.g. SWIFT's optimisation steps and best matchness, CLaSp's DP share, DEL's eTPL).

``--cost-model F`` (a JSON `CostModel`, or a ``selfsd_bo`` skip-set file, which contains the one
its search measured) adds the speedup the cost model predicts for each row's measured alpha and
skip ratio: the best over draft lengths k of chain drafting with independent acceptance
(`CostModel.ceiling`). A row far below its ceiling loses time outside the model (optimisation,
selector statistics, tree verification, Python overhead).
"""

import argparse
import json
import sys
from pathlib import Path

from framework.engine.cost_model import CostModel
from framework.results.metrics import aggregate, compare_table, cost_model_prediction, speedup
from framework.results.records import read_records


def final_selector_summary(records: list[dict]) -> dict:
    """Scalar fields of the selector summary of the last speculative generation in ``records``."""
    for rec in reversed(records):
        if rec["method"] == "vanilla":
            continue
        for turn in reversed(rec["turns"]):
            summary = turn.get("strategy_summary", {}).get("selector")
            if summary:
                return {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))}
    return {}


def ceilings(runs: dict[str, list[dict]], cost: CostModel, category: str) -> list[str]:
    """One line per method: measured speedup next to the cost model's prediction at its alpha."""
    out = []
    for label, records in runs.items():
        agg = aggregate(records).get(category, {})
        base = agg.get("vanilla")
        for name, m in agg.items():
            if name == "vanilla" or base is None or not base.mean_tokens_per_s:
                continue
            pred = cost_model_prediction(cost, m.acceptance_rate, m.skip_ratio, m.forwards_per_draft_token)
            measured = speedup(m.tokens_per_s, base.tokens_per_s)
            out.append(
                f"- {label}: measured {measured:.3f}x; cost model at alpha {pred['alpha']:.3f}, skip ratio "
                f"{m.skip_ratio:.3f}: ceiling {pred['ceiling']:.3f}x (k = {pred['ceiling_k']}), best drafting "
                f"{pred['drafting']:.3f}x (k = {pred['drafting_k']})"
            )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "results", nargs="+", type=Path, help="run folders (or their results JSONL) written by run.py"
    )
    p.add_argument("--category", default="overall", help="category row to report (default overall)")
    p.add_argument("--details", action="store_true", help="also print each run's final selector summary")
    p.add_argument(
        "--cost-model", type=Path, default=None, help="a CostModel JSON or a selfsd_bo skip-set file"
    )
    args = p.parse_args()
    runs = {}
    for path in args.results:
        file = path / "records.jsonl" if path.is_dir() else path
        if not file.is_file():
            print(f"error: {path}: no such run folder or results file", file=sys.stderr)
            return 2
        records = read_records(file)
        methods = [r["method"] for r in records if r["method"] != "vanilla"]
        runs[methods[0] if methods else path.stem] = records
    print(compare_table(runs, args.category))
    if args.cost_model is not None:
        try:
            data = json.loads(args.cost_model.read_text())
            cost = CostModel.from_dict(data.get("cost_model", data))
        except (OSError, ValueError, TypeError, KeyError) as err:
            print(f"error: --cost-model {args.cost_model}: not a cost model ({err})", file=sys.stderr)
            return 2
        print()
        print("\n".join(ceilings(runs, cost, args.category)))
    if args.details:
        print()
        for label, records in runs.items():
            fields = final_selector_summary(records)
            if fields:
                print(f"- {label}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
