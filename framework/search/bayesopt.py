"""Gaussian-process Bayesian optimisation over binary vectors (BoTorch / GPyTorch).

Both BO-based selectors search skip sets, i.e. points of ``{0, 1}^d``:

- ``selfsd_bo`` (Draft & Verify): free cardinality, a few coordinates pinned to 0;
- ``swift`` (SWIFT): exactly ``n`` ones among the free coordinates (the skip ratio r).

`BinaryBayesOpt` keeps the observations, fits a `botorch.models.SingleTaskGP` with a Matern-5/2
kernel (isotropic, as the seed papers' ``bayes_opt`` default) on standardised objective values with
a fixed observation noise (``bayes_opt``'s ``alpha = 1e-2``), and maximises the upper confidence bound
``mean + kappa * std`` over the *discrete* space: BoTorch's discrete local search for free
cardinality, a swap local search (one coordinate in, one out, so the cardinality stays fixed) from
random starts for fixed cardinality. Points already evaluated are avoided.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence

import torch

from framework.utils import require


class BinaryBayesOpt:
    """GP-UCB maximisation of a black-box objective over ``{0, 1}^dim``.

    Args:
        dim: number of binary coordinates.
        pinned: coordinates that are always 0 (e.g. never-skipped blocks).
        cardinality: ``None`` (any number of ones) or exactly this many ones among the free
            coordinates.
        kappa: exploration weight of UCB (``mean + kappa * std``; BoTorch's ``beta = kappa**2``).
        noise: observation noise variance on the standardised objective.
        seed: seeds random starts and random proposals.
        raw_samples: random points scored to pick the local-search starts.
        num_restarts: local searches run per suggestion.
    """

    def __init__(
        self,
        dim: int,
        *,
        pinned: Sequence[int] = (),
        cardinality: int | None = None,
        kappa: float = 2.576,
        noise: float = 1e-2,
        seed: int = 0,
        raw_samples: int = 1024,
        num_restarts: int = 4,
    ) -> None:
        self.dim = dim
        self.pinned = sorted(set(pinned))
        if any(not 0 <= i < dim for i in self.pinned):
            raise ValueError(f"pinned coordinates must be in [0, {dim}), got {self.pinned}")
        self.free = [i for i in range(dim) if i not in set(self.pinned)]
        if cardinality is not None and not 0 < cardinality < len(self.free):
            raise ValueError(
                f"cardinality must be in [1, {len(self.free) - 1}] for {len(self.free)} free coordinates, "
                f"got {cardinality}"
            )
        self.cardinality = cardinality
        self.kappa, self.noise = kappa, noise
        self.raw_samples, self.num_restarts = raw_samples, num_restarts
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.X: list[tuple[int, ...]] = []
        self.Y: list[float] = []
        #: GP fits done and the seconds they and the acquisition search took.
        self.num_fits = 0
        self.fit_seconds = 0.0

    # ---- data ------------------------------------------------------------------------------
    def observe(self, x: Sequence[int], y: float) -> None:
        """Register the objective value ``y`` (higher is better) of point ``x``."""
        x = tuple(int(b) for b in x)
        if len(x) != self.dim:
            raise ValueError(f"a point has {self.dim} coordinates, got {len(x)}")
        if not math.isfinite(y):
            raise ValueError(f"objective values must be finite, got {y}")
        self.X.append(x)
        self.Y.append(float(y))

    def best(self) -> tuple[tuple[int, ...], float]:
        """The best observed point and its value."""
        if not self.Y:
            raise ValueError("no observations yet")
        i = max(range(len(self.Y)), key=self.Y.__getitem__)
        return self.X[i], self.Y[i]

    # ---- proposals -----------------------------------------------------------------------------
    def random_point(self) -> tuple[int, ...]:
        """A uniform random point of the search space (of the fixed cardinality, if any)."""
        return tuple(int(v) for v in self._random(1)[0])

    def suggest(self) -> tuple[int, ...]:
        """The UCB maximiser among unobserved points (a random point while fewer than two
        distinct observations exist: a GP needs something to standardise)."""
        if len(set(self.Y)) < 2:
            return self._unobserved_random()
        t = time.perf_counter()
        try:
            # Callers decode under inference mode; fitting the GP needs autograd. BoTorch draws
            # its random starts from the global RNG: seed it (and restore it afterwards) so that
            # the same observations always give the same proposal.
            with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng():
                torch.manual_seed(self.seed * 100_003 + self.num_fits)
                acq = self._acquisition()
                x = self._maximise(acq)
        finally:
            self.num_fits += 1
            self.fit_seconds += time.perf_counter() - t
        return tuple(int(v) for v in x)

    # ---- internals ---------------------------------------------------------------------------
    def _random(self, n: int) -> torch.Tensor:
        out = torch.zeros(n, self.dim, dtype=torch.float64)
        free = torch.tensor(self.free)
        if self.cardinality is None:
            out[:, free] = torch.randint(0, 2, (n, len(self.free)), generator=self.generator).double()
        else:
            keys = torch.rand(n, len(self.free), generator=self.generator)
            top = keys.topk(self.cardinality, dim=1).indices
            rows = torch.zeros(n, len(self.free), dtype=torch.float64)
            rows.scatter_(1, top, 1.0)
            out[:, free] = rows
        return out

    def _unobserved_random(self) -> tuple[int, ...]:
        seen = set(self.X)
        for _ in range(100):
            x = self.random_point()
            if x not in seen:
                return x
        return self.random_point()

    def _acquisition(self):
        botorch = require("botorch")
        gpytorch = require("gpytorch")
        from botorch.acquisition import UpperConfidenceBound
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import SingleTaskGP
        from gpytorch.kernels import MaternKernel, ScaleKernel
        from gpytorch.mlls import ExactMarginalLogLikelihood

        X = torch.tensor(self.X, dtype=torch.float64)
        y = torch.tensor(self.Y, dtype=torch.float64)
        y = ((y - y.mean()) / y.std().clamp_min(1e-12)).unsqueeze(-1)
        gp = SingleTaskGP(
            X,
            y,
            train_Yvar=torch.full_like(y, self.noise),
            covar_module=ScaleKernel(MaternKernel(nu=2.5)),
            outcome_transform=None,
        )
        mll = ExactMarginalLogLikelihood(gp.likelihood, gp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optimiser chatter; a failed fit keeps the prior
            try:
                fit_gpytorch_mll(mll)
            except (botorch.exceptions.errors.ModelFittingError, gpytorch.utils.errors.NotPSDError):
                pass
        gp.eval()
        return UpperConfidenceBound(gp, beta=self.kappa**2)

    @torch.no_grad()
    def _score(self, acq, X: torch.Tensor) -> torch.Tensor:
        """UCB of many single points at once: one batched posterior (``acq`` on an ``(N, 1, d)``
        batch computes the same values about ten times slower)."""
        out = []
        for chunk in X.split(4096):
            post = acq.model.posterior(chunk)
            out.append(post.mean.squeeze(-1) + self.kappa * post.variance.clamp_min(0).sqrt().squeeze(-1))
        return torch.cat(out)

    def _maximise(self, acq) -> torch.Tensor:
        seen = torch.tensor(self.X, dtype=torch.float64)
        if self.cardinality is None:
            from botorch.optim import optimize_acqf_discrete_local_search

            choices = [
                torch.tensor([0.0], dtype=torch.float64)
                if i in set(self.pinned)
                else torch.tensor([0.0, 1.0], dtype=torch.float64)
                for i in range(self.dim)
            ]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                x, _ = optimize_acqf_discrete_local_search(
                    acq,
                    discrete_choices=choices,
                    q=1,
                    num_restarts=self.num_restarts,
                    raw_samples=self.raw_samples,
                    X_avoid=seen,
                )
            return x[0]
        return self._swap_search(acq, seen)

    def _swap_search(self, acq, seen: torch.Tensor) -> torch.Tensor:
        """Best-improvement local search over swaps, from the best random and observed points."""
        seen_set = {tuple(r) for r in seen.long().tolist()}
        starts = torch.cat([self._random(self.raw_samples), seen])
        scores = self._score(acq, starts)
        best_x, best_v = None, -math.inf

        def consider(X: torch.Tensor, v: torch.Tensor) -> None:
            nonlocal best_x, best_v
            for i in v.argsort(descending=True).tolist():
                if float(v[i]) <= best_v:
                    return
                if tuple(X[i].long().tolist()) not in seen_set:
                    best_x, best_v = X[i].clone(), float(v[i])
                    return

        consider(starts, scores)
        free = torch.tensor(self.free)
        for i in scores.argsort(descending=True)[: self.num_restarts].tolist():
            x, v = starts[i].clone(), float(scores[i])
            for _ in range(self.dim):  # a swap path is never longer than the cardinality
                ones = free[x[free] > 0.5]
                zeros = free[x[free] < 0.5]
                nb = x.repeat(len(ones) * len(zeros), 1)
                rows = torch.arange(nb.shape[0])
                nb[rows, ones.repeat_interleave(len(zeros))] = 0.0
                nb[rows, zeros.repeat(len(ones))] = 1.0
                nv = self._score(acq, nb)
                consider(nb, nv)
                j = int(nv.argmax())
                if float(nv[j]) <= v:
                    break
                x, v = nb[j], float(nv[j])
        if best_x is None:  # every point scored was observed already
            return torch.tensor(self._unobserved_random(), dtype=torch.float64)
        return best_x
