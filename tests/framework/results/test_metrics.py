"""framework/results/metrics.py: the paper metrics computed from per-prompt records."""

from __future__ import annotations

import pytest

from framework.results.metrics import aggregate, compare_table, speedup, time_breakdown
from framework.testing import plain_table


def rec(qid, cat, method, new, wall, accept=(), drafted=0, accepted=0, lossless=True, skips=(), timings=None):
    return {
        "question_id": qid,
        "category": cat,
        "method": method,
        "new_tokens": new,
        "wall_time": wall,
        "accept_lengths": list(accept),
        "drafted": drafted,
        "accepted": accepted,
        "lossless": lossless,
        "turns": [{"skip_ratios": list(skips)}],
        "timings": timings or {},
    }


RECORDS = [
    rec(1, "qa", "vanilla", 10, 1.0, accept=[1] * 9, timings={"prefill": 0.1, "verify": 0.9, "lm_head": 0.2}),
    rec(
        1,
        "qa",
        "m",
        10,
        0.5,
        accept=[3, 3, 3],
        drafted=9,
        accepted=6,
        skips=[0.2, 0.2, 0.4],
        timings={"prefill": 0.1, "draft": 0.2, "verify": 0.15, "lm_head": 0.1},
    ),
    rec(2, "rag", "vanilla", 20, 1.0, accept=[1] * 19),
    rec(2, "rag", "m", 20, 4.0, accept=[2, 1, 4], drafted=6, accepted=4, lossless=False, skips=[0.1]),
]


def test_aggregate_pools_rounds_and_averages_speed_per_prompt():
    agg = aggregate(RECORDS)
    assert list(agg) == ["qa", "rag", "overall"]  # Spec-Bench order, overall last
    m = agg["overall"]["m"]
    assert m.prompts == 2
    assert m.mean_tokens_per_s == pytest.approx((10 / 0.5 + 20 / 4.0) / 2)  # mean of per-prompt tok/s
    assert m.mean_accepted_length == pytest.approx((9 + 7) / 6)  # committed / rounds, pooled
    assert m.acceptance_rate == pytest.approx(10 / 15)  # accepted / drafted, pooled
    assert m.skip_ratio == pytest.approx((0.2 + 0.2 + 0.4 + 0.1) / 4)
    assert (m.lossless, m.lossless_checked) == (1, 2)


def _summary(records, methods=("vanilla", "m")):
    """The report's numbers (`framework.benchmark.report.summarize`) of one-repeat records."""
    from framework.benchmark.report import summarize

    return summarize([dict(r, repeat=0) for r in records], list(methods))


def test_the_reports_speedup_is_the_ratio_of_means():
    from framework.benchmark.report import results_markdown

    m = _summary(RECORDS)["methods"]["m"]
    assert m["speedup"]["qa"] == pytest.approx(2.0) and m["speedup"]["rag"] == pytest.approx(0.25)
    # vanilla mean 15 tok/s, method mean 12.5 tok/s
    assert m["speedup"]["overall"] == pytest.approx(12.5 / 15) and m["tokens_per_s"]["overall"] == 12.5
    assert m["M"] == pytest.approx((9 + 7) / 6) and m["alpha"] == pytest.approx(10 / 15)
    assert m["mismatches"] == 1 and m["mismatched"] == ["2"]
    table = plain_table(results_markdown(_summary(RECORDS)))
    assert "| m | 2.000x | 0.250x | **0.833x** |" in table and "| 1/2 |" in table


def test_sampling_records_are_never_mismatches_and_a_baseline_only_report_has_its_row():
    from framework.benchmark.report import results_markdown

    sampled = [dict(r, lossless=None) if r["method"] == "m" else r for r in RECORDS]
    assert _summary(sampled)["methods"]["m"]["mismatches"] == 0
    only = _summary([r for r in RECORDS if r["method"] == "vanilla"], ["vanilla"])
    assert list(only["methods"]) == ["vanilla"]
    assert "| vanilla | 1.000x | 1.000x | **1.000x** | n/a (baseline) | 15.00 |" in plain_table(
        results_markdown(only)
    )


def test_compare_table_uses_each_runs_own_baseline():
    other = [
        dict(r, method="n") if r["method"] == "m" else dict(r, wall_time=r["wall_time"] * 2) for r in RECORDS
    ]
    table = plain_table(compare_table({"m": RECORDS, "n": other}))
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| m | 2 | 15.00 | 12.50 | 0.833x")
    assert rows[1].startswith("| n | 2 | 7.50 | 12.50 | 1.667x")
    assert rows[0].split(" | ")[-2] == "0.0%"  # no selector time recorded
    slow = [dict(r, timings={**r["timings"], "select": 0.5}) if r["method"] == "m" else r for r in RECORDS]
    # 2 x 0.5 s of selector time in the method's wall time of 0.5 + 4.0 s
    assert plain_table(compare_table({"m": slow})).splitlines()[2].split(" | ")[-2] == "22.2%"


def test_time_breakdown_shares():
    table = plain_table(time_breakdown(RECORDS, ["vanilla", "m"]))
    van = next(line for line in table.splitlines() if line.startswith("| vanilla"))
    assert "| 2.0 | 5.0% | 0.0% | 45.0% | 10.0% |" in van  # 0.1 / 2.0 prefill, 0.9 / 2.0 verify


def test_rounds_prediction_prices_the_rounds_that_ran():
    from framework import LayerPlan
    from framework.engine.cost_model import CostModel
    from framework.results.metrics import rounds_prediction

    n = 4
    cost = CostModel(n, 0.1, 0.125, 0.1, tuple(1.0 + 0.1 * t for t in range(16)))
    plan = LayerPlan.from_indices(n, attn=[1, 2], mlp=[1, 2])  # a draft step of 0.55
    code = plan.code()
    turn = {"draft_lengths": [0, 2, 3], "accept_lengths": [1, 3, 2], "plans": [code, code]}
    chain = dict(turn, draft_forwards=5, verify_tokens=1 + 3 + 4)
    # plain: 6 committed tokens = 6 steps; spent: a plain round, then 2 and 3 drafts + chains
    want = 6.0 / (1.0 + (2 * 0.55 + 1.2) + (3 * 0.55 + 1.3))
    assert rounds_prediction(cost, [{"turns": [chain]}]) == pytest.approx(want)
    # copied tokens (no draft forwards) cost only their verification
    copy = dict(chain, draft_forwards=0)
    assert rounds_prediction(cost, [{"turns": [copy]}]) == pytest.approx(6.0 / (1.0 + 1.2 + 1.3))
    # a token tree: 3.2 verified tokens per drafted one (16 nodes for 5 drafted)
    tree = dict(chain, verify_tokens=3 + 16)
    spent = 1.0 + 2 * 0.55 + cost.verify_at(1 + 2 * 3.2) + 3 * 0.55 + cost.verify_at(1 + 3 * 3.2)
    assert rounds_prediction(cost, [{"turns": [tree]}]) == pytest.approx(6.0 / spent)
    # records without the counters (older files): one forward per token, chains
    assert rounds_prediction(cost, [{"turns": [turn]}]) == pytest.approx(want)
    # turns and records pool; nothing to price: None
    assert rounds_prediction(cost, [{"turns": [chain]}, {"turns": [chain]}]) == pytest.approx(want)
    assert rounds_prediction(cost, [{"turns": [{"draft_lengths": [], "accept_lengths": []}]}]) is None


def test_cost_model_prediction_at_a_measured_alpha():
    from framework.results.metrics import cost_model_prediction
    from framework.testing import synthetic_cost_model

    cost = synthetic_cost_model(10)
    pred = cost_model_prediction(cost, 2 / 3, 0.2)
    # 4 of 20 sub-layers skipped: a draft step costs 0.1 + 0.5 * 8/10 + 0.4 * 8/10 = 0.82 steps
    assert pred["ceiling"] == pytest.approx(1.0) and pred["ceiling_k"] == 0
    assert pred["drafting_k"] == 1 and pred["drafting"] == pytest.approx((1 + 2 / 3) / (0.82 + 1.1))
    assert cost_model_prediction(cost, 1.3, 0.2)["alpha"] == 1.0  # a tree can "accept" more than drafted
    # A drafter without forwards (prompt lookup) drafts for free: only verification is paid.
    free = cost_model_prediction(cost, 2 / 3, 0.2, forwards_per_token=0.0)
    assert free["drafting_k"] == 1 or free["ceiling"] > 1.0
    assert free["drafting"] == pytest.approx(
        max((1 - (2 / 3) ** (k + 1)) / (1 - 2 / 3) / cost.verify(k + 1) * cost.step for k in range(1, 17))
    )
    half = cost_model_prediction(cost, 2 / 3, 0.2, forwards_per_token=0.5)
    assert half["drafting"] == pytest.approx((1 + 2 / 3) / (0.41 + 1.1))


def test_rounds_prediction_prices_each_round_at_its_own_context():
    """With ``prompt_tokens`` in the turn, round i is priced at the prompt plus the tokens committed
    before it (`CostModel.at_context`); plain decoding of those tokens too."""
    from framework import LayerPlan
    from framework.engine.cost_model import CostModel
    from framework.results.metrics import rounds_prediction

    n = 4
    near = tuple(1.0 + 0.1 * t for t in range(16))
    cost = CostModel(
        n, 0.1, 0.125, 0.1, near, context=128, far_context=1152,
        far_attn=0.25, far_verify_costs=tuple(2 * c for c in near),
    )  # fmt: skip
    code = LayerPlan.from_indices(n, attn=[1, 2], mlp=[1, 2]).code()
    turn = {"draft_lengths": [0, 2], "accept_lengths": [1, 3], "plans": [code], "prompt_tokens": 640}
    plan = LayerPlan.from_code(code)
    first, second = cost.at_context(640), cost.at_context(641)
    want = (1 * first.step + 3 * second.step) / (first.step + second.round_time(2, plan))
    assert rounds_prediction(cost, [{"turns": [turn]}]) == pytest.approx(want)
    # at 640 tokens (half-way) a step costs 1.5 of the near one, attention 0.1875
    assert first.step == pytest.approx(1.5) and first.attn == pytest.approx(0.1875)
    # without the prompt's length: every round at the near context, as before
    plain = dict(turn, prompt_tokens=0)
    want_near = 4.0 / (1.0 + cost.round_time(2, plan))
    assert rounds_prediction(cost, [{"turns": [plain]}]) == pytest.approx(want_near)


def test_a_gate_that_declined_most_rounds_is_said_and_alpha_reads_na_without_drafts():
    """Issue 48, item 5: the report's table gives the share of rounds a gate declined; its alpha
    reads n/a where nothing was drafted (not 0.000)."""
    from framework.benchmark.report import results_markdown

    def rec(method, declined, drafted):
        gate = {"rounds": 100, "declined": declined}
        return {
            "question_id": 1, "category": "qa", "subcategory": "qa", "method": method, "new_tokens": 10,
            "wall_time": 1.0, "tokens_per_s": 10.0, "accept_lengths": [1] * 10, "drafted": drafted,
            "accepted": 0, "timings": {}, "lossless": True, "first_mismatch": None,
            "turns": [{"strategy_summary": {"length": {"gate": gate}}, "accept_lengths": [1] * 10}],
        }  # fmt: skip

    base = rec("vanilla", 0, 0)
    base["turns"] = [{"accept_lengths": [1] * 10}]
    summary = _summary([base, rec("m", 95, 0)])
    assert summary["methods"]["m"]["gate"] == {"rounds": 100, "declined": 95}
    table = plain_table(results_markdown(summary))
    head = next(line for line in table.splitlines() if line.startswith("| method"))
    row = next(line for line in table.splitlines() if line.startswith("| m "))
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in row.split("|")], strict=True))
    assert cells["alpha"] == "n/a" and cells["gate declined"] == "95.0%"


def test_speedup_is_the_ratio_of_the_mean_tokens_per_second():
    """Issue 56: every table, tracker key and plot takes its speedup from `speedup`: the ratio of
    means (not the mean of per-prompt ratios), NaN without a baseline rate."""
    assert speedup([30.0, 10.0], [10.0, 10.0]) == pytest.approx(2.0)  # a mean of ratios: 2.0 too
    assert speedup([30.0, 10.0], [20.0, 5.0]) == pytest.approx(20.0 / 12.5)  # ratios' mean: 1.75
    assert speedup([12.0], [4.0]) == pytest.approx(3.0)
    for baseline in ([], [0.0], [0.0, 0.0]):
        assert speedup([5.0], baseline) != speedup([5.0], baseline)  # NaN
