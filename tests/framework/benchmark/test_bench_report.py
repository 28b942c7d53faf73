"""The benchmark's report (framework/benchmark/report.py): the plots of the plans."""

from __future__ import annotations

from framework.benchmark.report import make_plots


def test_plan_plots_come_from_the_first_repeat(tmp_path):
    def rec(method, plans, exits, repeat=0):
        turn = {"plans": plans, "exit_layers": exits}
        return {
            "method": method,
            "kind": "preset",
            "repeat": repeat,
            "drafted": 2,
            "accept_lengths": [2, 1],
            "turns": [turn],
        }

    records = [
        rec("dyn", ["10000000", "01000001"], [None, None]),
        rec("static", ["10000000", "10000000"], [None, None]),
        rec("early", ["00011111", "00111111"], [3, 2]),
        rec("dyn2", ["10000000", "10000000"], [None, None]),
        rec("dyn2", ["01000000"], [None], repeat=1),  # later repeats are not drawn
    ]
    summary = {"methods": {"dyn": {"speedup": {"overall": 1.1}}, "vanilla": {"speedup": {"overall": 1.0}}}}
    out = make_plots(tmp_path, summary, records, num_layers=4)
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["accept_lengths.png", "exit_layer_early.png", "skip_dyn.png", "speedup_by_category.png"]
    assert set(out) == {
        "speedup by category",
        "accepted tokens per round",
        "dyn: skip set per round",
        "early: exit layer per round",
    }
