"""strategies/length/confidence.py: validation, the stopping rule, the cap, with the real drafter."""

from __future__ import annotations

import pytest
import torch

from framework import LayerPlan
from framework.config_fields import ConfigError, build_config
from framework.drafting.gate import GateConfig, GatedLength
from framework.engine.draft_steps import DraftConfidence, DraftSteps
from framework.engine.state import DecodeState
from framework.testing import LengthControllerContract, random_prompt, synthetic_cost_model
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig


class TestConfidenceDefaultContract(LengthControllerContract):
    def make(self):
        return ConfidenceLength()


class TestConfidenceStrictContract(LengthControllerContract):
    def make(self):
        return ConfidenceLength(ConfidenceLengthConfig(threshold=0.95, max_length=5))


class TestConfidenceLaxContract(LengthControllerContract):
    def make(self):
        return ConfidenceLength(ConfidenceLengthConfig(threshold=0.001, max_length=7))


@pytest.mark.parametrize("t", [0.0, 1.0, -0.2, 1.3, float("nan")])
def test_threshold_open_interval(t):
    with pytest.raises(ConfigError, match=r"threshold must be in \(0, 1\)"):
        ConfidenceLengthConfig(threshold=t)


@pytest.mark.parametrize("m", [0, -3, 65])
def test_max_length_in_range(m):
    with pytest.raises(ConfigError, match=r"max_length must be an integer in \[1, 64\]"):
        ConfidenceLengthConfig(max_length=m)


def test_should_continue_rule():
    ctl = ConfidenceLength(ConfidenceLengthConfig(threshold=0.6, max_length=4))
    assert ctl.needs_confidence is True
    assert ctl.max_length(None) == 4
    assert ctl.should_continue(1, 0.6) is True  # at the threshold: continue
    assert ctl.should_continue(1, 0.5999) is False
    assert ctl.should_continue(3, 0.99) is True
    assert ctl.should_continue(4, 0.99) is False  # cap reached
    with pytest.raises(RuntimeError, match="needs draft confidences"):
        ctl.should_continue(1, None)


def _state(adapter, seed=0) -> DecodeState:
    state = DecodeState(adapter, random_prompt(6, 128, seed), 64, need_confidence=True)
    state.append(state.prefill().argmax(-1)[:, None])
    return state


PLAN = LayerPlan.from_indices(4, attn=[1], mlp=[2])


def _draft(adapter, threshold, max_length, max_tokens=8, seed=0):
    ctl = ConfidenceLength(ConfidenceLengthConfig(threshold=threshold, max_length=max_length))
    return LayerSkipDrafter().draft(_state(adapter, seed), PLAN, ctl, max_tokens)


def test_stops_exactly_below_threshold_keeping_the_low_token(llama_adapter):
    for seed in (0, 1, 2):
        # the unconstrained draft: confidences c_0..c_7
        base = _draft(llama_adapter, 1e-9, 8, seed=seed)
        conf = base.confidences[0].tolist()
        assert base.length == 8
        cases = 0
        for j in range(8):
            hi = min(conf[:j], default=1.0)
            if hi > conf[j]:
                t = (hi + conf[j]) / 2 if j else min(0.999, conf[0] + (1 - conf[0]) / 2)
                d = _draft(llama_adapter, t, 8, seed=seed)
                # every kept token but the last clears the threshold; the last (low) one is kept
                assert d.length == j + 1, (seed, j, t, conf)
                assert torch.equal(d.tokens, base.tokens[:, : j + 1])
                assert float(d.confidences[0, -1]) < t
                assert all(c >= t for c in d.confidences[0, :-1].tolist())
                cases += 1
        assert cases >= 1


def test_confidences_are_top1_probabilities(llama_adapter):
    d = _draft(llama_adapter, 1e-9, 5, max_tokens=5)
    assert d.confidences.shape == (1, 5)
    assert bool(((d.confidences > 0) & (d.confidences <= 1)).all())


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_max_length_caps_the_draft(llama_adapter, cap):
    d = _draft(llama_adapter, 1e-9, cap, max_tokens=8)
    assert d.length == cap
    # and the engine's max_tokens caps it too
    d2 = _draft(llama_adapter, 1e-9, 8, max_tokens=cap)
    assert d2.length == cap


# ---- under the draft gate -----------------------------------------------------------------------


class TestConfidenceGatedContract(LengthControllerContract):
    def make(self):
        return GatedLength(
            ConfidenceLength(ConfidenceLengthConfig(threshold=0.3, max_length=6)),
            GateConfig(enabled=True, probe=2),
        )


def test_gate_gates_the_cap_not_the_stop_rule():
    ctl = GatedLength(
        ConfidenceLength(ConfidenceLengthConfig(threshold=0.5, max_length=6)),
        GateConfig(enabled=True, probe=3),
    )
    assert ctl.needs_confidence and not ctl.exact_length
    ctl.gate.set_costs(synthetic_cost_model(4))
    ctl.gate.plan = LayerPlan.from_indices(4, attn=[1, 2], mlp=[1, 2])  # break-even alpha 0.65
    ctl.gate.acc, ctl.gate.rej = 2.0, 8.0
    assert ctl.max_length(None) == 0
    assert ctl.should_continue(1, 0.9) and not ctl.should_continue(1, 0.4)  # unchanged
    ctl.gate.acc, ctl.gate.rej = 9.0, 1.0
    assert ctl.max_length(None) == 6
    s = ctl.summary()["gate"]
    assert s["alpha"] == 0.9 and s["break_even_alpha"] == 0.65 and s["costs"] == "cost_model"


def test_no_gate_of_its_own():
    ctl = ConfidenceLength()
    assert not hasattr(ctl, "gate") and ctl.summary() == {}


# ---- stop_on: the top-1 probability (the paper) or the drafted token's (Draft & Verify's code) ---


def test_stop_on_default_and_validation():
    assert ConfidenceLengthConfig().stop_on == "top1"
    with pytest.raises(ConfigError, match=r"^stop_on must be one of top1, sampled, got 'max'$"):
        ConfidenceLengthConfig(stop_on="max")
    with pytest.raises(ConfigError, match=r"^--length\.stop_on must be one of top1, sampled"):
        build_config(ConfidenceLengthConfig, {"stop_on": "argmax"}, flag_prefix="--length.")
    assert build_config(ConfidenceLengthConfig, {"stop_on": "sampled"}).stop_on == "sampled"


def test_stop_on_sampled_reads_the_drafted_tokens_unwarped_probability():
    # top-1 probability .9 (e.g. of the warped q), the drafted token's unwarped probability .2
    logits = torch.tensor([0.0, 2.0, -1.0]).log_softmax(-1)
    conf = DraftConfidence(0.9, logits, torch.tensor(0))
    assert conf.sampled == pytest.approx(float(logits.exp()[0]))
    top1 = ConfidenceLength(ConfidenceLengthConfig(threshold=0.6))
    sampled = ConfidenceLength(ConfidenceLengthConfig(threshold=0.6, stop_on="sampled"))
    assert top1.should_continue(1, conf) is True
    assert sampled.should_continue(1, conf) is False
    assert sampled.should_continue(1, DraftConfidence(0.9, logits, torch.tensor(1))) is True  # p = .84
    # a plain float (a copying drafter's fixed confidence) is its own sampled probability
    assert sampled.should_continue(1, 0.7) is True and sampled.should_continue(1, 0.5) is False
    assert sampled.should_continue(12, 0.99) is False  # the cap still applies
    with pytest.raises(RuntimeError, match="needs draft confidences"):
        sampled.should_continue(1, None)


@pytest.mark.parametrize("threshold", [0.05, 0.2, 0.4, 0.7])
def test_stop_on_sampled_is_top1_under_greedy_drafting(llama_adapter, threshold):
    """Greedy drafts the argmax: its probability is the top-1 probability, bit for bit."""
    for seed in (0, 1, 2):
        drafts = []
        for stop_on in ("top1", "sampled"):
            ctl = ConfidenceLength(ConfidenceLengthConfig(threshold=threshold, max_length=8, stop_on=stop_on))
            drafts.append(LayerSkipDrafter().draft(_state(llama_adapter, seed), PLAN, ctl, 8))
        assert torch.equal(drafts[0].tokens, drafts[1].tokens)
        assert torch.equal(drafts[0].confidences, drafts[1].confidences)
    state = _state(llama_adapter)
    _, conf = DraftSteps(state).add(torch.randn(1, 128))
    assert isinstance(conf, DraftConfidence) and conf.sampled == float(conf)


def _sampled_draft(adapter, stop_on, threshold, temperature, seed):
    """A sampled draft (the sampling verifier's draft sampler, a fresh stream of seed 0)."""
    state = DecodeState(adapter, random_prompt(6, 128, seed), 64, need_confidence=True, need_draft_probs=True)
    state.append(state.prefill().argmax(-1)[:, None])
    verifier = SamplingVerifier(SamplingVerifierConfig(temperature=temperature))
    state.draft_sampler, state.random = verifier.draft_sampler(), verifier.random
    ctl = ConfidenceLength(ConfidenceLengthConfig(threshold=threshold, max_length=8, stop_on=stop_on))
    return LayerSkipDrafter().draft(state, PLAN, ctl, 8)


def test_stop_on_sampled_stops_where_top1_would_not(llama_adapter):
    """When sampling, 'sampled' stops after the first token whose probability under the unwarped
    draft softmax (temperature 1) is below the threshold, although every top-1 probability of the
    warped q is above it; 'top1' drafts on."""
    temperature, cases = 0.5, 0
    for seed in range(6):
        base = _sampled_draft(llama_adapter, "top1", 1e-9, temperature, seed)
        assert base.length == 8
        # q = softmax(z / T) with no top-k / top-p, so the unwarped softmax(z) = softmax(T log q)
        unwarped = torch.softmax(temperature * base.probs[0].log(), dim=-1)
        p_tok = unwarped.gather(-1, base.tokens[0, :, None])[:, 0].tolist()
        top1 = base.confidences[0].tolist()
        for j in range(7):
            lo_top1 = min(top1[: j + 2])  # the top-1 rule must not stop up to d_{j+2}
            hi = min(p_tok[:j], default=1.0)
            t = (p_tok[j] + min(hi, lo_top1)) / 2
            if not p_tok[j] < t <= min(hi, lo_top1):
                continue
            got = _sampled_draft(llama_adapter, "sampled", t, temperature, seed)
            assert got.length == j + 1, (seed, j, t, p_tok, top1)
            assert torch.equal(got.tokens, base.tokens[:, : j + 1])
            assert _sampled_draft(llama_adapter, "top1", t, temperature, seed).length > j + 1
            cases += 1
            break
    assert cases >= 2, "no sampled token fell below a threshold the top-1 rule passes: vacuous"
