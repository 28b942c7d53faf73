"""The round's forwards with their KV-cache semantics, for `framework.engine.state.DecodeState`.

A draft pass (`draft_pass`) continues after the committed prefix and the round's draft, writing KV
only into the layers whose attention it runs. A verification (`verify_pass`) discards the draft's
KV and writes its block from the first uncommitted position in every layer, or keeps an early-exit
draft's lower blocks (`framework.engine.execution.reuse`). Two kinds leave the committed cache as it
is: a scratch pass (`scratch_pass`, SWIFT's candidate scoring: a teacher-forced draft pass over
committed tokens) and a single-block evaluation (`ScratchBlocks`, CLaSp's dynamic programme: one
decoder block on candidate states of a committed position) write their KV beyond every layer's end,
where the next forward overwrites it. With logits processors, a forward's logits are processed
before anything reads them, the acceptance rule included (`framework.engine.processing`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from framework.engine.execution.reuse import EarlyExitReuse
from framework.engine.execution.spec import RuleCall
from framework.types import ForwardOutput, LayerPlan, TokenPick

#: The decode state (`framework.engine.state.DecodeState`; not imported: it imports this).
DecodeState = Any

Where = str | torch.Tensor | None  # a forward's ``logits_at``: "last", "all", row indices or none


def draft_pass(
    state: DecodeState,
    reuse: EarlyExitReuse,
    input_ids: torch.Tensor,
    plan: LayerPlan | None,
    logits_at: Where,
    reusable: bool,
    pick: TokenPick | None,
) -> ForwardOutput:
    """Draft token(s) (B, T) through ``plan`` (``None``: the full model) after the committed prefix
    and the round's draft (``state.draft_len`` tokens), through the state's draft head and draft
    weights. ``reusable``: ``plan`` is a pure prefix (``exit_layer`` E, nothing skipped before it)
    and the next chain verification may keep what its blocks computed (every step of the round
    says so; ``reuse``). ``pick``: choose the next token inside the forward
    (`framework.types.TokenPick`, returned as ``ForwardOutput.picked``; nothing is picked with
    processors, which process the logits first, or a reduced head's logits).

    Raises:
        ValueError: ``reusable`` with a plan that is not a pure prefix, or with compressed draft
            weights.
    """
    capture = reuse.before_step(state, plan) if reusable else False
    if not reusable:
        reuse.drop()
    processing = state.processing
    out = state.adapter.forward(
        input_ids,
        state.positions(state.cache.committed + state.draft_len, input_ids.shape[1]),
        state.cache,
        plan,
        logits_at=logits_at,
        capture_hidden=capture,
        head=state.draft_head,
        weights=state.draft_weights,
        pick=pick if processing is None else None,
    )
    if processing is not None:
        out = processing.draft(state.tokens, input_ids, out, logits_at, first=state.draft_len == 0)
    if reusable:
        reuse.after_step(input_ids, out)
    return out


def verify_pass(
    state: DecodeState,
    reuse: EarlyExitReuse,
    input_ids: torch.Tensor,
    logits_at: Where,
    position_ids: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    call: RuleCall | None,
) -> ForwardOutput:
    """Full-model forward over a block (B, T) written at ``[committed, committed + T)`` in every
    layer, the draft's KV discarded first; ``position_ids``/``tree_mask`` verify a token tree.
    ``call``: the verifier's acceptance rule on the block, every row's logits and its inputs,
    inside the forward's graph where it runs as one (with processors: after them, on what they
    give); its outputs come back in ``ForwardOutput.ruled``. After a reusable early-exit draft a
    chain verification keeps the draft's lower blocks (`EarlyExitReuse.verify`)."""
    processing, chain = state.processing, position_ids is None and tree_mask is None
    inside = call if processing is None else None
    out = reuse.verify(state, input_ids, logits_at, inside) if chain else None
    if not chain:
        reuse.drop()
    if out is None:
        state.cache.rollback()
        c, t = state.cache.committed, input_ids.shape[1]
        out = state.adapter.forward(
            input_ids,
            state.positions(c, t) if position_ids is None else position_ids,
            state.cache,
            None,
            logits_at=logits_at,
            capture_hidden=state.capture_hidden,
            base=c,
            tree_mask=tree_mask,
            rule=inside,
        )
    state.verified(out, chain)
    if processing is not None and out.logits is not None:
        logits = processing.verification(state.tokens, input_ids, out.logits, logits_at, tree_mask)
        ruled = None if call is None else state.adapter.executor.apply_rule(call, input_ids, logits)
        out = replace(out, logits=logits, ruled=ruled)
    return out


def scratch_pass(
    state: DecodeState,
    start: int,
    plan: LayerPlan | None,
    end: int | None,
    logits_at: Where,
) -> ForwardOutput:
    """Teacher-forced draft pass of ``plan`` over committed tokens ``[start, end)`` (``end``
    ``None``: N - 1). Token ``start`` attends to the committed KV of ``[0, start)`` and to the
    block's own KV, written beyond every layer's end and forgotten; ``logits[:, j]`` predicts token
    ``start + j + 1``, through the state's draft head.

    Raises:
        ValueError: ``start``/``end`` outside ``0 <= start < end <= N - 1``.
    """
    last = state.num_tokens - 1  # == cache.committed
    end = last if end is None else end
    if not 0 <= start < end <= last:
        raise ValueError(f"scratch span must satisfy 0 <= start < end <= {last}, got [{start}, {end})")
    cache = state.cache
    return state.adapter.forward(
        state.committed_tokens.span(start, end),
        state.positions(start, end - start),
        cache,
        plan,
        logits_at=logits_at,
        base=max(cache.lengths),
        visible=start,
        persist=False,
        head=state.draft_head,
        weights=state.draft_weights,
    )


class ScratchBlocks:
    """Single-block evaluations at a committed position; the positions and the mask of the most
    candidates seen there are built once (views of them after)."""

    def __init__(self) -> None:
        #: (position, positions (1, n), mask (n, n)), n the most candidates at that position
        self._inputs: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def run(self, state: DecodeState, block: int, states: torch.Tensor, position: int) -> torch.Tensor:
        """Decoder block ``block`` on n candidate states (n, d) of the token at the committed
        ``position``, as n tokens at that position: each attends to the committed KV before it and
        to itself only, in scratch slots that are forgotten. Returns the states after it (n, d).

        Raises:
            ValueError: ``position`` is not committed.
        """
        cache = state.cache
        if not 0 <= position < cache.committed:
            raise ValueError(f"position must be committed, in [0, {cache.committed}), got {position}")
        n, held = states.shape[0], self._inputs
        if held is None or held[0] != position or held[1].shape[1] < n:
            size = max(n, held[1].shape[1] if held is not None else 0)
            full = torch.full((1, size), position, dtype=torch.long, device=state.device)
            held = self._inputs = (position, full, torch.eye(size, dtype=torch.bool, device=state.device))
        out = state.adapter.forward_from(
            states[None],
            held[1][:, :n],
            cache,
            start=block,
            stop=block + 1,
            base=max(cache.lengths),
            visible=position,
            tree_mask=held[2][:n, :n],
            persist=False,
        )
        return out.last_hidden[0]
