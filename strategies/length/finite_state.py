"""``finite_state``: grow the draft length by one after a fully accepted round, shrink it otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework import Draft, LengthController, LengthHint, RoundView, Verification, register_length
from framework.config_fields import check_range, check_types, param


@dataclass(frozen=True)
class FiniteStateLengthConfig:
    k_init: int = param(
        4,
        help="draft length of the first round (gamma_0); in [k_min, k_max]. A paper-free default: "
        "DEL reports that FS's initial length barely matters (FS(E3-g3) ~ FS(E3-g6))",
    )
    k_min: int = param(1, help="lower clamp on the draft length; in [1, 64]")
    k_max: int = param(
        18,
        help="upper clamp on the draft length; in [k_min, 64] (the papers give no bound; 18 is DEL's d_max)",
    )
    carry_across_prompts: bool = param(
        False,
        help="keep the current length from one generation to the next instead of restarting at k_init "
        "(the papers do not say; off by default)",
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_range("k_min", self.k_min, 1, 64, integer=True)
        check_range("k_max", self.k_max, self.k_min, 64, integer=True)
        check_range("k_init", self.k_init, self.k_min, self.k_max, integer=True)


@register_length("finite_state", config=FiniteStateLengthConfig)
class FiniteStateLength(LengthController):
    """Draft K tokens, then K+1 after a fully accepted round and K-1 after a rejection, within bounds.

    The finite-state draft-length controller of Liu et al. (2025), the FS(E-gamma) baseline of DEL
    (Entezari Zarch et al., 2025). Start at ``k_init``; after each verification set
    ``K <- K + 1`` if every drafted token was accepted and ``K <- K - 1`` if any was rejected,
    clamped to ``[k_min, k_max]``. A round that drafted nothing (the decoder's token budget ran
    out) leaves K unchanged. No early stop within a round: ``should_continue`` is always ``True``.

    K restarts at ``k_init`` at every generation unless ``carry_across_prompts`` is set.

    Under the draft gate (``gate.enabled``) rounds are declined (plain steps) while drafting the
    current K with the current plan is expected to be slower than plain decoding; K is unchanged
    by declined rounds and moves by the usual rule after the gate's short probes.
    """

    # FS drafts exactly K (no early stop): the gate values drafting K, not the best k <= K.
    exact_length = True

    def __init__(self, config: FiniteStateLengthConfig | None = None) -> None:
        super().__init__(config)
        self._k = self.config.k_init
        self._rounds = 0

    @property
    def k(self) -> int:
        """The draft length the next round asks for."""
        return self._k

    def reset(self) -> None:
        if not self.config.carry_across_prompts:
            self._k = self.config.k_init
        self._rounds = 0

    def max_draft_length(self) -> int | None:
        return self.config.k_max

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        return self._k

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        drafted = draft.length
        if drafted == 0:
            return
        step = 1 if result.accepted >= drafted else -1
        self._k = min(self.config.k_max, max(self.config.k_min, self._k + step))
        self._rounds += 1

    def summary(self) -> dict[str, Any]:
        return {"k": self._k, "rounds_observed": self._rounds}
