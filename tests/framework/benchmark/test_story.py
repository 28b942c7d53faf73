"""The plain-language reading under the benchmark's table (framework/benchmark/story.py): each
sentence states what the numbers of the run say, and the arithmetic behind it is the cost model's."""

from __future__ import annotations

import pytest

from framework.benchmark.story import alpha_needed, method_sentence, what_happened
from framework.engine.cost_model import CostModel
from framework.results.metrics import cost_model_prediction, plan_for_skip_ratio

# 10 layers; a step = base 0.2 + 10 x (0.02 + 0.06) = 1.0 s, verification of T tokens 1 + 0.05 (T - 1).
COST = CostModel(10, 0.2, 0.02, 0.06, tuple(1.0 + 0.05 * t for t in range(16)))


def entry(speedup, *, alpha=None, m=1.0, drafted=0, skip=None, gate=None, fpt=1.0, mismatches=0, cost=None):
    e = {
        "speedup": {"overall": speedup},
        "alpha": alpha,
        "M": m,
        "drafted": drafted,
        "skip_ratio": skip,
        "gate": gate,
        "forwards_per_draft_token": fpt,
        "mismatches": mismatches,
        "prompts": 7,
        "cost_model": None,
    }
    if cost is not None and alpha is not None:
        e["cost_model"] = cost_model_prediction(cost, alpha, skip or 0.0, fpt)
    return e


def test_the_cost_model_is_consistent_with_the_step():
    assert COST.step == pytest.approx(1.0)
    draft = COST.draft_step(plan_for_skip_ratio(10, 0.2))
    assert draft == pytest.approx(0.2 + 0.02 * 8 + 0.06 * 8)  # 4 of 20 sub-layers skipped


def test_alpha_needed_is_the_break_even_of_the_cost_model():
    need = alpha_needed(COST, 0.2)
    assert need is not None
    plan = plan_for_skip_ratio(10, 0.2)
    best = lambda a: max(COST.expected_speedup(a, k, plan) for k in range(1, 17))  # noqa: E731
    assert best(need) >= 1.05 > best(need - 0.01)
    # A draft costing as much as a step can never pay.
    assert alpha_needed(CostModel(10, 1.0, 0.0, 0.0, (1.0,) * 16), 0.2) is None


def test_a_declining_gate_is_said_to_have_declined():
    s = method_sentence(
        "static_confidence",
        entry(0.98, alpha=0.6, drafted=10, skip=0.2, gate={"rounds": 100, "declined": 97}),
    )
    assert "declined to draft in 97% of the rounds" in s
    assert "0.98x: as fast as vanilla" in s


def test_an_ungated_row_gets_its_draft_cost_and_ceiling():
    e = entry(0.84, alpha=0.5, m=1.6, drafted=400, skip=0.2, cost=COST)
    s = method_sentence("static_confidence:raw", e, COST)
    assert "(the same method with its draft gate off)" in s
    assert "committed 1.60 tokens per verification, 50% of its draft tokens accepted" in s
    assert "0.84x: slower than vanilla" in s
    assert "A draft token cost 0.84 of a full step (0.20 of it before any layer ran" in s
    assert f"is {e['cost_model']['ceiling']:.2f}x" in s


def test_copied_drafts_are_not_priced_as_forwards():
    s = method_sentence(
        "hybrid", entry(1.38, alpha=0.4, m=1.6, drafted=300, skip=0.1, fpt=0.2, cost=COST), COST
    )
    assert "copied from the context" in s
    assert "1.38x: faster than vanilla" in s


def test_mismatches_are_never_hidden():
    s = method_sentence("x", entry(1.0, alpha=0.5, drafted=5, mismatches=2))
    assert "2 of 7 prompts differ from vanilla greedy decoding" in s


def test_the_verdict_names_the_fastest_and_what_layer_skipping_needs():
    methods = {
        "vanilla": entry(1.0),
        "static_confidence:raw": entry(0.84, alpha=0.5, m=1.6, drafted=400, skip=0.2, cost=COST),
        "hybrid": entry(1.38, alpha=0.4, m=1.6, drafted=300, skip=0.1, fpt=0.2, cost=COST),
    }
    text = what_happened({"methods": methods}, {k: COST for k in methods})
    assert "Fastest here: **hybrid** (1.38x)" in text
    need = alpha_needed(COST, 0.2)
    assert f"needs about {round(100 * need)}% acceptance to be 5% faster" in text
    assert "static_confidence:raw measured 50%" in text
    assert len(text.splitlines()) == 4  # the two methods (not the baseline), the fastest, the time
    slower = what_happened({"methods": {"vanilla": entry(1.0), "a": entry(0.9)}})
    assert "No method was measurably faster than vanilla here (best: a, 0.90x)" in slower


def test_enough_acceptance_but_slower_is_explained_by_the_rounds_it_ran():
    need = alpha_needed(COST, 0.2)
    e = entry(0.9, alpha=min(1.0, need + 0.05), m=2.2, drafted=400, skip=0.2, cost=COST)
    e["cost_model"]["rounds"] = 1.03
    text = what_happened({"methods": {"vanilla": entry(1.0), "raw": e}}, {"raw": COST, "vanilla": COST})
    assert "That is enough in the cost model's ideal" in text
    assert "the cost model predicts 1.03x, and it measured 0.90x" in text


def test_a_method_is_called_faster_only_when_its_measurement_says_so():
    """Issue 48, item 5: a method whose gate declined 90% of the rounds decoded like vanilla, so its
    1.06x is noise, not "faster"; with repeats, every repeat must clear the noise band."""
    declined = entry(1.06, alpha=0.6, drafted=10, skip=0.2, gate={"rounds": 100, "declined": 98})
    s = method_sentence("static_confidence", declined)
    assert "faster than vanilla" not in s and "1.06x: as fast as vanilla, within noise" in s
    text = what_happened({"methods": {"vanilla": entry(1.0), "static_confidence": declined}})
    assert "Fastest here" not in text and "No method was measurably faster" in text
    spread = entry(1.10, alpha=0.6, drafted=100, skip=0.2)
    spread["overall_by_repeat"] = [1.25, 0.98, 1.07]
    s = method_sentence("m", spread)
    assert "not told apart from vanilla (its repeats ran from 0.98x to 1.25x)" in s
    spread["overall_by_repeat"] = [1.08, 1.12, 1.10]
    assert "1.10x: faster than vanilla" in method_sentence("m", spread)
