"""framework/sweep/bayes.py: local Bayesian sweeps - the encoding of each distribution, and GP
proposals that beat random ones in the same budget on an objective with structure (issue 29; a
proposer that fell back to random draws would fail it)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from framework.sweep.bayes import BayesProposer, encode
from framework.sweep.spec import Param, Sweep


def test_each_distribution_is_encoded_into_the_unit_cube():
    assert encode(Param("x", "uniform", min=0.0, max=2.0), 0.5) == [0.25]
    assert encode(Param("k", "int_uniform", min=1, max=5), 5) == [1.0]
    assert encode(Param("lr", "log_uniform_values", min=1e-4, max=1e-2), 1e-3) == pytest.approx([0.5])
    assert encode(Param("lr", "log_uniform", min=math.log(1e-4), max=math.log(1e-2)), 1e-3) == pytest.approx(
        [0.5]
    )
    assert encode(Param("n", "normal", mu=1.0, sigma=2.0), 1.0) == [0.5]
    assert encode(Param("v", "categorical", values=("a", "b", "c")), "b") == [0.0, 1.0, 0.0]


def _sweep(goal: str = "maximize") -> Sweep:
    params = {
        "x": Param("x", "uniform", min=0.0, max=1.0),
        "lr": Param("lr", "log_uniform_values", min=1e-4, max=1.0),
        "arm": Param("arm", "categorical", values=("a", "b", "c", "d")),
        "fixed": Param("fixed", "constant", values=(7,)),
    }
    return Sweep(Path("synthetic.yaml"), "bayes", "score", goal, params, "synthetic", "p")


def _score(p: dict) -> float:
    """Peak at x = 0.7, lr = 1e-2, arm 'c'."""
    return -((p["x"] - 0.7) ** 2) - 0.25 * (math.log10(p["lr"]) + 2) ** 2 - (0.0 if p["arm"] == "c" else 0.5)


def _best(proposer: BayesProposer, budget: int, use_gp: bool, sign: float = 1.0) -> float:
    history: list[tuple[dict, float]] = []
    for _ in range(budget):
        p = proposer.propose(history) if use_gp else proposer.draw()
        assert p["fixed"] == 7
        history.append((p, sign * _score(p)))
    return max(_score(p) for p, _ in history)


@pytest.mark.parametrize("goal", ["maximize", "minimize"])
def test_gp_proposals_beat_random_ones_in_the_same_budget(goal):
    sign = 1.0 if goal == "maximize" else -1.0  # minimising -score is maximising score
    gp, rnd = [], []
    for seed in range(5):
        gp.append(_best(BayesProposer(_sweep(goal), seed=seed, candidates=256), 16, True, sign))
        rnd.append(_best(BayesProposer(_sweep(goal), seed=seed, candidates=256), 16, False, sign))
    regret_gp, regret_rnd = -statistics.mean(gp), -statistics.mean(rnd)
    assert regret_gp < 0.5 * regret_rnd, (regret_gp, regret_rnd)


def test_the_first_trials_are_random_and_failed_trials_are_left_out():
    prop = BayesProposer(_sweep(), seed=1, n_init=3, candidates=64)
    history: list = []
    for _ in range(3):
        history.append((prop.propose(history), 0.0))
        assert prop.last_source == "random"
    history.append((prop.draw(), None))  # a failed trial: no metric
    prop.propose(history)
    assert prop.last_source == "gp"
    with pytest.raises(ValueError, match="n_init must be >= 2"):
        BayesProposer(_sweep(), n_init=1)
