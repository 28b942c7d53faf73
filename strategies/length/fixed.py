"""``fixed``: draft exactly K tokens every round (the classic speculative-decoding setting)."""

from __future__ import annotations

from dataclasses import dataclass

from framework import LengthController, LengthHint, RoundView, register_length
from framework.config_fields import check_range, param


@dataclass(frozen=True)
class FixedLengthConfig:
    k: int = param(4, help="draft tokens per round; in [1, 64]")

    def __post_init__(self) -> None:
        check_range("k", self.k, 1, 64, integer=True)


@register_length("fixed", config=FixedLengthConfig)
class FixedLength(LengthController):
    """Draft a constant K tokens per round (Leviathan et al. 2023; the LayerSkip baseline).

    Under the draft gate (``gate.enabled``) rounds are declined (plain steps) while drafting K
    tokens with the current plan is expected to be slower than plain decoding.
    """

    # A fixed controller always drafts K: the gate values drafting K, not the best k <= K.
    exact_length = True

    def max_draft_length(self) -> int | None:
        return self.config.k

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        return self.config.k
