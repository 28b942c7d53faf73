"""experiments/compare.py: one table over several result files, and the selectors' final state."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from framework.testing import plain_table

ROOT = Path(__file__).resolve().parents[2]


def _compare():
    spec = importlib.util.spec_from_file_location("compare", ROOT / "experiments" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(method, wall, summary=None):
    turn = {"skip_ratios": [0.2], "strategy_summary": {"selector": summary} if summary else {}}
    return {
        "question_id": 1,
        "category": "qa",
        "method": method,
        "new_tokens": 10,
        "wall_time": wall,
        "accept_lengths": [1] * 9 if method == "vanilla" else [3, 3, 3],
        "drafted": 0 if method == "vanilla" else 9,
        "accepted": 0 if method == "vanilla" else 6,
        "lossless": True,
        "turns": [turn],
        "timings": {"select": 0.25} if method != "vanilla" else {},
    }


def test_table_and_details(tmp_path, monkeypatch, capsys):
    summary = {"opt_steps": 5, "best_matchness": 0.5, "plan": {"attn_skip": [1]}, "matchness": [0.1, 0.5]}
    path = tmp_path / "swift.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (_rec("vanilla", 1.0), _rec("swift", 0.5, summary))))
    monkeypatch.setattr("sys.argv", ["compare.py", str(path), "--details"])
    assert _compare().main() == 0
    out = plain_table(capsys.readouterr().out)
    assert "| swift | 1 | 10.00 | 20.00 | 2.000x | 3.00 | 0.667 | 0.200 | 50.0% | 1/1 |" in out
    # scalars only: the plan and the matchness list stay in the JSONL
    assert "- swift: opt_steps=5, best_matchness=0.5" in out and "plan" not in out.split("- swift:")[1]


def test_missing_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["compare.py", str(tmp_path / "nope.jsonl")])
    assert _compare().main() == 2
    assert "no such run folder or results file" in capsys.readouterr().err


def test_cost_model_ceiling_lines(tmp_path, monkeypatch, capsys):
    from framework.testing import synthetic_cost_model

    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (_rec("vanilla", 1.0), _rec("m", 0.5))))
    cm = tmp_path / "cm.json"
    cm.write_text(json.dumps({"cost_model": synthetic_cost_model(10).to_dict()}))  # as in a skip-set file
    monkeypatch.setattr("sys.argv", ["compare.py", str(path), "--cost-model", str(cm)])
    assert _compare().main() == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # alpha 2/3, 4 of 20 sub-layers skipped: one draft step costs 0.1 + 0.5 * 8/10 + 0.4 * 8/10 = 0.82
    k1 = (1 + 2 / 3) / (0.82 + 1.1)
    assert line.startswith(
        "- m: measured 2.000x; cost model at alpha 0.667, skip ratio 0.200: ceiling 1.000x (k = 0)"
    )
    assert f"best drafting {k1:.3f}x (k = 1)" in line
    cm.write_text("{}")
    assert _compare().main() == 2
