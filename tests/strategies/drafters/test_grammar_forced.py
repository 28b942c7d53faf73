"""The grammar-forced drafter under the drafter contract, with each drafter it can hand over to
(issue 54, class 3): its drafts are never longer than the ``max_tokens`` they were given, forced
runs included, neither past the length controller's cap nor past the generation's budget; where
the grammar forces tokens, it drafts them (and runs inside a draft ride along)."""

from __future__ import annotations

import pytest

from framework.testing import DrafterContract
from strategies.drafters.grammar_forced import GrammarForcedDrafter, GrammarForcedDrafterConfig
from tests.strategies.drafters.test_prompt_lookup import _LookupContract

pytest.importorskip("llguidance")


class _ForcedContract(DrafterContract):
    then = "layer_skip"

    def make(self):
        return GrammarForcedDrafter(GrammarForcedDrafterConfig(then=self.then))

    def test_forced_runs_are_drafted_and_never_refused_first(self):
        """Under the grammar some rounds draft forced tokens (the bounds are the contract's own
        test), and no verification refuses a forced token first (its row allows nothing else)."""
        forced = 0
        for _, drafter, _ in self.grammar_generations():
            forced += drafter.summary()["forced"]
            assert drafter.summary()["forced_refused"] == 0
        assert forced > 0, "the grammar forced no token in any draft"


class TestGrammarForcedContract(_ForcedContract):
    pass


class TestGrammarForcedAloneContract(_ForcedContract):
    """``then: none``: forced runs only, and a round without one is a plain step (an empty draft)."""

    then = "none"
    may_decline = True

    def test_stops_when_length_says_so(self):
        pytest.skip("drafts forced runs only: there is no draft step for a length controller to stop")


class TestGrammarForcedLookupContract(_ForcedContract):
    """On the prompt-lookup contract's states (every token in the prompt once: every round copies)."""

    then = "prompt_lookup"
    may_decline = True
    new_state = _LookupContract.new_state


class TestGrammarForcedHybridContract(_ForcedContract):
    then = "hybrid"


class TestGrammarForcedEarlyExitContract(_ForcedContract):
    then = "early_exit"


class TestGrammarForcedCascadeContract(_ForcedContract):
    then = "cascade"
    may_decline = True


def test_a_forced_run_longer_than_the_round_is_cut_at_max_tokens():
    """``max_forced`` above every round's cap: each round's forced run is cut to the cap (and to
    the budget near the end of the generation), with each length controller cap from 1 to 3."""
    contract = TestGrammarForcedAloneContract()
    for _, drafter, calls in contract.grammar_generations(((1, 12), (2, 9), (3, 30))):
        assert drafter.summary()["forced"] > 0
        assert all(length <= max_tokens for max_tokens, length, *_ in calls), calls
