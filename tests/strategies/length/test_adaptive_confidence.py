"""strategies/length/adaptive_confidence.py: the exact Draft & Verify threshold update on scripted
rounds (both first-update modes, the cap rule), clipping, reset/carry, validation, the decoder."""

from __future__ import annotations

import pytest
import torch

from framework import Draft, LayerPlan, Verification
from framework.config_fields import ConfigError, build_config
from framework.drafting.gate import GateConfig, GatedLength
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.draft_steps import DraftConfidence
from framework.engine.state import DecodeState
from framework.testing import LengthControllerContract, random_prompt, synthetic_cost_model
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.adaptive_confidence import AdaptiveConfidenceLength, AdaptiveConfidenceLengthConfig
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier

Cfg = AdaptiveConfidenceLengthConfig


class TestAdaptiveConfidenceDefaultContract(LengthControllerContract):
    def make(self):
        return AdaptiveConfidenceLength()


class TestAdaptiveConfidenceCodeContract(LengthControllerContract):
    def make(self):
        return AdaptiveConfidenceLength(Cfg(first_update="code", no_decrease_at_cap=True, max_length=5))


class TestAdaptiveConfidenceFastContract(LengthControllerContract):
    # a large step so that the threshold moves visibly within the contract's few rounds
    def make(self):
        return AdaptiveConfidenceLength(Cfg(exit_threshold=0.3, step=0.5, beta2=0.0, max_length=7))


# ---- scripted rounds ---------------------------------------------------------------------------

PLAN = LayerPlan.full(4)


def _round(drafted: int, accepted: int) -> tuple[Draft, Verification]:
    """A Draft of ``drafted`` tokens and a Verification accepting the first ``accepted``."""
    assert 0 <= accepted <= drafted
    tokens = torch.arange(drafted, dtype=torch.long)[None] % 7
    new = torch.cat([tokens[:, :accepted], torch.tensor([[99]])], dim=1)
    confs = torch.full((1, drafted), 0.9)
    return Draft(tokens, PLAN, confidences=confs), Verification(torch.tensor([accepted]), new)


def _drive(ctl: AdaptiveConfidenceLength, outcomes) -> tuple[list[float], list[float]]:
    """(gamma, AR) after each scripted (drafted, accepted) round."""
    gammas, ars = [], []
    for drafted, accepted in outcomes:
        ctl.observe(None, *_round(drafted, accepted))
        gammas.append(ctl.gamma)
        ars.append(ctl.accept_rate)
    return gammas, ars


def _approx(xs):
    return pytest.approx(xs, abs=1e-12, rel=0)


# Default hyper-parameters: gamma0 0.6, step 0.01, beta1 0.5, beta2 0.9, alpha 0.85, K 12.
# gamma <- 0.9 g + 0.1 (g +- 0.01) = g +- 0.001 every round.
DEFAULT_OUTCOMES = [(4, 4), (4, 1), (3, 3), (12, 12), (0, 0), (2, 0)]


def test_defaults():
    cfg = Cfg()
    assert (cfg.exit_threshold, cfg.target_accept_rate, cfg.step, cfg.beta1, cfg.beta2) == (
        0.6,
        0.85,
        0.01,
        0.5,
        0.9,
    )
    assert (cfg.max_length, cfg.first_update, cfg.no_decrease_at_cap, cfg.carry_across_prompts) == (
        12,
        "paper",
        False,
        True,
    )
    ctl = AdaptiveConfidenceLength()
    assert ctl.needs_confidence is True
    assert ctl.max_length(None) == 12
    assert ctl.gamma == 0.6 and ctl.accept_rate == 0.0
    assert ctl.summary() == {"gamma": 0.6, "accept_rate": 0.0, "updates": 0}


def test_paper_first_update_default_sequence():
    ctl = AdaptiveConfidenceLength()
    gammas, ars = _drive(ctl, DEFAULT_OUTCOMES)
    # AR_1 = 1 (beta1 := 0) > 0.85: down.   AR = .5*1 + .5*.25 = .625: up.   .5*.625 + .5 = .8125: up.
    # .5*.8125 + .5 = .90625 > .85: down.   (0 drafted: skipped.)   .5*.90625 + 0 = .453125: up.
    assert ars == _approx([1.0, 0.625, 0.8125, 0.90625, 0.90625, 0.453125])
    assert gammas == _approx([0.599, 0.600, 0.601, 0.600, 0.600, 0.601])
    assert ctl.summary() == {"gamma": pytest.approx(0.601, abs=1e-12), "accept_rate": 0.453125, "updates": 5}


def test_code_first_update_default_sequence():
    ctl = AdaptiveConfidenceLength(Cfg(first_update="code"))
    gammas, ars = _drive(ctl, DEFAULT_OUTCOMES)
    # AR starts at 0 and beta1 applies: .5*0 + .5*1 = .5; .25 + .125 = .375; .1875 + .5 = .6875;
    # .34375 + .5 = .84375 (<= .85: still up); skipped; .421875. Every round is an increase.
    assert ars == _approx([0.5, 0.375, 0.6875, 0.84375, 0.84375, 0.421875])
    assert gammas == _approx([0.601, 0.602, 0.603, 0.604, 0.604, 0.605])


def test_no_decrease_at_cap_paper():
    ctl = AdaptiveConfidenceLength(Cfg(no_decrease_at_cap=True))
    gammas, ars = _drive(ctl, DEFAULT_OUTCOMES)
    # Round 1 (4 of 12 drafted) still goes down; round 4 (AR .90625 > .85 and 12 = K drafted) keeps gamma.
    assert ars == _approx([1.0, 0.625, 0.8125, 0.90625, 0.90625, 0.453125])
    assert gammas == _approx([0.599, 0.600, 0.601, 0.601, 0.601, 0.602])


def test_no_decrease_at_cap_code():
    outcomes = [(12, 12), (12, 12), (12, 12), (11, 11), (12, 12)]
    # AR: .5, .75, .875, .9375, .96875; the last three are > .85
    plain = AdaptiveConfidenceLength(Cfg(first_update="code"))
    gammas, ars = _drive(plain, outcomes)
    assert ars == _approx([0.5, 0.75, 0.875, 0.9375, 0.96875])
    assert gammas == _approx([0.601, 0.602, 0.601, 0.600, 0.599])
    capped = AdaptiveConfidenceLength(Cfg(first_update="code", no_decrease_at_cap=True))
    gammas, _ = _drive(capped, outcomes)
    # round 3 hit the cap: kept; round 4 drafted 11 < 12: down; round 5 hit the cap: kept
    assert gammas == _approx([0.601, 0.602, 0.602, 0.601, 0.601])


def test_non_default_hyper_parameters():
    # beta1 .25, alpha .6, step .1, beta2 .5: gamma <- .5 g + .5 (g +- .1) = g +- .05
    cfg = dict(exit_threshold=0.5, target_accept_rate=0.6, step=0.1, beta1=0.25, beta2=0.5, max_length=4)
    outcomes = [(4, 4), (4, 2), (4, 2), (2, 0), (4, 4)]
    # paper: AR 1 (down), .25 + .375 = .625 (down), .15625 + .375 = .53125 (up),
    #        .1328125 (up), .033203125 + .75 = .783203125 (down)
    gammas, ars = _drive(AdaptiveConfidenceLength(Cfg(**cfg)), outcomes)
    assert ars == _approx([1.0, 0.625, 0.53125, 0.1328125, 0.783203125])
    assert gammas == _approx([0.45, 0.40, 0.45, 0.50, 0.45])
    # paper + cap rule: rounds 1, 2 and 5 drafted K = 4 with AR > .6: kept
    gammas, _ = _drive(AdaptiveConfidenceLength(Cfg(**cfg, no_decrease_at_cap=True)), outcomes)
    assert gammas == _approx([0.5, 0.5, 0.55, 0.60, 0.60])
    # code: AR .75 (down), .1875 + .375 = .5625 (up), .140625 + .375 = .515625 (up),
    #       .12890625 (up), .0322265625 + .75 = .7822265625 (down)
    gammas, ars = _drive(AdaptiveConfidenceLength(Cfg(**cfg, first_update="code")), outcomes)
    assert ars == _approx([0.75, 0.5625, 0.515625, 0.12890625, 0.7822265625])
    assert gammas == _approx([0.45, 0.50, 0.55, 0.60, 0.55])


def test_ar_equal_to_target_raises_gamma():
    # the paper's rule is AR <= alpha -> up (the released code uses a strict <)
    ctl = AdaptiveConfidenceLength(Cfg(target_accept_rate=0.5))
    gammas, ars = _drive(ctl, [(2, 1)])
    assert ars == [0.5] and gammas == _approx([0.601])


def test_zero_drafted_round_is_skipped_and_does_not_consume_the_first_update():
    ctl = AdaptiveConfidenceLength()
    gammas, ars = _drive(ctl, [(0, 0), (0, 0), (4, 1)])
    # the first real update is the 3rd round: AR := AR_e = .25 (beta1 := 0), up
    assert ars == _approx([0.0, 0.0, 0.25]) and gammas == _approx([0.6, 0.6, 0.601])
    assert ctl.summary()["updates"] == 1


def test_step_zero_is_a_static_threshold():
    ctl = AdaptiveConfidenceLength(Cfg(step=0.0))
    gammas, _ = _drive(ctl, DEFAULT_OUTCOMES)
    assert gammas == _approx([0.6] * 6)


def test_threshold_clipped_inside_open_unit_interval():
    up = AdaptiveConfidenceLength(Cfg(exit_threshold=0.9, step=0.3, beta2=0.0, target_accept_rate=1.0))
    gammas, _ = _drive(up, [(3, 3), (3, 0), (3, 1)])
    assert gammas == _approx([0.999, 0.999, 0.999])
    down = AdaptiveConfidenceLength(Cfg(exit_threshold=0.5, step=0.3, beta2=0.0, target_accept_rate=0.0))
    gammas, _ = _drive(down, [(3, 3), (3, 3), (3, 3)])
    assert gammas == _approx([0.2, 0.001, 0.001])
    # and it climbs back from the floor by the usual step (a new generation: AR := AR_1 = 0 <= 0)
    down.reset()
    gammas, _ = _drive(down, [(3, 0)])
    assert gammas == _approx([0.301])


def test_should_continue_uses_the_current_threshold():
    ctl = AdaptiveConfidenceLength(Cfg(exit_threshold=0.5, step=0.2, beta2=0.5, max_length=4))
    assert ctl.should_continue(1, 0.5) is True  # at the threshold: continue
    assert ctl.should_continue(1, 0.55) is True
    assert ctl.should_continue(1, 0.4999) is False
    assert ctl.should_continue(3, 0.99) is True
    assert ctl.should_continue(4, 0.99) is False  # cap reached
    ctl.observe(None, *_round(4, 0))  # AR 0: up by .1
    assert ctl.gamma == pytest.approx(0.6, abs=1e-12)
    assert ctl.should_continue(1, 0.55) is False
    assert ctl.should_continue(1, 0.6) is True
    with pytest.raises(RuntimeError, match="needs draft confidences"):
        ctl.should_continue(1, None)


def test_carry_across_prompts_keeps_gamma_and_restarts_ar():
    ctl = AdaptiveConfidenceLength()
    ctl.reset()
    _drive(ctl, [(4, 4), (4, 4), (4, 4)])  # AR 1 throughout: down three times
    assert ctl.gamma == pytest.approx(0.597, abs=1e-12)
    ctl.reset()
    assert ctl.gamma == pytest.approx(0.597, abs=1e-12)
    assert ctl.summary()["accept_rate"] == 0.0 and ctl.summary()["updates"] == 0
    # the new generation's first update again sets AR := AR_1 (beta1 := 0 in paper mode)
    gammas, ars = _drive(ctl, [(4, 1)])
    assert ars == [0.25] and gammas == _approx([0.598])


def test_carry_across_prompts_code_mode_restarts_ar_at_zero():
    ctl = AdaptiveConfidenceLength(Cfg(first_update="code"))
    _drive(ctl, [(4, 4), (4, 4)])
    ctl.reset()
    gammas, ars = _drive(ctl, [(4, 4)])
    assert ars == [0.5] and gammas == _approx([0.603])


def test_no_carry_restarts_gamma():
    ctl = AdaptiveConfidenceLength(Cfg(carry_across_prompts=False))
    _drive(ctl, [(4, 4), (4, 4), (4, 4)])
    assert ctl.gamma == pytest.approx(0.597, abs=1e-12)
    ctl.reset()
    assert ctl.summary() == {"gamma": 0.6, "accept_rate": 0.0, "updates": 0}


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("v", [0.0, 1.0, 0.0005, 0.9995, -0.1, float("nan")])
def test_exit_threshold_range(v):
    with pytest.raises(ConfigError, match=r"^exit_threshold must be in \[0\.001, 0\.999\], got "):
        Cfg(exit_threshold=v)


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("target_accept_rate", -0.01, r"\[0, 1\]"),
        ("target_accept_rate", 1.01, r"\[0, 1\]"),
        ("step", -0.001, r"\[0, 1\]"),
        ("step", 1.5, r"\[0, 1\]"),
        ("beta1", 1.0, r"\[0, 1\)"),
        ("beta1", -0.5, r"\[0, 1\)"),
        ("beta2", 1.0, r"\[0, 1\)"),
        ("beta2", float("nan"), r"\[0, 1\)"),
        ("max_length", 0, r"\[1, 64\]"),
        ("max_length", 65, r"\[1, 64\]"),
    ],
)
def test_numeric_ranges(name, value, allowed):
    with pytest.raises(ConfigError, match=rf"^{name} must be (an integer )?in {allowed}, got "):
        Cfg(**{name: value})


def test_choice_fields():
    with pytest.raises(ConfigError, match=r"^first_update must be one of paper, code, got 'both'$"):
        Cfg(first_update="both")
    with pytest.raises(
        ConfigError, match=r"^no_decrease_at_cap must be a boolean \(true/false\), got 'yes'$"
    ):
        Cfg(no_decrease_at_cap="yes")
    with pytest.raises(ConfigError, match=r"^carry_across_prompts must be a boolean"):
        Cfg(carry_across_prompts=None)


def test_cli_strings_and_flag_in_message():
    cfg = build_config(
        Cfg,
        {"exit_threshold": "0.8", "first_update": "code", "no_decrease_at_cap": "true", "max_length": "8"},
    )
    assert (cfg.exit_threshold, cfg.first_update, cfg.no_decrease_at_cap, cfg.max_length) == (
        0.8,
        "code",
        True,
        8,
    )
    with pytest.raises(ConfigError, match=r"^--length\.first_update must be one of paper, code"):
        build_config(Cfg, {"first_update": "swift"}, flag_prefix="--length.")
    with pytest.raises(ConfigError, match=r"^--length\.beta2 must be in \[0, 1\), got 1\.0$"):
        build_config(Cfg, {"beta2": "1.0"}, flag_prefix="--length.")


# ---- with the real drafter and in the decoder --------------------------------------------------


def test_drafts_like_confidence_at_the_current_threshold(llama_adapter):
    plan = LayerPlan.from_indices(4, attn=[1], mlp=[2])
    ctl = AdaptiveConfidenceLength(Cfg(exit_threshold=0.3, step=0.5, beta2=0.5, max_length=8))
    for outcome in [None, (8, 0), (8, 8), (8, 8)]:
        if outcome:
            ctl.observe(None, *_round(*outcome))
        ref = ConfidenceLength(ConfidenceLengthConfig(threshold=ctl.gamma, max_length=8))
        for seed in (0, 1):
            drafts = []
            for length in (ctl, ref):
                state = DecodeState(llama_adapter, random_prompt(6, 128, seed), 64, need_confidence=True)
                state.append(state.prefill().argmax(-1)[:, None])
                drafts.append(LayerSkipDrafter().draft(state, plan, length, 8))
            assert torch.equal(drafts[0].tokens, drafts[1].tokens)


class _Spy(AdaptiveConfidenceLength):
    """Records each round's (drafted, accepted) and the threshold after it."""

    def reset(self) -> None:
        super().reset()
        self.rounds: list[tuple[int, int]] = []
        self.gammas: list[float] = []

    def observe(self, state, draft, result) -> None:
        super().observe(state, draft, result)
        self.rounds.append((draft.length, result.accepted))
        self.gammas.append(self.gamma)


@pytest.mark.parametrize("first_update", ["paper", "code"])
def test_in_decoder_matches_replay_and_stays_lossless(deep_adapters, first_update):
    adapter = deep_adapters["llama"]
    cfg = Cfg(
        exit_threshold=0.05,
        target_accept_rate=0.3,
        step=0.02,
        beta2=0.5,
        max_length=6,
        first_update=first_update,
    )
    spy = _Spy(cfg)
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.2)),
        spy,
        LayerSkipDrafter(),
        GreedyVerifier(),
    )
    replay = AdaptiveConfidenceLength(cfg)
    seen: set[float] = set()
    lengths: set[int] = set()
    for seed in (0, 1):  # two generations: gamma carries over, the replay resets like the decoder
        prompt = random_prompt(6, 128, seed)
        res = dec.generate(prompt, StopCondition(32))
        assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(32)).tokens
        assert all(d <= 6 for d, _ in spy.rounds)
        replay.reset()
        assert _drive(replay, spy.rounds)[0] == _approx(spy.gammas)
        assert res.strategy_summary["length"]["gamma"] == pytest.approx(replay.gamma, abs=1e-12)
        seen.update(round(g, 9) for g in spy.gammas)
        lengths.update(d for d, _ in spy.rounds)
    assert len(seen) > 2, "the threshold never moved: the test is vacuous"
    assert len(lengths) > 2, "the draft length never varied: the test is vacuous"


# ---- under the draft gate -----------------------------------------------------------------------


class TestAdaptiveConfidenceGatedContract(LengthControllerContract):
    def make(self):
        return GatedLength(AdaptiveConfidenceLength(Cfg(max_length=6)), GateConfig(enabled=True, probe=2))


def test_declined_rounds_leave_the_threshold_and_rate_alone():
    ctl = GatedLength(
        AdaptiveConfidenceLength(Cfg(max_length=6)), GateConfig(enabled=True, probe=3, probe_max=3)
    )
    ctl.gate.set_costs(synthetic_cost_model(4))
    ctl.reset()
    cheap = LayerPlan.from_indices(4, attn=[1, 2], mlp=[1, 2])
    ks = []
    for _ in range(5):
        k = ctl.max_length(None)
        ks.append(k)
        draft, result = _round(k, 0)
        draft.plan = cheap
        ctl.observe(None, draft, result)
    assert ks == [1, 0, 0, 0, 1]  # a first probe, declines, a probe
    # AR and gamma moved only on the two drafted rounds
    assert ctl.summary()["updates"] == 2
    s = ctl.summary()["gate"]
    assert (s["declined"], s["probes"], s["rounds"]) == (3, 2, 5)


# ---- stop_on: the top-1 probability (the paper) or the drafted token's (the released code) -------


def test_stop_on_default_and_validation():
    assert Cfg().stop_on == "top1"
    with pytest.raises(ConfigError, match=r"^stop_on must be one of top1, sampled, got 'code'$"):
        Cfg(stop_on="code")
    with pytest.raises(ConfigError, match=r"^--length\.stop_on must be one of top1, sampled"):
        build_config(Cfg, {"stop_on": "warped"}, flag_prefix="--length.")


def test_stop_on_sampled_compares_the_drafted_tokens_probability_with_gamma():
    # top-1 .9; the drafted token's unwarped probability exp(-1.5) / (1 + exp(-1.5)) ~ .18
    conf = DraftConfidence(0.9, torch.tensor([0.0, -1.5]), torch.tensor(1))
    top1 = AdaptiveConfidenceLength(Cfg(exit_threshold=0.5, step=0.5, beta2=0.0))
    sampled = AdaptiveConfidenceLength(Cfg(exit_threshold=0.5, step=0.5, beta2=0.0, stop_on="sampled"))
    assert top1.should_continue(1, conf) is True and sampled.should_continue(1, conf) is False
    # the threshold it compares with is the current gamma: lowered to .001, the token passes
    for ctl in (top1, sampled):
        ctl.observe(None, *_round(4, 4))
    assert sampled.gamma == pytest.approx(0.001) and sampled.should_continue(1, conf) is True


def test_stop_on_sampled_is_greedy_lossless_and_changes_nothing_under_greedy(deep_adapters):
    """Under greedy drafting the drafted token is the argmax: 'sampled' drafts, stops and adapts
    exactly as 'top1', and the output is vanilla greedy's."""
    adapter = deep_adapters["llama"]
    runs = {}
    for stop_on in ("top1", "sampled"):
        spy = _Spy(
            Cfg(
                exit_threshold=0.05,
                target_accept_rate=0.3,
                step=0.02,
                beta2=0.5,
                max_length=6,
                stop_on=stop_on,
            )
        )
        dec = SpeculativeDecoder(
            adapter,
            StaticSelector(StaticSelectorConfig(skip_ratio=0.2)),
            spy,
            LayerSkipDrafter(),
            GreedyVerifier(),
        )
        out = []
        for seed in (0, 1):
            prompt = random_prompt(6, 128, seed)
            res = dec.generate(prompt, StopCondition(32))
            assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(32)).tokens
            out.append((res.draft_lengths, list(spy.gammas)))
        runs[stop_on] = out
    assert runs["top1"] == runs["sampled"]
    assert len({d for lengths, _ in runs["top1"] for d in lengths}) > 2, "the draft length never varied"
