"""``fixed``: draft exactly K tokens every round (the classic speculative-decoding setting)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.config import check_range, param
from framework.fallback import DraftGate, check_fallback, fallback_param
from framework.interfaces import Draft, LengthController, PrepareContext, Verification
from framework.registry import register_length


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
class FixedLength(LengthController):
    """Draft a constant K tokens per round (Leviathan et al. 2023; the LayerSkip baseline).

    With ``fallback`` on, a `framework.fallback.DraftGate` declines rounds (plain steps) while
    drafting K tokens with the current plan is expected to be slower than plain decoding.
    """

    def __init__(self, config: FixedLengthConfig | None = None) -> None:
        super().__init__(config)
        # A fixed controller always drafts K: the gate values drafting K, not the best k <= K.
        self.gate = DraftGate.from_config(self.config, lengths="exact")

    def prepare(self, ctx: PrepareContext) -> None:
        if self.gate is not None:
            self.gate.prepare(ctx)

    def reset(self) -> None:
        if self.gate is not None:
            self.gate.reset()

    def max_length(self, state) -> int:
        k = self.config.k
        return k if self.gate is None else self.gate.limit(state, k)

    def observe(self, draft: Draft, result: Verification) -> None:
        if self.gate is not None:
            self.gate.observe(draft, result)

    def summary(self) -> dict[str, Any]:
        return {} if self.gate is None else {"fallback": self.gate.summary()}
