"""``hybrid``: copy from the context when the last tokens recur (prompt lookup), else draft by layer skipping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.config import check_range, param
from framework.interfaces import Draft, Drafter, LayerPlan, LengthController, ModelInfo
from framework.registry import register_drafter
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.drafters.prompt_lookup import MAX_NGRAM, PromptLookupDrafter, PromptLookupDrafterConfig

SOURCES = ("lookup", "layer_skip")


@dataclass(frozen=True)
class HybridDrafterConfig:
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

    def __post_init__(self) -> None:
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

    ``summary()`` reports per source (``lookup``, ``layer_skip``) the rounds, tokens drafted and
    tokens accepted, and ``sources``, one letter per drafting round (``L`` lookup, ``S`` layer skip).
    """

    def __init__(self, config: HybridDrafterConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        self.lookup = PromptLookupDrafter(
            PromptLookupDrafterConfig(max_ngram=c.max_ngram, min_ngram=c.min_match, confidence=c.confidence)
        )
        self.layer_skip = LayerSkipDrafter()
        self.reset()

    def setup(self, info: ModelInfo) -> None:
        self.lookup.setup(info)
        self.layer_skip.setup(info)

    def reset(self) -> None:
        self.lookup.reset()
        self.layer_skip.reset()
        self._log: list[tuple[int, str, int]] = []  # (round, source, drafted)
        self._stats: Any = None  # the generation's DecodeStats (accepted tokens per round)

    def draft(self, state, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        self._stats = state.stats
        draft = self.lookup.draft(state, plan, length, max_tokens)
        source = "lookup"
        if not draft.length:
            draft = self.layer_skip.draft(state, plan, length, max_tokens)
            source = "layer_skip"
        draft.extras["source"] = source
        self._log.append((state.round, source, draft.length))
        return draft

    def summary(self) -> dict[str, Any]:
        rounds = self._stats.rounds if self._stats is not None else []
        out: dict[str, Any] = {}
        for source in SOURCES:
            mine = [(r, k) for r, s, k in self._log if s == source]
            # The decoder appends round r's record after its commit; state.round was r while drafting.
            accepted = sum(rounds[r].accepted for r, _ in mine if r < len(rounds))
            out[source] = {"rounds": len(mine), "drafted": sum(k for _, k in mine), "accepted": accepted}
        out["sources"] = "".join("L" if s == "lookup" else "S" for _, s, _ in self._log)
        out["search_ms"] = self.lookup.summary()["search_ms"]
        return out
