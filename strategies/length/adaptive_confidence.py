"""``adaptive_confidence``: Draft & Verify's draft-exit threshold, adapted to a target acceptance rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from framework import Draft, LengthController, LengthHint, RoundView, Verification, register_length
from framework.config_fields import check_range, check_types, param
from strategies.length.confidence import STOP_ON_HELP, continue_above

#: The threshold is kept within [GAMMA_MIN, GAMMA_MAX], inside (0, 1).
GAMMA_MIN, GAMMA_MAX = 1e-3, 1.0 - 1e-3


@dataclass(frozen=True)
class AdaptiveConfidenceLengthConfig:
    exit_threshold: float = param(
        0.6,
        help="initial threshold gamma_0: stop drafting after a token whose top-1 draft probability is "
        "below gamma; in [0.001, 0.999]",
    )
    target_accept_rate: float = param(
        0.85, help="target acceptance rate alpha: gamma rises while the running AR is <= alpha; in [0, 1]"
    )
    step: float = param(0.01, help="epsilon: gamma_tilde = gamma +- step; in [0, 1]")
    beta1: float = param(0.5, help="smoothing of the running acceptance rate AR; in [0, 1)")
    beta2: float = param(0.9, help="smoothing of the threshold gamma; in [0, 1)")
    max_length: int = param(12, help="cap on the draft length of one round (K); in [1, 64]")
    first_update: Literal["paper", "code"] = param(
        "paper",
        help="'paper': the first update of a generation sets AR = AR_1 (beta1 := 0); 'code': AR "
        "starts at 0 and beta1 applies, halving the first estimate (the released code)",
    )
    no_decrease_at_cap: bool = param(
        False,
        help="the released code's extra rule: keep gamma (gamma_tilde = gamma) when AR > alpha "
        "and the round drafted max_length tokens",
    )
    carry_across_prompts: bool = param(
        True,
        help="keep gamma from one generation to the next, as the paper's code does (AR always restarts); "
        "false restarts gamma at exit_threshold",
    )
    stop_on: Literal["top1", "sampled"] = param("top1", help=STOP_ON_HELP)

    def __post_init__(self) -> None:
        check_types(self)
        check_range("exit_threshold", self.exit_threshold, GAMMA_MIN, GAMMA_MAX)
        check_range("target_accept_rate", self.target_accept_rate, 0.0, 1.0)
        check_range("step", self.step, 0.0, 1.0)
        check_range("beta1", self.beta1, 0.0, 1.0, hi_open=True)
        check_range("beta2", self.beta2, 0.0, 1.0, hi_open=True)
        check_range("max_length", self.max_length, 1, 64, integer=True)


@register_length("adaptive_confidence", config=AdaptiveConfidenceLengthConfig)
class AdaptiveConfidenceLength(LengthController):
    """Stop drafting below a confidence threshold that adapts so the acceptance rate tracks a target.

    Draft & Verify's adaptive draft-exit rule (Zhang et al., ACL 2024, §3.4 and App. B). Drafting
    stops after a token whose top-1 draft probability is below gamma (that token is kept and
    verified, as in the paper's code) or at ``max_length`` tokens. After each verification, with
    ``AR_e = accepted / drafted`` of that round::

        AR      <- beta1 * AR + (1 - beta1) * AR_e      (beta1 := 0 on a generation's first update)
        gamma~  <- gamma + step  if AR <= target_accept_rate  else  gamma - step
        gamma   <- beta2 * gamma + (1 - beta2) * gamma~

    and gamma is clipped to [0.001, 0.999]. A round that drafted nothing is skipped (no update).

    ``first_update="code"`` starts AR at 0 and applies beta1 on the first update too, as the
    released code does; ``no_decrease_at_cap`` adds the code's rule that keeps gamma when
    ``AR > target_accept_rate`` and the round drafted ``max_length`` tokens. The running AR
    restarts at every generation; gamma carries over (``carry_across_prompts``, as in the code,
    which passes each instance's final gamma to the next). ``stop_on="sampled"`` compares the
    drafted token's probability under the unwarped draft softmax with gamma instead of the top-1
    probability, as the released code does when it samples (``decoding.py``,
    ``self_speculative_sample``); under greedy drafting the two are the same.

    Under the draft gate (``gate.enabled``) rounds are declined (plain steps) while no draft
    length up to ``max_length`` is expected to beat plain decoding with the current plan;
    declined rounds do not update AR or gamma (they drafted nothing).
    """

    needs_confidence = True

    def __init__(self, config: AdaptiveConfidenceLengthConfig | None = None) -> None:
        super().__init__(config)
        self._gamma = float(self.config.exit_threshold)
        self._ar = 0.0
        self._updates = 0

    @property
    def gamma(self) -> float:
        """The current draft-exit threshold."""
        return self._gamma

    @property
    def accept_rate(self) -> float:
        """The running acceptance rate AR of this generation (0 before its first update)."""
        return self._ar

    def reset(self) -> None:
        if not self.config.carry_across_prompts:
            self._gamma = float(self.config.exit_threshold)
        self._ar = 0.0
        self._updates = 0

    def max_draft_length(self) -> int | None:
        return self.config.max_length

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        return self.config.max_length

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        c = self.config
        return continue_above(
            self._gamma, drafted, confidence, c.max_length, "adaptive_confidence", c.stop_on
        )

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        cfg = self.config
        drafted = draft.length
        if drafted == 0:
            return
        ar_e = result.accepted / drafted
        beta1 = 0.0 if self._updates == 0 and cfg.first_update == "paper" else cfg.beta1
        self._ar = beta1 * self._ar + (1.0 - beta1) * ar_e
        self._updates += 1
        if self._ar <= cfg.target_accept_rate:
            target = self._gamma + cfg.step
        elif cfg.no_decrease_at_cap and drafted >= cfg.max_length:
            target = self._gamma
        else:
            target = self._gamma - cfg.step
        gamma = cfg.beta2 * self._gamma + (1.0 - cfg.beta2) * target
        self._gamma = min(GAMMA_MAX, max(GAMMA_MIN, gamma))

    def summary(self) -> dict[str, Any]:
        return {"gamma": self._gamma, "accept_rate": self._ar, "updates": self._updates}
