"""``method: bayes`` run locally: each trial after the first few is proposed by a Gaussian process
fitted to the trials so far (BoTorch), as W&B's own Bayesian search does on its server.

How a trial is proposed (`BayesProposer.propose`):

1. the first ``n_init`` trials are random draws from the sweep's distributions (as ``random``);
2. then every swept parameter is encoded into ``[0, 1]`` (a numeric range linearly, a
   ``log_uniform*`` range on the log scale, a normal by its CDF, a list of values one-hot), a
   `botorch.models.SingleTaskGP` is fitted to the finished trials' metric (negated for
   ``goal: minimize``; failed trials are left out), and of ``candidates`` fresh random draws
   the one with the largest log expected improvement (`botorch.acquisition.LogExpectedImprovement`)
   over the best metric so far is the next trial. Candidates already run are skipped.

Scoring random draws (rather than optimising the acquisition continuously) keeps every proposal a
value the sweep file allows (quantised steps, integer ranges, lists of values) with no rounding
step; with a few hundred trials at most, 1024 candidates cover a handful of swept parameters well.
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import torch

from framework.sweep.spec import Param, Sweep
from framework.utils import require

#: Random trials before the GP proposes.
DEFAULT_INIT = 4
#: Random draws scored by the acquisition per proposal.
DEFAULT_CANDIDATES = 1024


def encode(p: Param, value: Any) -> list[float]:
    """``value`` of parameter ``p`` as coordinates in ``[0, 1]`` (one per value for a list)."""
    d = p.distribution
    if d in ("categorical", "constant"):
        return [1.0 if value == v else 0.0 for v in p.values]
    if d == "log_uniform":  # min and max are natural-log exponents
        lo, hi, x = p.min, p.max, math.log(value)
    elif d in ("log_uniform_values", "q_log_uniform_values"):
        lo, hi, x = math.log(p.min), math.log(p.max), math.log(value)
    elif d in ("normal", "q_normal"):
        return [0.5 * (1.0 + math.erf((value - p.mu) / (p.sigma * math.sqrt(2.0))))]
    else:  # uniform, q_uniform, int_uniform
        lo, hi, x = p.min, p.max, float(value)
    return [0.0 if hi == lo else min(1.0, max(0.0, (x - lo) / (hi - lo)))]


class BayesProposer:
    """Proposes the trials of a ``bayes`` sweep one at a time (see the module docstring).

    Args:
        sweep: the sweep (its swept parameters and metric goal).
        seed: seeds the random draws.
        n_init: random trials before the GP proposes (>= 2).
        candidates: random draws scored per proposal.
    """

    def __init__(
        self, sweep: Sweep, seed: int = 0, n_init: int = DEFAULT_INIT, candidates: int = DEFAULT_CANDIDATES
    ) -> None:
        if n_init < 2:
            raise ValueError(f"n_init must be >= 2 (a GP needs two points), got {n_init}")
        self.sweep = sweep
        self.rng = random.Random(seed)
        self.n_init = n_init
        self.candidates = candidates
        self.last_source = "random"  # how the last proposal was made: "random" or "gp"

    def draw(self) -> dict[str, Any]:
        """One random trial (the sweep's distributions)."""
        return {name: p.sample(self.rng) for name, p in self.sweep.params.items()}

    def vector(self, params: dict[str, Any]) -> list[float]:
        return [x for name in self.sweep.swept for x in encode(self.sweep.params[name], params[name])]

    def propose(self, history: list[tuple[dict[str, Any], float | None]]) -> dict[str, Any]:
        """The next trial, given ``(params, metric or None if it failed)`` of the trials so far."""
        done = [(p, v) for p, v in history if v is not None and math.isfinite(v)]
        if len(done) < self.n_init or not self.sweep.swept:
            self.last_source = "random"
            return self.draw()
        seen = {tuple(self.vector(p)) for p, _ in history}
        pool = [c for c in (self.draw() for _ in range(self.candidates)) if tuple(self.vector(c)) not in seen]
        if not pool:
            self.last_source = "random"
            return self.draw()
        scores = self.acquisition(done, pool)
        self.last_source = "gp"
        return pool[int(torch.argmax(scores))]

    def acquisition(
        self, done: list[tuple[dict[str, Any], float]], pool: list[dict[str, Any]]
    ) -> torch.Tensor:
        """Log expected improvement of each of ``pool`` under a GP fitted to ``done``."""
        require("botorch", "local Bayesian sweeps")
        from botorch.acquisition.analytic import LogExpectedImprovement
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import SingleTaskGP
        from botorch.models.transforms.outcome import Standardize
        from gpytorch.mlls import ExactMarginalLogLikelihood

        sign = 1.0 if self.sweep.goal == "maximize" else -1.0
        x = torch.tensor([self.vector(p) for p, _ in done], dtype=torch.float64)
        y = torch.tensor([[sign * v] for _, v in done], dtype=torch.float64)
        with warnings.catch_warnings():  # equal metrics (a flat start) are legitimate data here
            warnings.simplefilter("ignore")
            model = SingleTaskGP(x, y, outcome_transform=Standardize(m=1))
            try:
                fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
            except Exception:  # noqa: BLE001 - a failed fit keeps the prior hyper-parameters
                pass
        acq = LogExpectedImprovement(model, best_f=y.max())
        cand = torch.tensor([self.vector(p) for p in pool], dtype=torch.float64)
        with torch.no_grad():
            return acq(cand.unsqueeze(1))
