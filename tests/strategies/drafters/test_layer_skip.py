"""strategies/drafters/layer_skip.py: the contract, and that the draft is the plan's greedy model."""

from __future__ import annotations

import pytest
import torch

from framework import LayerPlan
from framework.config_fields import ConfigError, build_config
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.testing import DrafterContract, default_strategy_instance, random_prompt
from strategies.drafters.layer_skip import LayerSkipDrafter, LayerSkipDrafterConfig
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig

L = 4


class TestLayerSkipContract(DrafterContract):
    def make(self):
        return LayerSkipDrafter()


class TestLayerSkipContractQwen3(DrafterContract):
    arch = "qwen3"

    def make(self):
        return LayerSkipDrafter()


def _state(adapter, seed=0, **flags) -> DecodeState:
    state = DecodeState(adapter, random_prompt(6, 128, seed), 64, **flags)
    state.append(state.prefill().argmax(-1)[:, None])
    return state


def _plan_greedy(adapter, tokens: torch.Tensor, plan: LayerPlan, k: int) -> list[int]:
    """Greedy continuation of ``plan`` over [committed tokens (full-model KV), pending, ...],
    recomputed from scratch at every step in a brand-new cache."""
    out = []
    n_committed = tokens.shape[1] - 1
    seq = tokens
    for _ in range(k):
        cache = adapter.new_cache(seq.shape[1])
        adapter.forward(tokens[:, :n_committed], torch.arange(n_committed)[None], cache, logits_at=None)
        cache.commit(n_committed)
        t = seq.shape[1] - n_committed
        logits = adapter.forward(
            seq[:, n_committed:], torch.arange(n_committed, seq.shape[1])[None], cache, plan
        ).logits
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        assert t == len(out)
    return out


@pytest.mark.parametrize(
    "plan",
    [
        LayerPlan.from_indices(L, attn=[1], mlp=[2]),
        LayerPlan.from_indices(L, attn=[0, 1, 2, 3]),
        LayerPlan.from_indices(L, mlp=[0], exit_layer=2),
    ],
    ids=["mixed", "no_attention", "early_exit"],
)
def test_draft_is_greedy_continuation_of_the_plan(llama_adapter, plan):
    state = _state(llama_adapter, seed=1)
    want = _plan_greedy(llama_adapter, state.tokens.clone(), plan, 5)
    d = LayerSkipDrafter().draft(state, plan, FixedLength(FixedLengthConfig(k=5)), 5)
    assert d.tokens[0].tolist() == want
    assert d.plan is plan and d.confidences is None and d.probs is None
    assert state.draft_len == 5  # one forward per token: pending + the first 4 drafts


def test_full_plan_draft_is_the_vanilla_continuation(llama_adapter):
    prompt = random_prompt(6, 128, 2)
    vanilla = VanillaDecoder(llama_adapter).generate(prompt, StopCondition(7)).tokens
    state = DecodeState(llama_adapter, prompt, 64)
    state.append(state.prefill().argmax(-1)[:, None])
    d = LayerSkipDrafter().draft(state, LayerPlan.full(L), FixedLength(FixedLengthConfig(k=6)), 6)
    assert d.tokens[0].tolist() == vanilla[1:]


def test_probs_and_confidences(llama_adapter):
    plan = LayerPlan.from_indices(L, mlp=[1, 3])
    plain = LayerSkipDrafter().draft(_state(llama_adapter), plan, FixedLength(), 4)
    state = _state(llama_adapter, need_confidence=True, need_draft_probs=True)
    d = LayerSkipDrafter().draft(state, plan, FixedLength(), 4)
    assert d.probs.shape == (1, 4, 128) and d.confidences.shape == (1, 4)
    torch.testing.assert_close(d.probs.sum(-1), torch.ones(1, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(d.confidences, d.probs.max(-1).values, atol=0, rtol=0)
    # the same tokens as without probabilities: confidence bookkeeping does not change the draft
    assert torch.equal(d.tokens, plain.tokens)
    assert torch.equal(d.tokens, d.probs.argmax(-1))


def test_draft_kv_only_in_layers_run(llama_adapter):
    state = _state(llama_adapter)
    c = state.cache.committed
    LayerSkipDrafter().draft(state, LayerPlan.from_indices(L, attn=[1, 3]), FixedLength(), 3)
    assert state.cache.lengths == [c + 3, c, c + 3, c] and state.cache.committed == c


# ---- on_stop: keep or drop the token that stopped the draft (CLaSp's draft-exit, as the reference reads it)


def _confidence_draft(adapter, on_stop, threshold, seed=0, max_tokens=8, **flags):
    state = _state(adapter, seed=seed, need_confidence=True, **flags)
    length = ConfidenceLength(ConfidenceLengthConfig(threshold=threshold, max_length=8))
    drafter = LayerSkipDrafter(LayerSkipDrafterConfig(on_stop=on_stop))
    return drafter, drafter.draft(state, PLAN, length, max_tokens)


PLAN = LayerPlan.from_indices(L, attn=[1], mlp=[2])


def test_on_stop_default_and_validation():
    assert LayerSkipDrafterConfig().on_stop == "keep"
    with pytest.raises(ConfigError, match=r"^on_stop must be one of keep, drop, got 'skip'$"):
        LayerSkipDrafterConfig(on_stop="skip")
    with pytest.raises(ConfigError, match=r"^--drafter\.on_stop must be one of keep, drop"):
        build_config(LayerSkipDrafterConfig, {"on_stop": "cut"}, flag_prefix="--drafter.")
    assert LayerSkipDrafter().summary() == {}  # keep: no counter in the summary


def test_drop_discards_exactly_the_low_confidence_token(llama_adapter):
    """At a threshold between the confidences of d_j and the tokens before it, 'keep' verifies
    d_1..d_j (d_j below the threshold) and 'drop' d_1..d_{j-1}, all at or above it."""
    cases = 0
    for seed in (0, 1, 2):
        _, base = _confidence_draft(llama_adapter, "keep", 1e-9, seed=seed)
        conf = base.confidences[0].tolist()
        assert base.length == 8
        for j in range(7):  # d_8 is the cap: kept whatever on_stop says (tested below)
            hi = min(conf[:j], default=1.0)
            if hi <= conf[j]:
                continue
            t = (hi + conf[j]) / 2 if j else min(0.999, conf[0] + (1 - conf[0]) / 2)
            _, kept = _confidence_draft(llama_adapter, "keep", t, seed=seed)
            drafter, dropped = _confidence_draft(llama_adapter, "drop", t, seed=seed)
            assert kept.length == j + 1 and dropped.length == j, (seed, j, t, conf)
            assert torch.equal(kept.tokens, base.tokens[:, : j + 1])
            assert torch.equal(dropped.tokens, base.tokens[:, :j])  # the low token is not in the draft
            if j:  # (an empty draft has no confidences)
                assert dropped.confidences.shape == (1, j)
                assert all(c >= t for c in dropped.confidences[0].tolist())
            assert drafter.summary() == {"dropped": 1}
            cases += 1
    assert cases >= 3


def test_drop_can_leave_an_empty_draft_and_keeps_the_cap_token(llama_adapter):
    drafter, d = _confidence_draft(llama_adapter, "drop", 0.999)  # the first token already stops
    assert d.length == 0 and d.tokens.shape == (1, 0) and d.confidences is None
    # the token at the cap is never dropped, whatever its confidence
    _, capped = _confidence_draft(llama_adapter, "drop", 0.999, max_tokens=1)
    assert capped.length == 1
    drafter.reset()
    assert drafter.summary() == {"dropped": 0}


def test_drop_keeps_the_draft_extras_aligned(llama_adapter):
    """Probabilities and top-k candidates lose the dropped step too (sampling / tree verifiers)."""
    cases = 0
    for seed in (0, 1, 2):
        _, base = _confidence_draft(llama_adapter, "keep", 1e-9, seed=seed, need_draft_probs=True)
        conf = base.confidences[0].tolist()
        for j in range(1, 7):  # stops at d_{j+1}: d_1..d_j stay
            if min(conf[:j]) <= conf[j]:
                continue
            t = (min(conf[:j]) + conf[j]) / 2
            _, d = _confidence_draft(llama_adapter, "drop", t, seed=seed, need_draft_probs=True)
            assert d.length == j and d.probs.shape == (1, j, 128) and d.confidences.shape == (1, j)
            torch.testing.assert_close(d.probs, base.probs[:, :j], atol=0, rtol=0)
            cases += 1
    assert cases >= 1


def test_drop_refuses_a_stop_rule_on_the_sampled_token_under_speculative_sampling(llama_adapter):
    """Dropping a sampled token because of its own probability would bias speculative sampling."""
    verifier = SamplingVerifier(SamplingVerifierConfig(seed=0))
    for stop_on, ok in (("top1", True), ("sampled", False)):
        state = _state(llama_adapter, need_confidence=True, need_draft_probs=True)
        state.draft_sampler, state.random = verifier.draft_sampler(), verifier.random
        length = ConfidenceLength(ConfidenceLengthConfig(threshold=0.999, stop_on=stop_on))
        drafter = LayerSkipDrafter(LayerSkipDrafterConfig(on_stop="drop"))
        if ok:
            assert drafter.draft(state, PLAN, length, 8).length == 0
        else:
            with pytest.raises(ValueError, match="biases speculative sampling"):
                drafter.draft(state, PLAN, length, 8)


@pytest.mark.parametrize("verifier", ["greedy", "tree"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_drop_is_greedy_lossless(deep_adapters, arch, verifier):
    adapter = deep_adapters[arch]
    drafter = LayerSkipDrafter(LayerSkipDrafterConfig(on_stop="drop"))
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.3)),
        ConfidenceLength(ConfidenceLengthConfig(threshold=0.05, max_length=6)),
        drafter,
        default_strategy_instance("verifier", verifier),
    )
    dropped = 0
    for seed in (0, 1):
        prompt = random_prompt(6, 128, seed)
        want = VanillaDecoder(adapter).generate(prompt, StopCondition(24)).tokens
        res = dec.generate(prompt, StopCondition(24))
        assert res.tokens == want
        assert 0 <= res.accepted <= res.drafted
        dropped += res.strategy_summary["drafter"]["dropped"]
    assert dropped > 0, "no token was dropped: the test is vacuous"
