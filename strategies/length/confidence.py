"""``confidence``: stop drafting when the draft's top-1 probability falls below a threshold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from framework import LengthController, LengthHint, RoundView, register_length
from framework.config_fields import check_range, check_types, param

#: What a threshold controller compares with its threshold (``stop_on``).
STOP_ON = ("top1", "sampled")

STOP_ON_HELP = (
    "the probability compared with the threshold: 'top1', the draft's top-1 probability (Draft & "
    "Verify's Alg. 3/4: max_x q(x), of the warped q when sampling); 'sampled', the probability of the "
    "token drafted under the unwarped draft softmax (temperature 1, no top-k/top-p: Draft & Verify's "
    "released code, decoding.py, self_speculative_sample); the two agree under greedy drafting"
)


@dataclass(frozen=True)
class ConfidenceLengthConfig:
    threshold: float = param(
        0.6, help="stop drafting after a token whose top-1 draft probability is below this; in (0, 1)"
    )
    max_length: int = param(12, help="cap on the draft length of one round; in [1, 64]")
    stop_on: Literal["top1", "sampled"] = param("top1", help=STOP_ON_HELP)

    def __post_init__(self) -> None:
        check_types(self)
        check_range("threshold", self.threshold, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("max_length", self.max_length, 1, 64, integer=True)


def continue_above(
    threshold: float,
    drafted: int,
    confidence: float | None,
    max_length: int,
    who: str,
    stop_on: str = "top1",
) -> bool:
    """The confidence stop rule shared by the threshold controllers.

    Continue while the last draft token's probability is at least ``threshold`` and fewer than
    ``max_length`` tokens are drafted; the token that falls below is kept and verified (unless the
    drafter drops it). ``stop_on="top1"`` compares the top-1 probability (the confidence itself);
    ``"sampled"`` the drafted token's probability under the unwarped draft softmax
    (``DraftConfidence.sampled``; a plain float, as a copying drafter reports, is used as is).
    """
    if confidence is None:
        raise RuntimeError(f"{who} controller needs draft confidences (drafter ignored needs_confidence)")
    if stop_on == "sampled":
        confidence = getattr(confidence, "sampled", confidence)
    return confidence >= threshold and drafted < max_length


@register_length("confidence", config=ConfidenceLengthConfig)
class ConfidenceLength(LengthController):
    """Stop drafting when the draft's top-1 probability falls below a fixed threshold.

    SWIFT's confidence early stopping (eps = 0.8 there) and Draft & Verify's draft-exit rule
    without its adaptive update (gamma = 0.6 there).

    As in both papers' code, the token that falls below the threshold is kept and verified.
    ``stop_on="sampled"`` compares the drafted token's unwarped probability instead of the top-1
    probability, as Draft & Verify's released code does when it samples (the same under greedy
    drafting).

    Under the draft gate (``gate.enabled``) rounds are declined (plain steps) while no draft
    length up to ``max_length`` is expected to beat plain decoding with the current plan.
    """

    needs_confidence = True

    def max_draft_length(self) -> int | None:
        return self.config.max_length

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        return self.config.max_length

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        c = self.config
        return continue_above(c.threshold, drafted, confidence, c.max_length, "confidence", c.stop_on)
