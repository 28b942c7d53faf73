"""Sweep files (framework/sweep/spec.py): parsing, grid and random expansion, and the shipped sweeps
(every trial of which validates as a run configuration)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

import framework.sweep as sweep

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = sorted((ROOT / "experiments" / "sweeps").glob("*.yaml"))


def test_grid_is_the_cartesian_product_in_file_order(write_sweep):
    path = write_sweep(
        {
            "method": "grid",
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {
                "limit": {"value": 1},
                "selector.skip_ratio": {"values": [0.1, 0.2, 0.3]},
                "length.threshold": {"values": [0.6, 0.7]},
                "length.max_length": {"distribution": "int_uniform", "min": 4, "max": 5},
            },
        },
    )
    s = sweep.load_sweep(path)
    trials = sweep.expand_trials(s)
    assert len(trials) == 3 * 2 * 2
    assert trials[0] == {
        "limit": 1,
        "selector.skip_ratio": 0.1,
        "length.threshold": 0.6,
        "length.max_length": 4,
    }
    assert trials[1]["length.max_length"] == 5 and trials[2]["length.threshold"] == 0.7
    assert [t["selector.skip_ratio"] for t in trials] == [0.1] * 4 + [0.2] * 4 + [0.3] * 4
    assert s.swept == ["selector.skip_ratio", "length.threshold", "length.max_length"]
    assert s.constants == {"limit": 1}
    assert sweep.expand_trials(s, count=5) == trials[:5]
    q = sweep.parse_param("x", {"distribution": "q_uniform", "min": 0.3, "max": 0.6, "q": 0.05})
    assert q.grid_values() == [0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6]


def test_random_sampling_respects_ranges_and_is_seeded(write_sweep):
    path = write_sweep(
        {
            "method": "random",
            "run_cap": 7,
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {
                "method": {"value": "swift"},
                "selector.skip_ratio": {"min": 0.3, "max": 0.6},
                "selector.bo_interval": {"values": [5, 10, 25, 50]},
                "selector.patience": {"min": 10, "max": 20},
                "length.threshold": {"distribution": "q_uniform", "min": 0.5, "max": 0.9, "q": 0.1},
                "selector.kappa": {"distribution": "log_uniform_values", "min": 0.1, "max": 10.0},
                "length.max_length": {"values": [8, 25], "probabilities": [0.9, 0.1]},
            },
        },
    )
    s = sweep.load_sweep(path)
    assert len(sweep.expand_trials(s)) == 7  # run_cap
    trials = sweep.expand_trials(s, count=300, seed=3)
    assert trials == sweep.expand_trials(s, count=300, seed=3)
    assert trials != sweep.expand_trials(s, count=300, seed=4)
    for t in trials:
        assert t["method"] == "swift"
        assert 0.3 <= t["selector.skip_ratio"] <= 0.6
        assert t["selector.bo_interval"] in (5, 10, 25, 50)
        assert isinstance(t["selector.patience"], int) and 10 <= t["selector.patience"] <= 20
        assert t["length.threshold"] in (0.5, 0.6, 0.7, 0.8, 0.9)
        assert 0.1 <= t["selector.kappa"] <= 10.0
    assert {t["selector.patience"] for t in trials} == set(range(10, 21))
    kappas = sorted(math.log10(t["selector.kappa"]) for t in trials)
    assert kappas[len(kappas) // 2] == pytest.approx(0.0, abs=0.25)  # log-uniform: median near 1
    assert 0.8 < sum(t["length.max_length"] == 8 for t in trials) / len(trials) < 0.97
    sweep.validate_trials(s, trials[:20])  # every draw is a valid configuration


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_sweep_files_are_valid(path):
    """Each parses, every parameter is a run option or a field of the chosen strategy's config,
    every trial validates (no model is loaded), and the agent command calls --trial."""
    s = sweep.load_sweep(path)
    assert (s.metric, s.goal) == ("speedup", "maximize")
    trials = sweep.expand_trials(s)
    configs = sweep.validate_trials(s, trials)
    assert len(configs) == len(trials) >= 4
    raw = yaml.safe_load(path.read_text())
    assert raw["program"] == "experiments/sweep.py" and (ROOT / raw["program"]).is_file()
    assert raw["command"] == ["${env}", "${interpreter}", "${program}", "--trial"]
    assert len(s.swept) == 2, "two hyper-parameters per shipped sweep"


def test_shipped_sweeps_sweep_the_published_knobs():
    names = {p.stem: set(sweep.load_sweep(p).swept) for p in SHIPPED}
    assert names["static"] == names["static_bayes"] == {"selector.skip_ratio", "length.threshold"}
    assert sweep.load_sweep(ROOT / "experiments" / "sweeps" / "static_bayes.yaml").method == "bayes"
    assert names["swift"] == {"selector.skip_ratio", "selector.bo_interval"}
    assert names["clasp"] == {"selector.num_skip", "selector.interval"}
