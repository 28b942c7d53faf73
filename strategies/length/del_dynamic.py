"""``del_dynamic``: DEL's dynamic draft-exit threshold (midpoint of matched and mismatched confidence)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework import Draft, LengthController, LengthHint, RoundView, Verification, register_length
from framework.config_fields import check_range, check_types, param
from strategies.length.confidence import continue_above


@dataclass(frozen=True)
class DelDynamicLengthConfig:
    max_length: int = param(
        18,
        help="d_max: cap on one round's draft when no selector suggests a length; in [1, 64]",
    )
    threshold: float = param(
        0.6,
        help="threshold before any statistics exist (own mode's first rounds); in (0, 1). "
        "DEL initialises from the prompt instead; 0.6 is Draft & Verify's gamma_0",
    )
    decay: float = param(0.95, help="omega of the own-statistics mode (decayed sums, as DEL's); in (0, 1]")
    use_selector_hint: bool = param(
        True,
        help="follow the selector's length and threshold (its length hint: del_tpl gives one) when "
        "there is one; false always uses this controller's own statistics",
    )
    stop_on_confidence: bool = param(
        True,
        help="stop drafting below the threshold; false drafts the full cap (with del_tpl's "
        "cap_by_length: DEL's DEL-E ablation)",
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_range("max_length", self.max_length, 1, 64, integer=True)
        check_range("threshold", self.threshold, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("decay", self.decay, 0.0, 1.0, lo_open=True)


@register_length("del_dynamic", config=DelDynamicLengthConfig)
class DelDynamicLength(LengthController):
    """Stop drafting below DEL's dynamic threshold; draft length from the selector when it has one.

    DEL (Entezari Zarch et al., 2025, §4.3): the threshold of exit layer l is the midpoint between
    the decayed mean confidence of its shadow tokens that matched the target and of those that
    did not, ``tau = (S(tcs)/S(c) + S(fcs)/S(n - c)) / 2``. ``del_tpl`` maintains it for every layer
    suggests the chosen layer's tau and the round's length cap as the round's `LengthHint`; this
    controller then drafts at most that many tokens (0: plain decoding this round) and stops after
    a token whose confidence is below tau.

    Without a hint (any other selector) the same rule runs on the draft model's own tokens: after
    each verification the accepted draft tokens count as matched and the first rejected one as
    mismatched (the window of DEL, for the one draft model there is), and the cap is
    ``max_length``. Until both kinds were seen the guards of DEL apply (matched mean 1,
    mismatched mean 0); before any statistics the threshold is ``threshold``.

    Whether the stopping token is kept or dropped is the drafter's choice (``early_exit``'s
    ``on_stop``); ``layer_skip`` keeps it.

    Under the draft gate (``gate.enabled``) the round's cap (the selector's or its own) is also
    gated on the measured acceptance and cost model: with ``del_tpl`` a round drafts only when
    both DEL's Token-per-Layer and the gate say it pays.
    """

    needs_confidence = True

    def __init__(self, config: DelDynamicLengthConfig | None = None) -> None:
        super().__init__(config)
        self.reset()

    def reset(self) -> None:
        self._tcs = self._fcs = self._c = self._f = 0.0
        self._tau = float(self.config.threshold)
        self._cap = self.config.max_length
        self._source = "own"
        self._rounds = {"selector": 0, "own": 0}
        self._no_draft = 0

    @property
    def threshold(self) -> float:
        """The threshold of the current round."""
        return self._tau

    def own_threshold(self) -> float:
        """The threshold from this controller's own decayed draft statistics."""
        if self._c + self._f <= 0:
            return float(self.config.threshold)
        matched = self._tcs / self._c if self._c > 1e-12 else 1.0
        mismatched = self._fcs / self._f if self._f > 1e-12 else 0.0
        return min(1.0, max(0.0, 0.5 * (matched + mismatched)))

    def max_draft_length(self) -> int | None:
        """Its own cap, unless it follows a selector's hints (whose lengths it does not know)."""
        return None if self.config.use_selector_hint else self.config.max_length

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        if self.config.use_selector_hint and hint is not None:
            self._cap = max(0, min(int(hint.max_length), 64))
            self._tau = float(hint.threshold) if hint.threshold is not None else self.own_threshold()
            self._source = "selector"
        else:
            self._cap = self.config.max_length
            self._tau = self.own_threshold()
            self._source = "own"
        self._rounds[self._source] += 1
        if self._cap == 0:
            self._no_draft += 1
        return self._cap

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        if not self.config.stop_on_confidence:
            return drafted < self._cap
        return continue_above(self._tau, drafted, confidence, max(self._cap, 1), "del_dynamic")

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        k = draft.length
        if k == 0 or draft.confidences is None:
            return
        w = self.config.decay
        m = result.accepted
        # what the stop rule read while drafting costs no read here, else one read of row 0
        conf = state.read(conf=draft.confidences[0])["conf"]
        # matched: the accepted drafts; mismatched: the first rejected one (if any was rejected)
        tcs = sum(conf[:m])
        fcs = conf[m] if m < k else 0.0
        self._tcs = w * self._tcs + tcs
        self._fcs = w * self._fcs + fcs
        self._c = w * self._c + m
        self._f = w * self._f + (1.0 if m < k else 0.0)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "threshold": round(self._tau, 4),
            "own_threshold": round(self.own_threshold(), 4),
            "rounds_from_selector": self._rounds["selector"],
            "rounds_own": self._rounds["own"],
            "no_draft_rounds": self._no_draft,
        }
        return out
