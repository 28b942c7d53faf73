"""framework/search/bayesopt.py: GP-UCB over binary vectors (free and fixed cardinality)."""

from __future__ import annotations

import pytest

from framework.search.bayesopt import BinaryBayesOpt

DIM = 12
TARGET = (0, 1, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0)  # 4 ones, none at the pinned ends


def objective(x) -> float:
    return -float(sum(a != b for a, b in zip(x, TARGET, strict=True)))


@pytest.mark.parametrize("cardinality", [None, 4])
def test_finds_the_optimum_of_a_separable_objective(cardinality):
    bo = BinaryBayesOpt(DIM, pinned=[0, DIM - 1], cardinality=cardinality, kappa=1.0, seed=3)
    for _ in range(4):
        x = bo.random_point()
        bo.observe(x, objective(x))
    for _ in range(18):
        x = bo.suggest()
        bo.observe(x, objective(x))
    assert bo.best() == (TARGET, 0.0)
    assert bo.num_fits == 18 and bo.fit_seconds > 0


@pytest.mark.parametrize("cardinality", [None, 3])
def test_proposals_respect_pins_cardinality_and_avoid_observed_points(cardinality):
    bo = BinaryBayesOpt(DIM, pinned=[0, 5], cardinality=cardinality, seed=0)
    seen = set()
    for i in range(12):
        x = bo.random_point() if i < 3 else bo.suggest()
        assert x[0] == 0 and x[5] == 0
        if cardinality is not None:
            assert sum(x) == cardinality
        assert x not in seen, "an evaluated point was proposed again"
        seen.add(x)
        bo.observe(x, float(sum(x[1:4])) - 0.1 * i)


def test_no_gp_before_two_distinct_values():
    bo = BinaryBayesOpt(6, seed=0)
    x = bo.suggest()  # nothing observed: random
    bo.observe(x, 1.0)
    bo.observe(bo.random_point(), 1.0)
    bo.suggest()
    assert bo.num_fits == 0
    bo.observe(bo.random_point(), 2.0)
    bo.suggest()
    assert bo.num_fits == 1


def test_bad_input():
    with pytest.raises(ValueError, match="cardinality"):
        BinaryBayesOpt(4, cardinality=4)
    with pytest.raises(ValueError, match="pinned"):
        BinaryBayesOpt(4, pinned=[7])
    bo = BinaryBayesOpt(4)
    with pytest.raises(ValueError, match="4 coordinates"):
        bo.observe((1, 0), 1.0)
    with pytest.raises(ValueError, match="finite"):
        bo.observe((1, 0, 0, 0), float("nan"))
    with pytest.raises(ValueError, match="no observations"):
        bo.best()
