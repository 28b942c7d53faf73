"""Tutorial script: write, register, test and run a custom LengthController.

The page ``docs/tutorials/custom_length.md`` includes this file section by section, so the code on
the page is exactly the code that runs here. Three ways to use it:

    python docs/tutorials/custom_length.py                  # config, lossless check, contract tests
    python -m pytest -q docs/tutorials/custom_length.py     # the contract tests, through pytest
    PYTHONPATH=docs/tutorials python experiments/run.py --import custom_length --length risk_budget

Nothing is downloaded: the model of the checks is a random Llama built in-process.
"""

# --8<-- [start:controller]
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework import Draft, LengthController, LengthHint, RoundView, Verification, register_length
from framework.config_fields import check_range, param


@dataclass(frozen=True)
class RiskBudgetConfig:
    budget: float = param(
        1.0,
        help="stop drafting once the round's summed risk, the sum of (1 - top-1 draft probability) "
        "over its draft tokens, exceeds this; in (0, 64]",
    )
    max_length: int = param(12, help="cap on the draft length of one round; in [1, 64]")
    min_length: int = param(1, help="draft tokens of a round before the budget applies; in [1, max_length]")

    def __post_init__(self) -> None:
        # Each check raises ConfigError naming the field, the value and the allowed range; the
        # command line turns the field into the flag (--length.budget).
        check_range("budget", self.budget, 0.0, 64.0, lo_open=True)
        check_range("max_length", self.max_length, 1, 64, integer=True)
        # A bound that depends on another field: validate the field it depends on first.
        check_range("min_length", self.min_length, 1, self.max_length, integer=True)


@register_length("risk_budget", config=RiskBudgetConfig)
class RiskBudgetLength(LengthController):
    """Stop drafting once the summed risk (1 - top-1 probability) of the round's drafts exceeds a budget.

    A draft token's top-1 probability p estimates how likely the target agrees with it, so 1 - p
    estimates how likely it is rejected. The sum over a round's tokens bounds the chance that any of
    them is rejected (the union bound, for calibrated confidences): a budget below 1 caps that
    chance, a budget above 1 allows longer, riskier drafts. Unlike a per-token threshold
    (``confidence``), several moderately uncertain tokens end a round as surely as one very
    uncertain token. The token that crosses the budget is kept and verified, as in ``confidence``.

    A tutorial controller, not a published method.
    """

    needs_confidence = True  # the drafter passes each draft step's top-1 probability

    def __init__(self, config: RiskBudgetConfig | None = None) -> None:
        super().__init__(config)  # None: the default config
        self._risk = 0.0
        self.reset()

    def reset(self) -> None:
        """Before each generation: restart the per-generation statistics of `summary`."""
        self._rounds = 0
        self._drafted = 0
        self._accepted = 0
        self._budget_stops = 0

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        # `hint` is the selector's suggestion for the round (DEL's del_tpl gives one); this
        # controller has its own rule and ignores it.
        return self.config.max_length

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        if confidence is None:
            raise RuntimeError("risk_budget needs draft confidences (the drafter ignored needs_confidence)")
        if drafted == 1:  # the first token of a round: the drafter counts from 1 every round
            self._risk = 0.0
        self._risk += 1.0 - float(confidence)
        if drafted >= self.config.max_length:
            return False
        if drafted < self.config.min_length or self._risk <= self.config.budget:
            return True
        self._budget_stops += 1
        return False

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        if draft.length == 0:  # a round that drafted nothing (the token budget ran out)
            return
        self._rounds += 1
        self._drafted += draft.length
        self._accepted += result.accepted

    def summary(self) -> dict[str, Any]:
        return {
            "rounds": self._rounds,
            "drafted": self._drafted,
            "mean_drafted": self._drafted / self._rounds if self._rounds else 0.0,
            "acceptance_rate": self._accepted / self._drafted if self._drafted else 0.0,
            "budget_stops": self._budget_stops,
        }


# --8<-- [end:controller]


# --8<-- [start:config]
def show_config_handling() -> None:
    from framework import get_length
    from framework.config_fields import ConfigError, build_config

    assert get_length("risk_budget") is RiskBudgetLength  # what --length risk_budget looks up

    # "--length.budget 0.5 --length.max_length 8", as the command line builds it:
    cfg = build_config(RiskBudgetConfig, {"budget": "0.5", "max_length": "8"}, flag_prefix="--length.")
    print("parsed config:", cfg)

    for bad in ({"budget": "0"}, {"max_length": "8", "min_length": "9"}, {"budget": "lots"}):
        try:
            build_config(RiskBudgetConfig, bad, flag_prefix="--length.")
        except ConfigError as err:
            print("rejected:", err)


# --8<-- [end:config]


# --8<-- [start:check]
def check_lossless(budgets=(0.25, 1.0, 4.0), num_prompts: int = 3, max_new_tokens: int = 32) -> None:
    """Greedy speculative decoding with the controller emits exactly the vanilla greedy tokens."""
    import selfspec
    from framework.testing import random_prompt, tiny_model, tiny_tokenizer

    model, tokenizer = tiny_model("llama", num_layers=6), tiny_tokenizer()  # random weights, float64
    for budget in budgets:
        dec = selfspec.Decoder.from_strategies(
            selector="static",
            length=RiskBudgetLength(RiskBudgetConfig(budget=budget, max_length=8)),
            model=model,
            tokenizer=tokenizer,
            max_new_tokens=max_new_tokens,
            log=None,
            **{"selector.skip_ratio": 0.25},  # skips 2 of the 8 eligible sub-layers
        )
        drafted = accepted = rounds = 0
        for seed in range(num_prompts):
            prompt = random_prompt(8, model.config.vocab_size, seed)[0].tolist()  # token ids
            cmp = dec.compare(prompt, warmup=False)
            assert cmp.lossless, f"budget {budget}, prompt {seed}: output differs from vanilla"
            got = cmp.method.result
            drafted, accepted = drafted + got.drafted, accepted + got.accepted
            rounds += dec.strategies["length"].summary()["rounds"]  # drafting rounds of this generation
        print(
            f"budget {budget}: {num_prompts} prompts identical to vanilla; "
            f"mean draft length {drafted / max(rounds, 1):.2f}, alpha {accepted / max(drafted, 1):.2f}"
        )


# --8<-- [end:check]


# --8<-- [start:contract]
from framework.config_fields import ConfigError  # noqa: E402
from framework.testing import LengthControllerContract  # noqa: E402


class TestRiskBudgetLength(LengthControllerContract):
    """The framework's contract (inherited) plus tests of the controller's own rule."""

    def make(self):
        return RiskBudgetLength(RiskBudgetConfig(budget=1.0, max_length=6))

    def test_budget_ends_the_round(self):
        ctl = RiskBudgetLength(RiskBudgetConfig(budget=0.5, max_length=8))
        assert ctl.should_continue(1, 0.9)  # risk 0.1
        assert ctl.should_continue(2, 0.8)  # risk 0.3
        assert not ctl.should_continue(3, 0.7)  # risk 0.6 > 0.5: stop, keep this token
        assert ctl.should_continue(1, 0.9)  # the next round starts from zero risk
        assert ctl.summary()["budget_stops"] == 1

    def test_min_and_max_length(self):
        ctl = RiskBudgetLength(RiskBudgetConfig(budget=0.1, max_length=3, min_length=2))
        assert ctl.should_continue(1, 0.0)  # over budget, but fewer than min_length tokens
        assert not ctl.should_continue(2, 1.0)
        assert ctl.max_length(None) == 3
        assert not RiskBudgetLength(RiskBudgetConfig(budget=64, max_length=2)).should_continue(2, 1.0)

    def test_bad_config_is_rejected(self):
        import pytest

        with pytest.raises(ConfigError, match=r"^budget must be in \(0, 64\], got 0$"):
            RiskBudgetConfig(budget=0)
        with pytest.raises(ConfigError, match=r"^min_length must be an integer in \[1, 4\], got 5$"):
            RiskBudgetConfig(max_length=4, min_length=5)


# --8<-- [end:contract]


# --8<-- [start:run_contract]
def run_contract_tests() -> None:
    """Run every test of the class above without pytest's collection (what CI's docs test does)."""
    suite = TestRiskBudgetLength()
    names = sorted(n for n in dir(suite) if n.startswith("test_"))
    for name in names:
        getattr(suite, name)()
    print(f"contract: {len(names)} tests passed ({', '.join(names)})")


# --8<-- [end:run_contract]


# --8<-- [start:main]
if __name__ == "__main__":
    show_config_handling()
    check_lossless()
    run_contract_tests()
    print("ok")
# --8<-- [end:main]
