"""Tutorial script: run two methods and compare them, in smoke mode on a tiny random model.

The page ``docs/tutorials/compare_methods.md`` runs this flow on the default model from the
command line (``experiments/run.py`` twice, then ``experiments/compare.py``) and includes this
file section by section. Here the same settings, as a `RunConfig` built in Python, run on a random
6-block Llama with a word-level
tokenizer, so the whole flow takes seconds, downloads nothing and writes only to a temporary
directory:

    python docs/tutorials/compare_methods.py

The numbers it prints mean nothing (a random model has no redundant layers); the test suite
runs it (``tests/test_docs.py``) to keep the page's flow working.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# --8<-- [start:flags]
#: The settings of the two commands on the page (``--limit 1 --max-new-tokens 32 --threads 1``),
#: minus --output (set per run below): every flag is a `RunConfig` field of the same name.
COMMON = {"limit": 1, "max_new_tokens": 32, "threads": 1}
#: ``--method <preset>`` of each command.
METHODS = {"static": "static_confidence", "clasp": "clasp"}
# --8<-- [end:flags]


# --8<-- [start:smoke]
def tiny_setup(workdir: Path):
    """A random 6-block Llama, its word-level tokenizer and a 4-prompt data file in ``workdir``.

    The tiny tokenizer knows only the words ``w0`` ... ``w122``, so the prompts are made of those
    (the built-in prompts would all map to the unknown token).
    """
    from framework.testing import tiny_model, tiny_tokenizer

    model = tiny_model("llama", num_layers=6, max_position_embeddings=256)
    tokenizer = tiny_tokenizer()
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["w1 w2 w3 w4 w5"]},
        {"question_id": 2, "category": "qa", "turns": ["w6 w7 w8"]},
        {"question_id": 3, "category": "code", "turns": ["w9 w10 w11 w12"]},
        {"question_id": 4, "category": "code", "turns": ["w13 w14 w15 w16 w17 w18"]},
    ]
    data = workdir / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, tokenizer, data


# --8<-- [end:smoke]


# --8<-- [start:run]
def run_method(name: str, workdir: Path, data: Path, model, tokenizer) -> dict:
    """What ``python experiments/run.py --method <METHODS[name]> <COMMON> --output runs/<name>``
    does (the run's folder: records, metadata, report, plots).

    `RunConfig.from_preset` builds the configuration exactly as the command line does (the
    preset's four strategies and their validated configs, then the overrides); `run` is the
    Lightning predict loop behind ``run.py``. Passing ``model`` and ``tokenizer`` skips loading
    the default model.
    """
    from framework import REGISTRIES
    from framework.runner.pipeline import run
    from framework.session.run_config import RunConfig

    cfg = RunConfig.from_preset(METHODS[name], **COMMON, output=str(workdir / name))
    # Smoke mode only: our prompts, and no W&B run (the default logger is wandb).
    cfg = cfg.replace(data=str(data), logger="none")
    print(f"== {cfg.method.label}: " + ", ".join(f"{k}={getattr(cfg.method, k).name}" for k in REGISTRIES))
    result = run(cfg, log=lambda line: None, model=model, tokenizer=tokenizer)
    print(result["table"])
    print("plots:", ", ".join(Path(p).name for p in result["plots"].values()))
    return result


# --8<-- [end:run]


# --8<-- [start:cost]
def save_cost_model(model, path: Path) -> None:
    """Measure a cost model (seconds per draft step and per verification) and save it as JSON.

    ``compare.py --cost-model FILE`` reads it. Measure on the machine, model, dtype and thread
    count of the runs you compare.
    """
    from framework.engine.adapter import adapter_for
    from framework.engine.cost_model import CostModel

    cost = CostModel.measure(adapter_for(model))
    path.write_text(json.dumps(cost.to_dict()))
    print("cost model:", cost.describe())


# --8<-- [end:cost]


def load_compare_module():
    """``experiments/compare.py`` as a module (``experiments/`` is not an installed package)."""
    spec = importlib.util.spec_from_file_location("compare", ROOT / "experiments" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --8<-- [start:compare]
def compare(outputs: list[Path], cost_path: Path) -> None:
    """What ``python experiments/compare.py runs/A runs/B --details --cost-model F`` prints."""
    from framework.engine.cost_model import CostModel
    from framework.results.records import read_records

    compare = load_compare_module()
    runs = {}
    for path in outputs:  # label each run by its method name, as compare.py does
        records = read_records(path)
        method = next(r["method"] for r in records if r["method"] != "vanilla")
        runs[method] = records
    print(compare.compare_table(runs, "overall"))
    print()
    cost = CostModel.from_dict(json.loads(cost_path.read_text()))
    print("\n".join(compare.ceilings(runs, cost, "overall")))
    print()
    for label, records in runs.items():
        fields = compare.final_selector_summary(records)
        if fields:
            print(f"- {label}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))


# --8<-- [end:compare]


# --8<-- [start:plots]
def joint_plots(outputs: list[Path], plot_dir: Path) -> list[Path]:
    """Both methods in one speedup chart and one accepted-length histogram."""
    from framework.benchmark.report import summarize
    from framework.results import plots
    from framework.results.records import read_records

    speedups, accept_lengths = {}, {}
    for path in outputs:
        records = read_records(path)
        method = next(r["method"] for r in records if r["method"] != "vanilla")
        summary = summarize(records, ["vanilla", method])  # the report's numbers, per method
        speedups[method] = summary["methods"][method]["speedup"]  # {category: speedup}
        accept_lengths[method] = [a for r in records if r["method"] == method for a in r["accept_lengths"]]
    return [
        plots.speedup_by_category(speedups, plot_dir / "speedup_by_category.png"),
        plots.accept_length_histogram(accept_lengths, plot_dir / "accept_lengths.png"),
    ]


# --8<-- [end:plots]


# --8<-- [start:main]
def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model, tokenizer, data = tiny_setup(workdir)
        outputs = []
        for name in METHODS:
            result = run_method(name, workdir, data, model, tokenizer)
            (label,) = result["summary"]["methods"].keys() - {"vanilla"}
            entry = result["summary"]["methods"][label]
            assert entry["prompts"] == 2, result["table"]  # both prompts in the report
            assert entry["mismatches"] == 0, "a greedy method must be lossless"
            outputs.append(Path(result["out"]))
        cost_path = workdir / "cost_model.json"
        save_cost_model(model, cost_path)
        print()
        compare(outputs, cost_path)
        written = joint_plots(outputs, workdir / "plots")
        assert all(p.is_file() and p.stat().st_size > 0 for p in written)
        print("joint plots:", ", ".join(p.name for p in written))
    print("ok")


if __name__ == "__main__":
    main()
# --8<-- [end:main]
