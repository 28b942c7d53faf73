"""The Bayesian optimisation of SWIFT and Self-SD is really used (issue 31): on a synthetic
objective with structure - each sub-layer's skip adds a fixed, known amount - the selectors'
GP-proposed candidates are the ones scored, and in the same budget they find better sets than the
same search with its GP proposals replaced by random ones (the mutation that survived every test
before). The objective replaces only the scoring (matchness / calibration decoding); the search
loops, the GP and its acquisition are the selectors' own."""

from __future__ import annotations

import statistics

import pytest
import torch

import strategies.selectors.selfsd_bo as selfsd_bo
from framework.engine.adapter import adapter_for
from framework.search.bayesopt import BinaryBayesOpt
from framework.testing import prepare_context, tiny_model
from framework.types import LayerPlan, ModelInfo
from strategies.selectors.selfsd_bo import SelfSDConfig
from strategies.selectors.swift import SwiftConfig, SwiftSelector

N_LAYERS = 10


def _values(dim: int, seed: int) -> torch.Tensor:
    """What skipping each of ``dim`` sub-layers is worth: most a little negative, a few positive
    (the structure a search should find)."""
    g = torch.Generator().manual_seed(1000 + seed)
    v = -torch.rand(dim, generator=g)
    v[torch.randperm(dim, generator=g)[: dim // 3]] *= -1.5
    return v


def _random_suggest(monkeypatch):
    """The mutation: BO's proposal replaced by a random admissible point."""
    monkeypatch.setattr(BinaryBayesOpt, "suggest", lambda self: self.random_point())


# ---- SWIFT -----------------------------------------------------------------------------------
def _swift_best(seed: int, steps: int) -> tuple[float, list, list]:
    sel = SwiftSelector(
        SwiftConfig(seed=seed, bo_interval=1, patience=10_000, max_opt_steps=10_000, matchness_stop=1.0)
    )
    sel.setup(
        ModelInfo(num_layers=N_LAYERS, hidden_size=64, vocab_size=128, max_context=512, name="synthetic")
    )
    values = _values(2 * N_LAYERS, seed)
    lo, hi = float(values.clamp(max=0).sum()), float(values.clamp(min=0).sum())

    def matchness(state, plan: LayerPlan) -> float:  # in [0, 1]: higher where the set is better
        return (float(values[torch.tensor(plan.to_bits(), dtype=torch.bool)].sum()) - lo) / (hi - lo)

    sel.matchness = matchness
    suggested, observed = [], []
    real_suggest, real_observe = sel.bo.suggest, sel.bo.observe
    sel.bo.suggest = lambda: suggested.append(real_suggest()) or suggested[-1]
    sel.bo.observe = lambda x, y: observed.append(tuple(x)) or real_observe(x, y)
    for _ in range(steps):
        sel._step(None)
    return sel.best, suggested, observed


def test_swift_scores_the_gp_proposals():
    best, suggested, observed = _swift_best(seed=0, steps=12)
    assert len(suggested) >= 8  # every step from the third on is a BO step (bo_interval 1)
    assert all(tuple(x) in observed for x in suggested)  # each proposal is the candidate scored
    assert observed[-len(suggested) :] == [tuple(x) for x in suggested]


@pytest.mark.slow  # a statistical check over many decodes (CI runs it)
def test_swift_gp_proposals_beat_random_ones_in_the_same_budget(monkeypatch):
    bo = statistics.mean(_swift_best(seed, 16)[0] for seed in range(4))
    _random_suggest(monkeypatch)
    rnd = statistics.mean(_swift_best(seed, 16)[0] for seed in range(4))
    assert bo > rnd + 0.03, (bo, rnd)


# ---- Self-SD ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter():
    return adapter_for(tiny_model("llama", num_layers=N_LAYERS, seed=4))


def _selfsd_best(ctx, seed: int, iterations: int, monkeypatch) -> tuple[float, list[dict], list]:
    values = _values(2 * N_LAYERS, seed)

    def evaluate(ctx, c, plan, prompts, cost):
        s = float(values[torch.tensor(plan.to_bits(), dtype=torch.bool)].sum())
        return {"tokens_per_s_model": s, "tokens_per_s_wall": s, "alpha": 0.5, "M": 1.5}

    monkeypatch.setattr(selfsd_bo, "evaluate_plan", evaluate)
    monkeypatch.setattr(
        selfsd_bo, "_calibration_prompts", lambda ctx, c: [torch.zeros(1, 4, dtype=torch.long)]
    )
    suggested: list = []
    real = BinaryBayesOpt.suggest

    def spy(self):
        suggested.append(list(real(self)))
        return suggested[-1]

    monkeypatch.setattr(BinaryBayesOpt, "suggest", spy)
    result = selfsd_bo.search(ctx, SelfSDConfig(iterations=iterations, seed=seed))
    return result.objective, result.data["trace"], suggested


def test_selfsd_scores_the_gp_proposals(adapter, monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    _, trace, suggested = _selfsd_best(prepare_context(adapter), 0, 10, monkeypatch)
    gp_rows = [r for r in trace if r["source"] == "gp"]
    assert len(gp_rows) == 8 and [r["bits"] for r in gp_rows] == suggested  # 2 probes, then the GP


@pytest.mark.slow  # a statistical check over many decodes (CI runs it)
def test_selfsd_gp_proposals_beat_random_ones_in_the_same_budget(adapter, monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    ctx = prepare_context(adapter)
    bo = statistics.mean(_selfsd_best(ctx, seed, 16, monkeypatch)[0] for seed in range(4))
    monkeypatch.setattr(BinaryBayesOpt, "suggest", lambda self: list(self.random_point()))
    monkeypatch.setattr(selfsd_bo, "BinaryBayesOpt", BinaryBayesOpt)
    rnd_best = []
    for seed in range(4):
        values = _values(2 * N_LAYERS, seed)
        monkeypatch.setattr(
            selfsd_bo,
            "evaluate_plan",
            lambda ctx, c, plan, prompts, cost, values=values: (
                dict.fromkeys(
                    ("tokens_per_s_model", "tokens_per_s_wall"),
                    float(values[torch.tensor(plan.to_bits(), dtype=torch.bool)].sum()),
                )
                | {"alpha": 0.5, "M": 1.5}
            ),
        )
        rnd_best.append(selfsd_bo.search(ctx, SelfSDConfig(iterations=16, seed=seed)).objective)
    rnd = statistics.mean(rnd_best)
    assert bo > rnd + 0.3, (bo, rnd)
