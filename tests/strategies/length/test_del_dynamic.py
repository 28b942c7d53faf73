"""strategies/length/del_dynamic.py: the contract, following the selector's hint, the own-statistics
midpoint threshold with DEL's guards, and validation."""

from __future__ import annotations

import pytest
import torch

from framework import Draft, LayerPlan, LengthHint, Verification
from framework.config_fields import ConfigError, build_config
from framework.drafting.gate import GateConfig, GatedLength
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.testing import LengthControllerContract, random_prompt, synthetic_cost_model
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.del_dynamic import DelDynamicLength, DelDynamicLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier


class TestDelDynamicContract(LengthControllerContract):
    def make(self):
        return DelDynamicLength()


class TestDelDynamicNoStopContract(LengthControllerContract):
    def make(self):
        return DelDynamicLength(DelDynamicLengthConfig(stop_on_confidence=False, max_length=4))


class TestDelDynamicOwnContract(LengthControllerContract):
    def make(self):
        return DelDynamicLength(DelDynamicLengthConfig(use_selector_hint=False, max_length=5, threshold=0.2))


class _Reads:
    """A round's reads, as the engine returns them (its host copies aside)."""

    def read(self, **values):
        return {k: v.reshape(-1).tolist() for k, v in values.items()}


def _round(length: DelDynamicLength, confs: list[float], accepted: int) -> None:
    k = len(confs)
    draft = Draft(
        torch.zeros(1, k, dtype=torch.long),
        LayerPlan.full(4),
        confidences=torch.tensor([confs], dtype=torch.float32) if k else None,
    )
    result = Verification(
        num_accepted=torch.tensor([accepted]), new_tokens=torch.zeros(1, accepted + 1, dtype=torch.long)
    )
    length.observe(_Reads(), draft, result)


def test_follows_the_selector_hint():
    length = DelDynamicLength()
    assert length.max_length(None, LengthHint(max_length=7, threshold=0.42, source="del_tpl")) == 7
    assert length.threshold == pytest.approx(0.42)
    assert length.should_continue(1, 0.43) and not length.should_continue(1, 0.41)
    assert not length.should_continue(7, 0.99)  # the hint's cap
    assert length.max_length(None, LengthHint(max_length=0, threshold=0.5)) == 0  # plain decoding
    # a hint without threshold: this controller's own
    assert length.max_length(None, LengthHint(max_length=3)) == 3 and length.threshold == pytest.approx(0.6)
    summ = length.summary()
    assert summ["rounds_from_selector"] == 3 and summ["no_draft_rounds"] == 1
    # hints ignored on request
    own = DelDynamicLength(DelDynamicLengthConfig(use_selector_hint=False, max_length=9))
    assert own.max_length(
        None, LengthHint(max_length=2, threshold=0.9)
    ) == 9 and own.threshold == pytest.approx(0.6)


def test_without_confidence_stop_drafts_the_cap():
    length = DelDynamicLength(DelDynamicLengthConfig(stop_on_confidence=False))
    assert length.max_length(None, LengthHint(max_length=3, threshold=0.9)) == 3
    assert length.should_continue(1, 0.01) and length.should_continue(2, None)
    assert not length.should_continue(3, 0.99)


def test_own_statistics_midpoint_and_guards():
    length = DelDynamicLength(DelDynamicLengthConfig(decay=1.0, threshold=0.3))
    assert length.max_length(None, None) == 18 and length.threshold == pytest.approx(0.3)  # no data yet
    _round(length, [0.9, 0.7, 0.4, 0.2], accepted=2)  # matched .9, .7; first rejected .4
    length.max_length(None, None)
    assert length.threshold == pytest.approx((0.8 + 0.4) / 2)
    _round(length, [0.5], accepted=1)  # fully accepted: no mismatch added
    length.max_length(None, None)
    assert length.threshold == pytest.approx(((0.9 + 0.7 + 0.5) / 3 + 0.4) / 2)
    only_matched = DelDynamicLength(DelDynamicLengthConfig(decay=1.0))
    _round(only_matched, [0.8, 0.6], accepted=2)
    assert only_matched.own_threshold() == pytest.approx(0.35)  # mismatched mean := 0
    only_missed = DelDynamicLength(DelDynamicLengthConfig(decay=1.0))
    _round(only_missed, [0.2, 0.9], accepted=0)
    assert only_missed.own_threshold() == pytest.approx(0.6)  # matched mean := 1
    _round(only_missed, [], accepted=0)  # an empty round changes nothing
    assert only_missed.own_threshold() == pytest.approx(0.6)
    only_missed.reset()
    assert only_missed.own_threshold() == pytest.approx(0.6) and only_missed.summary()["rounds_own"] == 0


def test_decay():
    length = DelDynamicLength(DelDynamicLengthConfig(decay=0.5))
    _round(length, [1.0, 0.0], accepted=1)  # matched 1.0, mismatched 0.0
    _round(length, [0.5, 0.5], accepted=1)  # matched .5, mismatched .5
    # matched: (.5 * 1 + .5) / (.5 + 1) = 2/3; mismatched: (.5 * 0 + .5) / 1.5 = 1/3
    assert length.own_threshold() == pytest.approx(0.5)


def test_own_mode_with_a_layer_skip_draft_is_lossless(llama_adapter):
    dec = SpeculativeDecoder(
        llama_adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.5)),
        DelDynamicLength(DelDynamicLengthConfig(threshold=0.05)),
        LayerSkipDrafter(),
        GreedyVerifier(),
    )
    for seed in (0, 1):
        prompt = random_prompt(6, 128, seed)
        res = dec.generate(prompt, StopCondition(24))
        assert res.tokens == VanillaDecoder(llama_adapter).generate(prompt, StopCondition(24)).tokens
        assert res.strategy_summary["length"]["rounds_own"] == len(res.accept_lengths)
        assert res.strategy_summary["length"]["rounds_from_selector"] == 0


def test_bad_input():
    with pytest.raises(ConfigError, match=r"^--length\.max_length must be an integer in \[1, 64\], got 0$"):
        build_config(DelDynamicLengthConfig, {"max_length": "0"}, flag_prefix="--length.")
    for t in (0.0, 1.0):
        with pytest.raises(ConfigError, match=r"threshold must be in \(0, 1\)"):
            DelDynamicLengthConfig(threshold=t)
    with pytest.raises(ConfigError, match=r"decay must be in \(0, 1\], got 1\.5"):
        DelDynamicLengthConfig(decay=1.5)
    with pytest.raises(RuntimeError, match="del_dynamic controller needs draft confidences"):
        DelDynamicLength().should_continue(1, None)


# ---- under the draft gate -----------------------------------------------------------------------


class TestDelDynamicGatedContract(LengthControllerContract):
    def make(self):
        return GatedLength(DelDynamicLength(), GateConfig(enabled=True, probe=2))


class TestDelDynamicOwnGatedContract(LengthControllerContract):
    def make(self):
        cfg = DelDynamicLengthConfig(use_selector_hint=False, max_length=5)
        return GatedLength(DelDynamicLength(cfg), GateConfig(enabled=True, probe=2))


def test_gate_gates_the_hint_and_leaves_its_zero_alone():
    length = GatedLength(DelDynamicLength(), GateConfig(enabled=True, probe=4))
    length.gate.set_costs(synthetic_cost_model(4))
    exit2 = LayerPlan.from_indices(4, exit_layer=2)  # 0.1 + 2 * 0.225 = 0.55 steps
    length.gate.plan = exit2
    length.gate.acc, length.gate.rej = 1.0, 9.0  # alpha 0.1: drafting does not pay
    hint = LengthHint(max_length=7, threshold=0.5)
    assert length.max_length(None, hint) == 0  # the gate declines the selector's 7
    _round(length, [], 0)
    assert length.max_length(None, LengthHint(max_length=0, threshold=0.5)) == 0  # the selector's own 0
    _round(length, [], 0)
    s = length.summary()
    assert s["no_draft_rounds"] == 1 and s["gate"]["declined"] == 1 and s["gate"]["rounds"] == 2
    assert length.gate.plan == exit2  # empty drafts do not change the costed plan
    length.gate.acc, length.gate.rej = 9.0, 1.0
    assert length.max_length(None, hint) == 7
