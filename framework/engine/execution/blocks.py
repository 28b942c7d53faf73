"""The block loop, written once: every route (the model's modules, the fused CPU branches, the
branch graphs, a model split across devices, the static body of a whole-forward graph, one block
of CLaSp's candidates) runs blocks through `run_blocks` and supplies only how a branch runs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from framework.types import LayerPlan

#: ``(block, residual) -> residual``: a branch applied with its residual add.
Branch = Callable[[int, torch.Tensor], torch.Tensor]


def run_blocks(
    h: torch.Tensor,
    start: int,
    stop: int,
    plan: LayerPlan | None,
    attention: Branch,
    mlp: Branch,
    *,
    enter: Branch | None = None,
    captured: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Blocks ``start .. stop-1`` over the residual ``h``: each sub-layer the plan runs
    (``None``: every one) through ``attention`` or ``mlp``, after ``enter`` (a split model moves
    the residual to the block's device there); the residual after each block is appended to
    ``captured``."""
    for i in range(start, stop):
        if enter is not None:
            h = enter(i, h)
        if plan is None or plan.runs_attn(i):
            h = attention(i, h)
        if plan is None or plan.runs_mlp(i):
            h = mlp(i, h)
        if captured is not None:
            captured.append(h)
    return h
