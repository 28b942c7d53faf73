"""``fixed``: draft exactly K tokens every round (the classic speculative-decoding setting)."""

from __future__ import annotations

from dataclasses import dataclass

from framework.config import check_range, param
from framework.interfaces import LengthController
from framework.registry import register_length


@dataclass(frozen=True)
class FixedLengthConfig:
    k: int = param(4, help="draft tokens per round; in [1, 64]")

    def __post_init__(self) -> None:
        check_range("k", self.k, 1, 64, integer=True)


@register_length("fixed", config=FixedLengthConfig)
class FixedLength(LengthController):
    """Draft a constant K tokens per round (Leviathan et al. 2023; the LayerSkip baseline)."""

    def max_length(self, state) -> int:
        return self.config.k
