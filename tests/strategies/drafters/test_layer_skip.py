"""strategies/drafters/layer_skip.py: the contract, and that the draft is the plan's greedy model."""

from __future__ import annotations

import pytest
import torch

from framework import LayerPlan
from framework.engine.decoding import StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.testing import DrafterContract, random_prompt
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.fixed import FixedLength, FixedLengthConfig

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
