"""One forward for several rows of a batch: which row forwards may merge, and how they run.

A row's forward (`ForwardRequest`) is what its one-sequence decode state asked the adapter for.
Requests with the same `merge_key` (the same plan, block range, weights and kind: a draft step
appends at each layer's end, a verification writes from a given base) run as one
forward over those rows (`run_merged`): token ids padded to the longest row, each row written
at its own slots (`framework.engine.batch.rows.MergedRows`), and each row's outputs cut back to its
own tokens. What a row asked of the output (the logits at its positions, a token picked, an
acceptance rule with its own random stream) is computed from its own rows, through the LM head (or
the row's own draft head) in blocks of at most `MAX_ROWS` rows, as its one-sequence forward would: on the CPU kernels a row's
logits do not depend on how many rows a call holds, so a row's tokens equal its batch-1 tokens.

What does not merge runs alone, on the row's own cache, exactly as at batch 1: a prefill, a token
tree, a scratch pass (hidden slots, nothing persists), different plans.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.engine.batch.rows import BatchCache, MergedRows, RowCache, RowWrite, rowwise
from framework.kernels.cpu import MAX_ROWS
from framework.types import ForwardOutput, LayerPlan, pick_tokens

#: The executor (`framework.engine.execution.executor.Executor`; not imported: it imports this).
Executor = Any


@dataclass
class ForwardRequest:
    """One row's forward, as its decode state called ``adapter.forward`` or ``forward_from``.

    Attributes:
        row: the row.
        inputs: token ids (1, T), or residuals (1, T, d) with ``from_ids`` False.
        positions: (1, T).
        cache: the row's cache (a `RowCache` of the batch, or another: then it runs alone).
        plan: the forward's plan.
        options: the other `ForwardSpec` fields it passed.
    """

    row: int
    from_ids: bool
    inputs: torch.Tensor
    positions: torch.Tensor
    cache: Any
    plan: LayerPlan | None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def num_new(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def verifies(self) -> bool:
        """A forward written from a given base (a verification), not appended (a draft step)."""
        return self.options.get("base") is not None


def merge_key(req: ForwardRequest) -> Hashable | None:
    """What a forward must share with another to run as one with it, or ``None``: it runs alone
    (not a batch row's cache, a prefill, a tree, hidden slots, a scratch write, more than
    `MAX_ROWS` tokens)."""
    o = req.options
    if not isinstance(req.cache, RowCache) or req.cache.empty or req.num_new > MAX_ROWS:
        return None
    if o.get("tree_mask") is not None or o.get("visible") is not None or not o.get("persist", True):
        return None
    weights = o.get("weights")
    return (
        req.from_ids,
        req.plan,
        o.get("start", 0),
        o.get("stop"),
        req.verifies,
        id(weights) if weights is not None else None,
    )


def run_alone(executor: Executor, req: ForwardRequest) -> ForwardOutput:
    """``req`` as its one-sequence forward."""
    if req.from_ids:
        return executor.forward(req.inputs, req.positions, req.cache, req.plan, **req.options)
    return executor.forward_from(req.inputs, req.positions, req.cache, req.plan, **req.options)


def _padded(reqs: Sequence[ForwardRequest], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' inputs and positions, each padded to ``t`` tokens (ids: the row's last token;
    residuals: zeros; positions: continuing)."""
    inputs, positions = [], []
    for r in reqs:
        n, x, p = r.num_new, r.inputs, r.positions
        if n < t:
            fill = (
                x[:, -1:].expand(1, t - n, *x.shape[2:])
                if r.from_ids
                else x.new_zeros(1, t - n, *x.shape[2:])
            )
            x = torch.cat([x, fill], dim=1)
            p = torch.cat([p, p[:, -1:] + torch.arange(1, t - n + 1, device=p.device)], dim=1)
        inputs.append(x)
        positions.append(p)
    return torch.cat(inputs), torch.cat(positions)


def run_merged(executor: Executor, batch: BatchCache, reqs: Sequence[ForwardRequest]) -> list[ForwardOutput]:
    """Rows' requests of one `merge_key` (in row order) as one forward; each row's output as its
    one-sequence forward gives it (module docstring)."""
    first = reqs[0]
    t = max(r.num_new for r in reqs)
    writes = [RowWrite(r.cache, r.num_new, r.options.get("base")) for r in reqs]
    cache = MergedRows(batch, writes, t)
    inputs, positions = _padded(reqs, t)
    o = first.options
    shared = {
        "capture_hidden": any(r.options.get("capture_hidden", False) for r in reqs),
        "logits_at": None,
        "weights": o.get("weights"),
        "stop": o.get("stop"),
    }
    if first.from_ids:
        out = executor.forward(inputs, positions, cache, first.plan, **shared)
    else:
        out = executor.forward_from(inputs, positions, cache, first.plan, start=o.get("start", 0), **shared)
    return _split(executor, reqs, inputs, out)


def _split(
    executor: Executor, reqs: Sequence[ForwardRequest], inputs: torch.Tensor, out: ForwardOutput
) -> list[ForwardOutput]:
    """Each row's output: its tokens' residuals, its logits where it asked for them (through the
    LM head in blocks of at most `MAX_ROWS` rows), its pick and its acceptance rule."""
    h = out.last_hidden
    chosen: list[torch.Tensor | None] = []
    for j, r in enumerate(reqs):
        at, n = r.options.get("logits_at", "all" if r.from_ids else None), r.num_new
        if at is None:
            chosen.append(None)
        elif isinstance(at, torch.Tensor):
            chosen.append(h[j, :n].index_select(0, at.to(h.device)))
        else:
            chosen.append(h[j, n - 1 : n] if at == "last" else h[j, :n])
    weights = reqs[0].options.get("weights")
    by_head: dict[int, list[int]] = {}  # rows scored by one head (a draft head is per row)
    for j, r in enumerate(reqs):
        if chosen[j] is not None:
            by_head.setdefault(id(r.options.get("head")), []).append(j)
    row_logits: dict[int, torch.Tensor] = {}
    for rows in by_head.values():
        head = reqs[rows[0]].options.get("head")
        picked_rows = [chosen[j] for j in rows]
        scored = rowwise(
            lambda x, head=head: executor.logits_from_hidden(x, head, weights), torch.cat(picked_rows)[None]
        )[0]
        at = 0
        for j, c in zip(rows, picked_rows, strict=False):
            row_logits[j], at = scored[at : at + c.shape[0]][None], at + c.shape[0]
    outs = []
    for j, r in enumerate(reqs):
        n, logits = r.num_new, row_logits.get(j)
        hidden = None
        if r.options.get("capture_hidden", False) and out.hidden_states is not None:
            hidden = out.hidden_states[:, j : j + 1, :n]
        head = r.options.get("head") if logits is not None else None
        pick, rule = r.options.get("pick"), r.options.get("rule")
        picked = pick_tokens(logits[:, -1], pick, head) if pick is not None and logits is not None else None
        ruled = None
        if rule is not None and logits is not None:
            ids = inputs[j : j + 1, :n] if r.from_ids else rule.ids
            if ids is not None:
                ruled = executor.apply_rule(rule, ids, logits)
        outs.append(ForwardOutput(logits, hidden, h[j : j + 1, :n], head, picked, ruled))
    return outs
