"""``clasp_dp``: CLaSp's dynamic programme over layers, re-run on the verified context every few rounds."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import torch

from framework import (
    DeviceOps,
    Draft,
    LayerPlan,
    LayerSelector,
    ModelInfo,
    RoundView,
    Verification,
    register_selector,
)
from framework.config_fields import ConfigError, check_range, check_types, param
from framework.search.budget import BudgetedWork, budget_param, check_budget
from strategies.selectors.static import spread


@dataclass(frozen=True)
class ClaspDPConfig:
    num_skip: int | None = param(
        None, help="M, the number of decoder blocks the draft skips; in [1, L-1]. None: from skip_ratio"
    )
    skip_ratio: float = param(
        0.5,
        help="M = round(skip_ratio * L) when num_skip is None; in (0, 1). CLaSp skips 50-60% of the "
        "layers in its main experiments",
    )
    interval: int = param(
        8,
        help="layer-optimisation interval (LOI): re-run the DP every `interval` verification rounds "
        "(or tokens, see interval_unit); in [1, 100000]",
    )
    interval_unit: Literal["rounds", "tokens"] = param(
        "rounds", help="what the interval counts: verification rounds or committed tokens"
    )
    protect_first: int = param(0, help="never skip the first this many blocks; in [0, L-1]")
    protect_last: int = param(0, help="never skip the last this many blocks; in [0, L-1]")
    init: Literal["prompt", "uniform"] = param(
        "prompt",
        help="skip set of the first round: the DP on the last prompt token's prefill states, or M "
        "blocks spread uniformly",
    )
    dp_token: Literal["last_accepted", "previous"] = param(
        "last_accepted",
        help="whose hidden states the DP fits: the last accepted token's verify position (the one "
        "that produced the new token) or the position before it",
    )
    objective: Literal["max_cosine", "min_cosine"] = param(
        "max_cosine",
        help="keep the candidate most similar to the full model ('max_cosine', the DP of the paper) "
        "or least similar ('min_cosine': Eq. 1 as printed, a typo; for ablation only)",
    )
    sequence_parallel: bool = param(
        True,
        help="evaluate all candidate states of a layer in one block call sharing the KV cache "
        "(CLaSp's parallel strategy); false makes one call per candidate",
    )
    work_budget: float = budget_param(
        "a due DP re-run waits (the next round tries again; generations included)"
    )

    def __post_init__(self) -> None:
        check_types(self)
        if self.num_skip is not None:
            check_range("num_skip", self.num_skip, 1, None, integer=True)
        check_range("skip_ratio", self.skip_ratio, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("interval", self.interval, 1, 100000, integer=True)
        check_range("protect_first", self.protect_first, 0, None, integer=True)
        check_range("protect_last", self.protect_last, 0, None, integer=True)
        check_budget(self)

    def skip_count(self, num_layers: int) -> int:
        """M for a model of ``num_layers`` blocks."""
        return self.num_skip if self.num_skip is not None else round(self.skip_ratio * num_layers)


@dataclass(frozen=True)
class DPResult:
    """The outcome of one CLaSp DP.

    Attributes:
        skip: the M skipped blocks (0-based, sorted).
        cosine: cos(x_L, g(L, M)): how close the draft's last-layer state is to the full model's.
        block_calls: block forwards run (about L with sequence parallelism).
        evaluations: single-state block evaluations (states summed over the calls).
    """

    skip: tuple[int, ...]
    cosine: float
    block_calls: int
    evaluations: int


def _units(x: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` (n, d) divided by their norms (at least 1e-8), in float32 or wider: the
    cosine of two rows, as ``F.cosine_similarity`` computes it, is the dot product of their units."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-8)


@lru_cache(maxsize=64)
def _dp_tables(
    n_layers: int, m: int, protected: frozenset[int]
) -> tuple[list[tuple[int, int]], list[list[bool]], list[list[bool]], list[list[bool]]]:
    """Which DP states exist and how they can be reached, once per (L, M, protected) (callers must
    not modify the lists). Per layer i in 1..L (index i - 1):
        runs: ``(a, b)``, the contiguous rows j of layer i - 1 run through block i - 1
            (``b < a``: none);
        reach: ``reach[i][j]``, g(i, j) exists (index 0: the embedding's row 0 only);
        has_run: g(i, j) may come from running block i - 1 on g(i - 1, j);
        both: it may also come from skipping it (g(i - 1, j - 1) passed through): the cosines decide.
    """
    reach = [[True] + [False] * m]
    runs, has_run, both = [], [], []
    for i in range(1, n_layers + 1):
        b, prev = i - 1, reach[-1]
        lo = max(0, m - (n_layers - i))  # smaller j cannot reach (L, M)
        js = range(max(1, lo), min(i, m) + 1)
        run_js = [j for j in js if j <= i - 1 and prev[j]]
        can_skip = b not in protected
        cur, run_row, both_row = [False] * (m + 1), [False] * (m + 1), [False] * (m + 1)
        cur[0] = lo == 0
        for j in js:
            r, k = j in run_js, can_skip and prev[j - 1]
            cur[j], run_row[j], both_row[j] = r or k, r, r and k
        runs.append((run_js[0], run_js[-1]) if run_js else (1, 0))
        reach.append(cur)
        has_run.append(run_row)
        both.append(both_row)
    return runs, reach, has_run, both


def dp_choices(
    ops: DeviceOps,
    x: torch.Tensor,
    tables: torch.Tensor,
    *,
    num_skip: int,
    protected: frozenset[int] = frozenset(),
    objective: str = "max_cosine",
    sequence_parallel: bool = True,
) -> torch.Tensor:
    """The DP's work on the device: every layer's choices and the final cosine, FloatTensor
    (L * (M+1) + 1,) in float64, ready for one read (`backtrack`). ``ops.block(b, states)`` runs
    block b on candidate states of the token; ``tables`` (2, L, M+1): which states may come from
    running a block, and which from running or skipping it (`_dp_tables`). Arguments as
    `clasp_dp`'s."""
    n_layers = x.shape[0] - 1
    m = num_skip
    runs = _dp_tables(n_layers, m, frozenset(protected))[0]
    # Row j of layer i: g(i, j). The candidates of layer i are stacked as
    # [ran (M+1 rows: block i-1 on g(i-1, j)), x_i, g(i-1, 0..M-1)], so that rows M+1.. are the
    # "skip" candidates of j = 0..M (g(i, 0) = x_i, and g(i-1, j-1) passed through for j >= 1).
    units = _units(x)  # x_i / |x_i|, every layer at once
    zeros = x.new_zeros(m + 1, x.shape[1])
    better = torch.gt if objective == "max_cosine" else torch.lt  # run only if strictly better
    prev = torch.cat([x[:1], zeros[:m]])
    decisions = []
    for i in range(1, n_layers + 1):
        b = i - 1
        a, z = runs[b]
        parts = [zeros[:a]] if a else []
        if z >= a:
            states = prev[a : z + 1]  # a contiguous band: a view
            if sequence_parallel:
                parts.append(ops.block(b, states))
            else:
                parts += [ops.block(b, states[k : k + 1]) for k in range(z - a + 1)]
            parts.append(zeros[: m - z])
        else:
            parts = [zeros]
        cand = torch.cat([*parts, x[i : i + 1], prev[:m]])  # (2M + 2, d)
        cos = (_units(cand) * units[i]).sum(-1)
        run = torch.where(tables[1, b], better(cos[: m + 1], cos[m + 1 :]), tables[0, b])
        prev = torch.where(run[:, None], cand[: m + 1], cand[m + 1 :])
        decisions.append(run)
    final = (_units(prev[m : m + 1]) * units[n_layers]).sum(-1)
    return torch.cat([torch.stack(decisions).flatten().double(), final.double()])


def backtrack(read: Sequence[float], n_layers: int, m: int) -> tuple[tuple[int, ...], float]:
    """The skip set and final cosine from `dp_choices`' values, read: from (L, M) back to (0, 0)."""
    cosine, ran = read[-1], read[:-1]
    skip, j = [], m
    for i in range(n_layers, 0, -1):
        if j > 0 and not ran[(i - 1) * (m + 1) + j]:
            skip.append(i - 1)
            j -= 1
    return tuple(sorted(skip)), cosine


def clasp_dp(
    x: torch.Tensor,
    state: RoundView,
    position: int,
    num_skip: int,
    *,
    protected: Collection[int] = (),
    objective: str = "max_cosine",
    sequence_parallel: bool = True,
) -> DPResult:
    """CLaSp's DP (Chen et al., 2025, Eq. 2 and Algorithm 1) over blocks i and skip counts j.

    ``g(i, j)`` is the best state after the first i blocks with exactly j of them skipped; block
    i-1 is either skipped (``g(i-1, j-1)`` passes through) or run on ``g(i-1, j)``, whichever is
    closer in cosine to the full model's ``x_i`` (run only if strictly closer). ``g(i, 0) = x_i``.
    Backtracking from ``(L, M)`` gives the skip set. States that can no longer reach ``(L, M)``
    (``j < M - (L - i)``) are never evaluated; this prunes work without changing the result.

    Which states exist depends on (L, M, protected) only (`_dp_tables`); a layer's choices are a
    handful of tensor operations over all M + 1 rows at once (`dp_choices`, the device work); the
    choices of every layer and the final cosine are read once, for the backtrack (`backtrack`).

    Args:
        x: (L+1, d) the full model's pre-norm residuals of one token (index 0: its embedding).
        state: the round (its device work runs at that token's committed ``position``:
            ``state.compute_at``).
        position: that token's committed position.
        num_skip: M.
        protected: blocks that may not be skipped.
        objective: ``"max_cosine"`` (the DP) or ``"min_cosine"`` (Eq. 1's typo, for ablation).
        sequence_parallel: one block call per layer for all candidates, else one each.

    Raises:
        ValueError: M blocks cannot be skipped outside ``protected``.
    """
    n_layers, prot = x.shape[0] - 1, frozenset(protected)
    if not 0 <= num_skip <= n_layers - len(prot):
        raise ValueError(f"cannot skip {num_skip} of {n_layers} blocks with {len(prot)} protected")
    _, _, has_run, both = _dp_tables(n_layers, num_skip, prot)
    tables = state.constant([has_run, both], torch.bool, key=("clasp_dp", n_layers, num_skip, prot))
    options = {"protected": prot, "objective": objective, "sequence_parallel": sequence_parallel}
    read = state.compute_at(
        position, dp_choices, x, tables, num_skip=num_skip, **options
    ).tolist()  # one read
    skip, cosine = backtrack(read, n_layers, num_skip)
    bands = [z - a + 1 for a, z in _dp_tables(n_layers, num_skip, prot)[0] if z >= a]  # rows run per block
    return DPResult(skip, cosine, len(bands) if sequence_parallel else sum(bands), sum(bands))


@register_selector("clasp_dp", config=ClaspDPConfig)
class ClaspDPSelector(BudgetedWork, LayerSelector):
    """Skip the M blocks chosen by CLaSp's dynamic programme on the last verified token.

    CLaSp (Chen et al., 2025). After a verification the full model's per-layer states of the last
    accepted token are known for free (``needs_hidden_states``); the DP (`clasp_dp`) picks, layer
    by layer, the skip pattern whose state stays closest in cosine to them, and the draft skips
    the M chosen blocks (attention and MLP) until the next refresh, every ``interval`` rounds.
    The DP runs against the committed KV cache without writing it, one block call per layer for all
    candidate states (sequence parallelism). The first round uses the DP on the prompt's last
    token (``init="prompt"``). With ``work_budget`` (an extension) a due re-run waits while the DPs
    took more than that share of the wall time (generations included), and is tried again the next
    round; the prompt DP of a generation over budget is replaced by the previous generation's set.
    """

    needs_hidden_states = True

    def __init__(self, config: ClaspDPConfig | None = None) -> None:
        super().__init__(config)
        self._L, self._m, self._protected = 0, 0, frozenset[int]()
        self.reset()

    def setup(self, info: ModelInfo) -> None:
        c, n = self.config, info.num_layers
        m, by_count = c.skip_count(n), c.num_skip is not None
        given = ("--selector.num_skip", c.num_skip) if by_count else ("--selector.skip_ratio", c.skip_ratio)
        if not 1 <= m <= n - 1:
            why = f"a number of skipped blocks M in [1, {n - 1}] (the model has {n} blocks; M = {m})"
            raise ConfigError(*given, why)
        for name in ("protect_first", "protect_last"):
            if getattr(c, name) > n - 1:
                raise ConfigError(f"--selector.{name}", getattr(c, name), f"in [0, {n - 1}]")
        protected = set(range(c.protect_first)) | set(range(n - c.protect_last, n))
        if m > n - len(protected):
            why = f"at most {n - len(protected)} skipped blocks with protect_first={c.protect_first} and "
            raise ConfigError(*given, why + f"protect_last={c.protect_last} (M = {m})")
        self._L, self._m, self._protected = n, m, frozenset(protected)
        self.reset()

    def reset(self) -> None:
        #: the last generation's set: the first plan of the next one when its prompt DP is over budget
        self._previous: LayerPlan | None = getattr(self, "_plan", None)
        self._plan: LayerPlan | None = None
        self._since_rounds = self._since_tokens = 0
        self.budget.resume()  # it spans generations (the prompt DP is budgeted like the refreshes)
        self._t_reset = time.perf_counter()
        self._dp_seconds: list[float] = []
        self._sets: list[dict[str, Any]] = []
        self._calls = self._evals = self._rounds = 0

    @property
    def num_skip(self) -> int:
        """M for the model set up."""
        return self._m

    def _set_plan(self, skip: Sequence[int]) -> None:
        self._plan = LayerPlan.from_indices(self._L, attn=skip, mlp=skip)

    def refresh(self, state: RoundView, hidden: torch.Tensor, position: int) -> DPResult:
        """Run the DP on ``hidden`` (L+1, d), the full model's states of the token at ``position``.

        One unit of the work budget: timed by it, whether or not `WorkBudget.allows` was asked
        (the caller decides; the prompt's DP, the generation's first unit, is always allowed).
        """
        c = self.config
        with self.budget.unit() as unit:
            options = {"objective": c.objective, "sequence_parallel": c.sequence_parallel}
            res = clasp_dp(hidden, state, position, self._m, protected=self._protected, **options)
        self._set_plan(res.skip)
        self._dp_seconds.append(unit.seconds)
        self._calls, self._evals = self._calls + res.block_calls, self._evals + res.evaluations
        cos = round(res.cosine, 6)
        self._sets.append(
            {"round": self._rounds, "position": position, "skip": list(res.skip), "cosine": cos}
        )
        return res

    def plan(self, state: RoundView) -> LayerPlan:
        if not self._L:
            raise RuntimeError("clasp_dp: setup() was not called")
        if self._plan is None:  # the first round: the DP on the prompt's last token, or uniform
            hs, p = state.last_hidden_states, state.prompt_len
            if self.config.init == "prompt" and hs is not None and state.round == 0 and hs.shape[2] >= p:
                if self._previous is not None and not self.budget.allows():
                    self._plan = self._previous  # over budget: keep the last generation's set
                else:
                    self.refresh(state, hs[:, 0, p - 1], p - 1)
            else:
                self._set_plan(spread(self._m, [i for i in range(self._L) if i not in self._protected], 0.5))
        return self._plan

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        self._rounds += 1
        self._since_rounds += 1
        self._since_tokens += int(result.new_tokens.shape[1])
        since = self._since_rounds if self.config.interval_unit == "rounds" else self._since_tokens
        if since < self.config.interval:
            return
        hs = result.path_hidden  # (L+1, B, n, d); columns 0..m: the committed positions
        if hs is None:
            return
        if not self.budget.allows():  # over budget: keep the set, the counters stay due
            return
        self._since_rounds = self._since_tokens = 0
        m = result.accepted
        back = 1 if (self.config.dp_token == "previous" and m > 0) else 0
        # After the commit the last accepted token sits just before `pending` (its KV is committed).
        position = state.pending_position - 1 - back
        self.refresh(state, hs[:, 0, m - back], position)

    def summary(self) -> dict[str, Any]:
        if not self._L:
            return {}
        wall = time.perf_counter() - self._t_reset
        total = sum(self._dp_seconds)
        cos = [s["cosine"] for s in self._sets]
        return {
            "num_skip": self._m,
            "refreshes": len(self._dp_seconds),
            "dp_seconds": round(total, 6),
            "dp_seconds_per_refresh": [round(t, 6) for t in self._dp_seconds],
            "dp_share": round(total / wall, 4) if wall > 0 else None,
            "dp_block_calls": self._calls,
            "dp_evaluations": self._evals,
            "mean_cosine": round(sum(cos) / len(cos), 6) if cos else None,
            **self.budget.summary(),
            "sets": self._sets,
            "plan": self._plan.describe() if self._plan is not None else None,
        }
