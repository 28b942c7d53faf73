"""``cascade``: each round, the draft source with the best predicted speedup: a copy from the
context, a compressed layer-skip draft, or none (a plain step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework import (
    Draft,
    DraftView,
    LayerPlan,
    LengthController,
    PrepareView,
    RoundView,
    Verification,
    register_drafter,
)
from framework.config_fields import param
from framework.drafting.gate import DraftGate, GateConfig
from strategies.drafters.hybrid import HybridDrafter, HybridDrafterConfig


@dataclass(frozen=True)
class CascadeDrafterConfig(HybridDrafterConfig):
    skip_gate: bool = param(
        True,
        help="the layer-skip source's own draft gate; the cascade always has it (its predicted "
        "speedup is what a copy is compared with): false is refused",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.skip_gate:
            raise ValueError(
                "skip_gate: the cascade compares its sources through their gates; it must be true"
            )


@register_drafter("cascade", config=CascadeDrafterConfig)
class CascadeDrafter(HybridDrafter):
    """Per round, the source with the best predicted speedup, in the spirit of CAS-Spec's dynamic
    cascade (Ning et al., NeurIPS 2025), restricted to one source per round.

    The sources are those of `HybridDrafter`: a copy of what followed the last ``min_match``+
    tokens earlier in the context (prompt lookup, no forward), and a layer-skip draft with the
    round's plan, through the compressed draft weights and the reduced head where configured.
    Each source has a `DraftGate` of its own, fed only the rounds that source drafted (and, for
    layer skipping, the rounds it declined), so each has its own acceptance estimate. Both are
    priced by the measured cost model at the round's context. The copy gate prices copies as
    free drafts (no draft forward), valued at exactly the copied length.

    Each round:

    1. With a match, the copy's predicted speedup (`DraftGate.predict`) is compared with the
       layer-skip source's. The copy is drafted unless the layer-skip draft is predicted to be
       faster and to pay, or the copy is predicted not to pay. A source without an estimate yet
       counts as paying, so that each gets tried. The copies' estimate restarts with every
       generation (copies are as good as the text they copy from), and after ``probe`` (8)
       matches not copied the next one is, so that a stale estimate recovers.
    2. Otherwise (or when the copy lost), the layer-skip gate decides as in ``hybrid``: draft
       (capped at the length that pays), probe, or decline. If it declines and a copy that pays is
       at hand, the copy is drafted; otherwise the round is a plain step.

    ``hybrid`` always copies on a match. The cascade differs only where the copies of a text
    are predicted to accept too little: there it drafts by layer skipping, or takes a plain step.
    ``summary()`` adds ``displaced`` (matches where the layer-skip draft was taken),
    ``copies_declined`` (matches that ended in a plain step) and the copy gate's summary.
    """

    def __init__(self, config: CascadeDrafterConfig | None = None) -> None:
        # before the hybrid's __init__, which resets (and so resets this gate too)
        self.copy_gate = DraftGate(GateConfig(enabled=True), lengths="exact")
        self.copy_gate.measured.forwards = 0.0  # copies run no forward: their drafts are free
        super().__init__(config)

    def prepare(self, ctx: PrepareView) -> None:
        super().prepare(ctx)
        self.copy_gate.prepare(ctx)  # the model's own cost model: a copy pays for its verification only

    def reset(self) -> None:
        super().reset()
        self.copy_gate.reset()
        # Copies are as good as the text they come from: their estimate starts afresh with each
        # generation (untried, so the first matches are copied), unlike the layer-skip source's.
        self.copy_gate.forget()
        self._displaced = self._copies_declined = 0
        self._since_copy = 0  # matches not copied since the last copy

    def _copy_values(self, state: RoundView, copied: int, max_tokens: int) -> tuple[bool, bool]:
        """``(the copy pays, the layer-skip draft is predicted to do better)`` for a copy of
        ``copied`` tokens; a copy source without an estimate yet pays (so it gets tried)."""
        threshold = 1.0 - self.copy_gate.margin
        copy = self.copy_gate.predict(state, copied)
        skip = self.gate.predict(state, max_tokens) if self.gate is not None else None
        pays = copy is None or copy >= threshold
        better = copy is not None and skip is not None and skip >= threshold and skip > copy
        return pays, better

    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        copy = self.lookup.draft(state, plan, length, max_tokens)
        pays, better = self._copy_values(state, copy.length, max_tokens) if copy.length else (False, False)
        probe = bool(copy.length) and self._since_copy >= self.copy_gate.probe  # refresh the estimate
        if copy.length and (probe or (pays and not better)):
            draft, source = copy, "lookup"
        else:
            assert self.gate is not None
            self.gate.lengths = "exact" if length.exact_length else "upto"
            k = self.gate.limit(state, max_tokens)
            if k:
                draft, source = self.layer_skip.draft(state, plan, length, k), "layer_skip"
                self._displaced += bool(copy.length)
            elif pays:  # the layer-skip source declined; the copy still pays
                draft, source = copy, "lookup"
            else:
                draft, source = Draft.empty(state.pending.shape[0], plan, state.device), "declined"
                self._copies_declined += bool(copy.length)
        if copy.length:
            self._since_copy = 0 if source == "lookup" else self._since_copy + 1
        draft.source = source
        self._log.append((source, draft.length))
        return draft

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        super().observe(state, draft, result)
        if draft.source == "lookup":
            self.copy_gate.observe(draft, result)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["displaced"] = self._displaced
        out["copies_declined"] = self._copies_declined
        out["copy_gate"] = self.copy_gate.summary()
        return out
