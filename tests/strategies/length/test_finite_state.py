"""strategies/length/finite_state.py: validation, the +1/-1 rule on scripted rounds, clamping, reset."""

from __future__ import annotations

import pytest
import torch

from framework import Draft, LayerPlan, Verification
from framework.config_fields import ConfigError, build_config
from framework.drafting.gate import GateConfig, GatedLength
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.testing import LengthControllerContract, random_prompt, synthetic_cost_model
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.finite_state import FiniteStateLength, FiniteStateLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier


class TestFiniteStateDefaultContract(LengthControllerContract):
    def make(self):
        return FiniteStateLength()


class TestFiniteStateNarrowContract(LengthControllerContract):
    def make(self):
        return FiniteStateLength(FiniteStateLengthConfig(k_init=2, k_min=1, k_max=3))


class TestFiniteStateCarryContract(LengthControllerContract):
    def make(self):
        return FiniteStateLength(
            FiniteStateLengthConfig(k_init=6, k_min=2, k_max=9, carry_across_prompts=True)
        )


# ---- scripted rounds ---------------------------------------------------------------------------

PLAN = LayerPlan.full(4)


def _round(drafted: int, accepted: int) -> tuple[Draft, Verification]:
    """A Draft of ``drafted`` tokens and a Verification accepting the first ``accepted``."""
    assert 0 <= accepted <= drafted
    tokens = torch.arange(drafted, dtype=torch.long)[None] % 7
    new = torch.cat([tokens[:, :accepted], torch.tensor([[99]])], dim=1)
    return Draft(tokens, PLAN), Verification(torch.tensor([accepted]), new)


def _drive(ctl: FiniteStateLength, outcomes) -> list[int]:
    """Lengths asked for: before the first round, then after each scripted (drafted, accepted)."""
    ks = [ctl.max_length(None)]
    for drafted, accepted in outcomes:
        ctl.observe(None, *_round(drafted, accepted))
        ks.append(ctl.max_length(None))
    return ks


def test_defaults():
    cfg = FiniteStateLengthConfig()
    assert (cfg.k_init, cfg.k_min, cfg.k_max, cfg.carry_across_prompts) == (4, 1, 18, False)
    ctl = FiniteStateLength()
    assert ctl.needs_confidence is False
    assert ctl.max_length(None) == 4
    assert all(ctl.should_continue(i, None) is True for i in range(1, 20))


def test_exact_length_sequence():
    ctl = FiniteStateLength()
    outcomes = [(4, 4), (5, 5), (6, 2), (5, 0), (4, 4), (5, 4), (4, 4), (5, 5)]
    assert _drive(ctl, outcomes) == [4, 5, 6, 5, 4, 5, 4, 5, 6]
    assert ctl.summary() == {"k": 6, "rounds_observed": 8}


def test_one_rejection_anywhere_shrinks():
    # accepted = drafted - 1 (the last token rejected) counts as a rejection, like accepted = 0
    ctl = FiniteStateLength(FiniteStateLengthConfig(k_init=10, k_max=18))
    assert _drive(ctl, [(10, 9), (9, 0), (8, 7)]) == [10, 9, 8, 7]


def test_full_acceptance_of_a_shortened_round_grows():
    # the decoder's token budget can cut a round below K; all of it accepted still counts as +1
    ctl = FiniteStateLength(FiniteStateLengthConfig(k_init=6))
    assert _drive(ctl, [(2, 2), (1, 1)]) == [6, 7, 8]


def test_clamps_at_upper_bound():
    ctl = FiniteStateLength(FiniteStateLengthConfig(k_init=16, k_max=18))
    assert _drive(ctl, [(16, 16), (17, 17), (18, 18), (18, 18), (18, 3), (17, 17)]) == [
        16,
        17,
        18,
        18,
        18,
        17,
        18,
    ]


def test_clamps_at_lower_bound():
    ctl = FiniteStateLength(FiniteStateLengthConfig(k_init=3, k_min=2, k_max=5))
    assert _drive(ctl, [(3, 0), (2, 1), (2, 0), (2, 0), (2, 2), (3, 3), (4, 4), (5, 5)]) == [
        3,
        2,
        2,
        2,
        2,
        3,
        4,
        5,
        5,
    ]


def test_k_min_equals_k_max_is_constant():
    ctl = FiniteStateLength(FiniteStateLengthConfig(k_init=3, k_min=3, k_max=3))
    assert _drive(ctl, [(3, 3), (3, 0), (3, 3)]) == [3, 3, 3, 3]


def test_zero_drafted_round_changes_nothing():
    ctl = FiniteStateLength(FiniteStateLengthConfig(k_init=5))
    assert _drive(ctl, [(0, 0), (0, 0), (5, 5), (0, 0), (6, 1), (0, 0)]) == [5, 5, 5, 6, 6, 5, 5]
    assert ctl.summary()["rounds_observed"] == 2


def test_reset_restarts_at_k_init_by_default():
    ctl = FiniteStateLength(FiniteStateLengthConfig(k_init=4))
    _drive(ctl, [(4, 4), (5, 5), (6, 6)])
    assert ctl.max_length(None) == 7
    ctl.reset()
    assert ctl.max_length(None) == 4
    assert ctl.summary() == {"k": 4, "rounds_observed": 0}


def test_carry_across_prompts_keeps_k():
    ctl = FiniteStateLength(FiniteStateLengthConfig(k_init=4, carry_across_prompts=True))
    ctl.reset()
    assert ctl.max_length(None) == 4  # the first generation starts at k_init
    _drive(ctl, [(4, 4), (5, 5), (6, 6)])
    ctl.reset()
    assert ctl.max_length(None) == 7
    assert _drive(ctl, [(7, 0)]) == [7, 6]
    assert ctl.summary()["rounds_observed"] == 1  # the per-generation counter restarts


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("v", [0, -1, 65])
def test_k_min_range(v):
    with pytest.raises(ConfigError, match=rf"^k_min must be an integer in \[1, 64\], got {v}$"):
        FiniteStateLengthConfig(k_min=v, k_init=max(1, min(v, 18)))


@pytest.mark.parametrize(("k_min", "k_max"), [(1, 65), (1, 0), (5, 4)])
def test_k_max_range(k_min, k_max):
    with pytest.raises(ConfigError, match=rf"^k_max must be an integer in \[{k_min}, 64\], got {k_max}$"):
        FiniteStateLengthConfig(k_init=k_min, k_min=k_min, k_max=k_max)


@pytest.mark.parametrize(("k_init", "k_min", "k_max"), [(0, 1, 18), (19, 1, 18), (2, 3, 8), (9, 3, 8)])
def test_k_init_within_bounds(k_init, k_min, k_max):
    with pytest.raises(
        ConfigError, match=rf"^k_init must be an integer in \[{k_min}, {k_max}\], got {k_init}$"
    ):
        FiniteStateLengthConfig(k_init=k_init, k_min=k_min, k_max=k_max)


def test_cli_strings_and_flag_in_message():
    cfg = build_config(
        FiniteStateLengthConfig, {"k_init": "3", "k_max": "10", "carry_across_prompts": "true"}
    )
    assert (cfg.k_init, cfg.k_max, cfg.carry_across_prompts) == (3, 10, True)
    with pytest.raises(ConfigError, match=r"^--length\.k_init must be an integer in \[1, 10\], got 11$"):
        build_config(FiniteStateLengthConfig, {"k_init": "11", "k_max": "10"}, flag_prefix="--length.")


# ---- in the decoder ----------------------------------------------------------------------------


class _Spy(FiniteStateLength):
    """Records what the decoder asked for and what each round produced."""

    def reset(self) -> None:
        super().reset()
        self.asked: list[int] = []
        self.rounds: list[tuple[int, int]] = []

    def max_length(self, state, hint=None) -> int:
        k = super().max_length(state, hint)
        self.asked.append(k)
        return k

    def observe(self, state, draft, result) -> None:
        self.rounds.append((draft.length, result.accepted))
        super().observe(state, draft, result)


def _decoder(adapter, length):
    """The default drafter and verifier, a static selector skipping half the sub-layers."""
    return SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.5)),
        length,
        LayerSkipDrafter(),
        GreedyVerifier(),
    )


def test_in_decoder_follows_rule_and_stays_lossless(deep_adapters):
    adapter = deep_adapters["llama"]
    spy = _Spy(FiniteStateLengthConfig(k_init=3, k_max=6))
    dec = _decoder(adapter, spy)
    prompt, max_new = random_prompt(6, 128, 0), 40
    res = dec.generate(prompt, StopCondition(max_new))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(max_new)).tokens
    # replay the recorded rounds through a fresh controller: the same lengths come out
    replay = FiniteStateLength(FiniteStateLengthConfig(k_init=3, k_max=6))
    assert _drive(replay, spy.rounds)[:-1] == spy.asked
    # no early stop: every round drafted what it asked for, unless the token budget cut it
    generated = 1  # the prefill's token
    for k, (drafted, accepted) in zip(spy.asked, spy.rounds, strict=True):
        assert drafted == min(k, max_new - generated - 1)
        generated += accepted + 1
    assert generated == max_new
    assert len({d for d, _ in spy.rounds}) > 1, "the length never changed: the test is vacuous"
    assert res.strategy_summary["length"]["k"] == replay.max_length(None)


# ---- under the draft gate -----------------------------------------------------------------------


class TestFiniteStateGatedContract(LengthControllerContract):
    def make(self):
        return GatedLength(
            FiniteStateLength(FiniteStateLengthConfig(k_init=3, k_max=6)), GateConfig(enabled=True, probe=2)
        )


def test_declines_keep_k_and_probes_move_it():
    inner = FiniteStateLength(FiniteStateLengthConfig(k_init=4))
    # first_probe 0: the first round drafts FS's own K (the default's 1-token first probe is
    # tested in tests/framework/drafting/test_gate.py)
    ctl = GatedLength(inner, GateConfig(enabled=True, probe=2, probe_max=2, first_probe=0))
    assert FiniteStateLength.exact_length and ctl.gate.lengths == "exact"  # FS drafts exactly K
    ctl.gate.set_costs(synthetic_cost_model(4))
    cheap = LayerPlan.from_indices(4, attn=[1, 2], mlp=[1, 2])
    got, ks = [], []
    for accepted_all in (False, False, False, False, False, False, True):
        n = ctl.max_length(None)
        got.append(n)
        m = n if accepted_all else 0
        ctl.observe(
            None,
            Draft(torch.zeros(1, n, dtype=torch.long), cheap),
            Verification(torch.tensor([m]), torch.zeros(1, m + 1, dtype=torch.long)),
        )
        ks.append(inner.k)
    # K=4 rejected -> 3; two declines keep 3; a 1-token probe rejected -> 2; declines; probe accepted -> 3
    assert got == [4, 0, 0, 1, 0, 0, 1]
    assert ks == [3, 3, 3, 2, 2, 2, 3]
    assert ctl.summary()["gate"]["probes"] == 2
    assert ctl.summary()["rounds_observed"] == 3
