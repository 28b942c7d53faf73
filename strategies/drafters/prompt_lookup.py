"""``prompt_lookup``: copy the continuation of an earlier occurrence of the last few tokens (no forward)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from framework import Draft, Drafter, DraftView, LayerPlan, LengthController, RoundView, register_drafter
from framework.config_fields import check_range, check_types, param
from framework.drafting.copying import NgramIndex, copy_draft

#: Longest n-gram the config accepts (the index holds max_ngram - min_ngram + 1 keys per token).
MAX_NGRAM = 32


@dataclass(frozen=True)
class PromptLookupDrafterConfig:
    max_ngram: int = param(
        3,
        help="longest n-gram (ending at the last committed token) searched for in the context; in [1, 32]. "
        "3 as in Saxena's reference code",
    )
    min_ngram: int = param(
        1,
        help="shortest n-gram that counts as a match; in [1, max_ngram]. Shorter matches are more "
        "frequent and less often right",
    )
    confidence: float = param(
        1.0,
        help="confidence reported for every copied token (to the length controller and in "
        "Draft.confidences); in [0, 1]. 1.0: a threshold controller never cuts a copy short",
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_range("max_ngram", self.max_ngram, 1, MAX_NGRAM, integer=True)
        check_range("min_ngram", self.min_ngram, 1, self.max_ngram, integer=True)
        check_range("confidence", self.confidence, 0.0, 1.0)


@register_drafter("prompt_lookup", config=PromptLookupDrafterConfig)
class PromptLookupDrafter(Drafter):
    """Draft by copying: find the last n tokens earlier in the context and propose what followed.

    Prompt lookup decoding (Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding; in Hugging
    Face ``generate(prompt_lookup_num_tokens=...)``). The query is the n-gram ending at the last
    committed token (``state.pending``), for n from ``max_ngram`` down to ``min_ngram``; the
    longest n that occurred earlier in the prompt or the generated text wins, and the draft is the
    tokens that followed its occurrence, up to ``max_tokens``. No forward runs; the plan is
    ignored (recorded as ``Draft.plan``). Without a match the draft is empty and the round is a
    plain decoding step (the verification of ``pending`` alone).

    Departures from the reference code: (1) the *most recent* earlier occurrence is copied
    (the reference takes the first one), which follows local repetition (a list, a re-quoted
    sentence, code being edited); (2) a continuation that runs into the query is continued from
    its own output (an overlapping copy: an occurrence d tokens back proposes the last d tokens
    repeated), so a short loop still fills the draft; (3) the search is an incremental index
    (`framework.drafting.copying.NgramIndex`, O(new tokens) per round) instead of a scan of the context.
    Copied tokens report the fixed ``confidence``; for speculative sampling their draft
    distribution is one-hot, for which the acceptance test stays exact.
    """

    def __init__(self, config: PromptLookupDrafterConfig | None = None) -> None:
        super().__init__(config)
        self.reset()

    def reset(self) -> None:
        self._counts = {"rounds": 0, "matched": 0, "no_match": 0, "drafted": 0}
        self._ngram: dict[int, int] = {}
        self._seconds = 0.0
        self._index = NgramIndex(self.config.min_ngram, self.config.max_ngram)  # this generation's

    def lookup(self, state: RoundView, max_tokens: int) -> tuple[int, list[int]]:
        """``(n, candidates)``: the matched n-gram length (0: no match) and the tokens that followed
        its most recent earlier occurrence (``max_tokens`` of them, or none)."""
        t0 = time.perf_counter()
        n, cont = self._index.follow(state.token_ids()).lookup(max_tokens)
        self._seconds += time.perf_counter() - t0
        self._counts["rounds"] += 1
        if n:
            self._counts["matched"] += 1
            self._ngram[n] = self._ngram.get(n, 0) + 1
        else:
            self._counts["no_match"] += 1
        return n, cont

    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        n, cont = self.lookup(state, max_tokens)
        if not n:
            return Draft.empty(state.pending.shape[0], plan, state.device)
        draft = copy_draft(state, cont, plan, length, max_tokens, self.config.confidence)
        self._counts["drafted"] += draft.length
        return draft

    def summary(self) -> dict[str, Any]:
        return {
            **self._counts,
            "matched_ngram": {str(n): k for n, k in sorted(self._ngram.items())},
            "search_ms": round(1e3 * self._seconds, 3),
        }
