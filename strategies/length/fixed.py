"""``fixed``: draft exactly K tokens every round (the classic speculative-decoding setting)."""

from __future__ import annotations

from dataclasses import dataclass

from framework import register_length
from framework.config import check_range, param
from framework.policies.gate import GatedLengthController, check_fallback, fallback_param


@dataclass(frozen=True)
class FixedLengthConfig:
    k: int = param(4, help="draft tokens per round; in [1, 64]")
    fallback: bool = fallback_param("fallback")
    fallback_margin: float = fallback_param("fallback_margin")
    fallback_probe: int = fallback_param("fallback_probe")
    fallback_probe_max: int = fallback_param("fallback_probe_max")
    fallback_decay: float = fallback_param("fallback_decay")

    def __post_init__(self) -> None:
        check_range("k", self.k, 1, 64, integer=True)
        check_fallback(self)


@register_length("fixed", config=FixedLengthConfig)
class FixedLength(GatedLengthController):
    """Draft a constant K tokens per round (Leviathan et al. 2023; the LayerSkip baseline).

    With ``fallback`` on, a `framework.policies.gate.DraftGate` declines rounds (plain steps) while
    drafting K tokens with the current plan is expected to be slower than plain decoding.
    """

    # A fixed controller always drafts K: the gate values drafting K, not the best k <= K.
    gate_lengths = "exact"

    def proposed_length(self, state) -> int:
        return self.config.k
