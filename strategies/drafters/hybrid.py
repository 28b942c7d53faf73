"""``hybrid``: copy from the context when the last tokens recur (prompt lookup), else draft by layer skipping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework import (
    Draft,
    Drafter,
    DraftView,
    LayerPlan,
    LengthController,
    ModelInfo,
    PrepareView,
    RoundView,
    Verification,
    register_drafter,
)
from framework.config_fields import check_range, param
from framework.drafting.draft_vocab import DraftVocabConfig
from framework.drafting.gate import DraftGate, GateConfig
from framework.types import DraftWeights, ReducedHead
from strategies.drafters.layer_skip import LayerSkipDrafter, LayerSkipDrafterConfig
from strategies.drafters.prompt_lookup import MAX_NGRAM, PromptLookupDrafter, PromptLookupDrafterConfig

SOURCES = ("lookup", "layer_skip")
#: One letter per round the drafter was asked to draft, in ``summary()["sources"]``.
LETTERS = {"lookup": "L", "layer_skip": "S", "declined": "-"}


@dataclass(frozen=True)
class HybridDrafterConfig(DraftVocabConfig):
    max_ngram: int = param(
        3, help="longest n-gram (ending at the last committed token) searched for in the context; in [1, 32]"
    )
    min_match: int = param(
        2,
        help="shortest n-gram match that is copied; shorter (or no) match: the layer-skip draft; in "
        "[1, max_ngram]. 2: a single recurring token predicts the next one too rarely to displace "
        "a model draft",
    )
    confidence: float = param(
        1.0, help="confidence reported for every copied token (as prompt_lookup's); in [0, 1]"
    )
    skip_gate: bool = param(
        False,
        help="gate the layer-skip source on its own: a round without a match drafts nothing (a plain "
        "step) while that source's measured acceptance and the cost model say its drafts do not pay "
        "(the draft gate of the run, fed only the layer-skip rounds, with its default settings; probes "
        "now and then). Copies are never gated here. Off by default, as the run's gate; on in the "
        "hybrid preset",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("max_ngram", self.max_ngram, 1, MAX_NGRAM, integer=True)
        check_range("min_match", self.min_match, 1, self.max_ngram, integer=True)
        check_range("confidence", self.confidence, 0.0, 1.0)


@register_drafter("hybrid", config=HybridDrafterConfig)
class HybridDrafter(Drafter):
    """Prompt lookup when the last ``min_match``+ tokens occurred earlier, the layer-skip draft otherwise.

    Combines prompt lookup decoding (Saxena, 2023) with self-speculative layer skipping (Draft &
    Verify, Zhang et al., ACL 2024; SWIFT, Xia et al., ICLR 2025): each round first searches the
    context (a `PromptLookupDrafter` with ``min_ngram = min_match``, no forward); on a match the
    copied continuation is the draft, otherwise a `LayerSkipDrafter` drafts with the round's
    plan. The choice is per round, never within one. The combination follows no single paper:
    copying from the context is prompt lookup (and LLMA, Yang et al., 2023), drafting with the
    target's own layers is self-speculation; both drafts are verified the same way.

    With ``skip_gate`` (an extension of this framework) a `DraftGate` of its own (the default
    `GateConfig`) decides whether a round without a match drafts by layer skipping or declines
    (an empty draft: the round is a plain step). The run's draft gate around the length
    controller cannot make that choice: it sees the mixture of
    free copies and costly layer-skip drafts. This gate sees only the layer-skip source: its
    acceptance estimate, the plan it ran and the measured cost model (``PrepareView.cost_model``;
    without one, the decode state's timings), with the gate's probes so that the source comes back
    when it starts to pay (a better plan of an online selector, an easier stretch of text).

    ``summary()`` reports per source (``lookup``, ``layer_skip``) the rounds, tokens drafted and
    tokens accepted, the layer-skip rounds the gate ``declined``, ``sources`` (one letter per
    round the drafter was called: ``L`` lookup, ``S`` layer skip, ``-`` declined) and, with the
    gate, its summary under ``skip_gate`` (``alpha``: the layer-skip acceptance estimate).
    """

    def __init__(self, config: HybridDrafterConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        self.lookup = PromptLookupDrafter(
            PromptLookupDrafterConfig(max_ngram=c.max_ngram, min_ngram=c.min_match, confidence=c.confidence)
        )
        self.layer_skip = LayerSkipDrafter(
            LayerSkipDrafterConfig(
                draft_vocab=c.draft_vocab,
                vocab_file=c.vocab_file,
                vocab_context=c.vocab_context,
                draft_weights=c.draft_weights,
                weights_check=c.weights_check,
            )
        )
        # Statistics carry across generations (the same model and plan accept alike), as the run's
        # gate; the default margin, probe interval and decay are the run gate's defaults.
        self.gate = DraftGate(GateConfig(enabled=True)) if c.skip_gate else None
        self.reset()

    def setup(self, info: ModelInfo) -> None:
        self.lookup.setup(info)
        self.layer_skip.setup(info)

    @property
    def needs_phase_timings(self) -> bool:
        """Its own gate, without a cost model, prices drafts from the phase timings."""
        return self.gate is not None and self.gate.costs is None

    def prepare(self, ctx: PrepareView) -> None:
        self.layer_skip.prepare(ctx)  # the reduced draft head, when draft_vocab is set
        if self.gate is not None:  # prices the layer-skip source with the head it drafts with
            self.gate.prepare(ctx.with_draft(self.layer_skip))

    def draft_head(self) -> ReducedHead | None:
        """The layer-skip source's head (copies score no tokens)."""
        return self.layer_skip.draft_head()

    def draft_weights(self) -> DraftWeights | None:
        """The layer-skip source's weights (copies run no forward)."""
        return self.layer_skip.draft_weights()

    def reset(self) -> None:
        self.lookup.reset()
        self.layer_skip.reset()
        if self.gate is not None:
            self.gate.reset()
        self._log: list[tuple[str, int]] = []  # (source, drafted) per round the drafter was asked
        self._accepted = dict.fromkeys(SOURCES, 0)  # accepted draft tokens per source

    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        draft = self.lookup.draft(state, plan, length, max_tokens)
        source = "lookup"
        if not draft.length:
            k = max_tokens
            if self.gate is not None:
                # Value lengths as the controller drafts them: K exactly, or any k <= K.
                self.gate.lengths = "exact" if length.exact_length else "upto"
                k = self.gate.limit(state, max_tokens)
            if k:
                draft = self.layer_skip.draft(state, plan, length, k)
                source = "layer_skip"
            else:  # the lookup's empty draft, carrying the selector's plan (the gate's replan check)
                source = "declined"
        draft.source = source
        self._log.append((source, draft.length))
        return draft

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        source = draft.source
        self.layer_skip.observe(state, draft, result)  # coverage of the head, all rounds
        if source in self._accepted:
            self._accepted[source] += result.accepted
        # The gate learns from the rounds it decided: layer-skip drafts and declined rounds (whose
        # empty draft carries the selector's plan); copies and rounds the controller declined are
        # not the layer-skip source's.
        if self.gate is not None and source in ("layer_skip", "declined"):
            self.gate.observe(draft, result)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for source in SOURCES:
            mine = [k for s, k in self._log if s == source]
            out[source] = {"rounds": len(mine), "drafted": sum(mine), "accepted": self._accepted[source]}
        out["layer_skip"]["declined"] = sum(s == "declined" for s, _ in self._log)
        out["sources"] = "".join(LETTERS[s] for s, _ in self._log)
        out["search_ms"] = self.lookup.summary()["search_ms"]
        out.update(self.layer_skip.summary())
        if self.gate is not None:
            out["skip_gate"] = self.gate.summary()
        return out
