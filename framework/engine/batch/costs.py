"""The cost model of a batch: seconds per merged forward of B rows, measured on the batch engine.

`framework.engine.cost_model.CostModel` prices one sequence's forwards. At batch B a round costs
what the lockstep runs (`framework.engine.batch.lockstep`): the longest row's draft, one merged draft
step of the B rows per drafted position, then one merged verification of B rows x (k + 1) tokens
(each row's block padded to the longest). `BatchCosts.measure` times those forwards through the
same merged path (`framework.engine.batch.merge.run_merged`) at a given context; `round_time` and
`predicted_speedup` price a round from them, so the benchmark can put a prediction next to each
measured batch speedup.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from framework.engine.batch.merge import ForwardRequest, run_alone, run_merged
from framework.engine.batch.rows import BatchCache
from framework.types import LayerPlan
from framework.utils import synced_clock


@dataclass(frozen=True)
class BatchCosts:
    """Seconds of the merged forwards of ``batch`` rows.

    Attributes:
        batch: B.
        step: one plain step of B rows (each row one token: vanilla batched decoding).
        draft: one draft step of B rows through the measured plan (and draft weights).
        verify_costs: ``verify_costs[T - 1]``: a verification of B rows x T tokens.
        context: the cache length of every row when measured.
    """

    batch: int
    step: float
    draft: float
    verify_costs: tuple[float, ...]
    context: int

    def verify(self, tokens: int) -> float:
        """A verification of B rows x ``tokens`` (past the table: its last slope, never negative)."""
        costs = self.verify_costs
        if tokens <= len(costs):
            return costs[tokens - 1]
        slope = max(0.0, costs[-1] - costs[-2]) if len(costs) > 1 else costs[0]
        return costs[-1] + slope * (tokens - len(costs))

    def round_time(self, k: float) -> float:
        """A round whose longest row drafts ``k`` tokens (fractional: the mean over rounds):
        ``k`` merged draft steps and one merged verification of ``k + 1`` tokens per row
        (``k = 0``: a plain step)."""
        if k <= 0:
            return self.step
        lo = int(k)
        frac = k - lo
        verify = (
            self.verify(lo + 1)
            if frac == 0
            else (1 - frac) * self.verify(lo + 1) + frac * self.verify(lo + 2)
        )
        return k * self.draft + verify

    def predicted_speedup(self, tokens_per_round: float, longest_draft: float) -> float:
        """Speedup over vanilla batched decoding at the same B, of rounds that commit
        ``tokens_per_round`` tokens per row (M) while the longest row drafts ``longest_draft``."""
        return tokens_per_round * self.step / self.round_time(longest_draft)

    @classmethod
    def measure(
        cls,
        adapter: Any,
        batch: int,
        plan: LayerPlan,
        *,
        max_tokens: int = 9,
        context: int = 128,
        weights: Any = None,
        reps: int = 7,
    ) -> BatchCosts:
        """Time the merged forwards of ``batch`` rows at ``context`` cached tokens each (medians of
        ``reps`` after one warm-up each): a plain step, a draft step of ``plan`` with ``weights``
        (a draft's compressed copy, ``None``: the model's own) and verifications of 1 to
        ``max_tokens`` tokens per row."""
        a, ex = adapter.arch, adapter.executor
        cache, ids = _filled(adapter, batch, context, max_tokens)
        clock = synced_clock(a.device)

        def timed(t: int, *, draft: bool) -> float:
            reqs = [
                ForwardRequest(
                    r, True, ids[r : r + 1, context : context + t], _positions(context, t, a.device), row,
                    plan if draft else None,
                    {"logits_at": "last"} if draft else {"logits_at": "all", "base": context},
                )
                for r, row in enumerate(cache.rows)
            ]  # fmt: skip
            if draft and weights is not None:
                for q in reqs:
                    q.options["weights"] = weights
            seconds = []
            for i in range(reps + 1):
                t0 = clock()
                with torch.inference_mode():
                    if batch == 1:
                        run_alone(ex, reqs[0])
                    else:
                        run_merged(ex, cache, reqs)
                if i:
                    seconds.append(clock() - t0)
                for row in cache.rows:
                    row.rollback()
            return statistics.median(seconds)

        step = timed(1, draft=False)
        return cls(
            batch,
            step,
            timed(1, draft=True),
            (step, *(timed(t, draft=False) for t in range(2, max_tokens + 1))),
            context,
        )


def _filled(adapter: Any, batch: int, context: int, max_tokens: int) -> tuple[BatchCache, torch.Tensor]:
    """A batch cache whose rows hold ``context`` committed random tokens, and the token ids
    (B, context + max_tokens + 1) they came from."""
    a = adapter.arch
    cache = BatchCache(
        a.num_layers, batch, a.num_kv_heads, a.head_dim, context + max_tokens + 2, adapter.kv_dtype, a.device
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.info().vocab_size, (batch, context + max_tokens + 1), generator=g).to(a.device)
    with torch.inference_mode():
        for r, row in enumerate(cache.rows):
            prefix = ForwardRequest(
                r,
                True,
                ids[r : r + 1, :context],
                _positions(0, context, a.device),
                row,
                None,
                {"logits_at": None},
            )
            run_alone(adapter.executor, prefix)
            row.commit(context)
    return cache, ids


def _positions(start: int, n: int, device: Any) -> torch.Tensor:
    return torch.arange(start, start + n, device=device)[None]
