"""strategies/verifiers/greedy.py: the contract and the exact longest-matching-prefix rule."""

from __future__ import annotations

import pytest
import torch

from framework import Draft, LayerPlan
from framework.engine.decoding import StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.testing import VerifierContract, random_prompt
from strategies.verifiers.greedy import GreedyVerifier

L = 4
K = 5


class TestGreedyContract(VerifierContract):
    def make(self):
        return GreedyVerifier()


class TestGreedyContractMistral(VerifierContract):
    arch = "mistral"

    def make(self):
        return GreedyVerifier()


@pytest.fixture(scope="module")
def vanilla(llama_adapter):
    return VanillaDecoder(llama_adapter).generate(random_prompt(6, 128, 3), StopCondition(K + 2)).tokens


def _state(adapter, capture_hidden=False) -> DecodeState:
    state = DecodeState(adapter, random_prompt(6, 128, 3), 64, capture_hidden=capture_hidden)
    state.append(state.prefill().argmax(-1)[:, None])
    return state


@pytest.mark.parametrize("j", list(range(K + 1)))
def test_accepts_longest_matching_prefix(llama_adapter, vanilla, j):
    """Draft = the target's own continuation with position j corrupted: exactly j accepted, then the
    target's token at j (the correction), or the bonus token when nothing was corrupted (j == K)."""
    target = vanilla[1 : K + 2]  # what the target emits after pending: K + 1 tokens
    draft_tokens = list(target[:K])
    if j < K:
        draft_tokens[j] = (draft_tokens[j] + 1) % 128
        # corrupt a later token too: acceptance must stop at the first mismatch
        if j + 2 < K:
            draft_tokens[j + 2] = (draft_tokens[j + 2] + 7) % 128
    state = _state(llama_adapter)
    draft = Draft(torch.tensor([draft_tokens]), LayerPlan.full(L))
    res = GreedyVerifier().verify(state, draft)
    assert res.accepted == j
    assert res.new_tokens[0].tolist() == target[: j + 1]
    assert res.target_tokens.shape == (1, K + 1)
    assert res.target_tokens[0, : j + 1].tolist() == target[: j + 1]
    assert res.kv_keep is None and res.hidden_states is None
    state.commit(res)
    assert state.new_tokens[0].tolist() == vanilla[: j + 2]


def test_empty_draft_gives_next_token(llama_adapter, vanilla):
    state = _state(llama_adapter)
    res = GreedyVerifier().verify(state, Draft.empty(1, LayerPlan.full(L)))
    assert res.accepted == 0 and res.new_tokens[0].tolist() == [vanilla[1]]


def test_hidden_states_when_captured(llama_adapter, vanilla):
    state = _state(llama_adapter, capture_hidden=True)
    draft = Draft(torch.tensor([vanilla[1:4]]), LayerPlan.full(L))
    res = GreedyVerifier().verify(state, draft)
    assert res.accepted == 3
    assert res.hidden_states.shape == (L + 1, 1, 4, 64)
    assert state.last_hidden_states is res.hidden_states


def test_choose_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]], dtype=torch.float64)
    assert GreedyVerifier().choose(logits).tolist() == [1]
    assert GreedyVerifier.needs_draft_probs is False
