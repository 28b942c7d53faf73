"""framework/engine/draft_steps.py and the pick rule it shares with the forward
(`framework.types.pick_tokens`): what a builder asks the forward to pick, and that a token picked
inside the forward gives the draft a token chosen after it gives."""

from __future__ import annotations

import pytest
import torch

from framework.engine.draft_steps import DraftSteps
from framework.engine.host_values import HostValues
from framework.types import TokenPick, pick_tokens


def test_the_pick_rule():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0 - 1e-6], [3.0, -1.0, 0.5, 0.0]], dtype=torch.float64)
    plain = pick_tokens(logits, TokenPick())
    assert plain.tokens.tolist() == [1, 0] and plain.top_p is None and plain.probs is None
    full = pick_tokens(logits, TokenPick(softmax=True, probs=True, top_k=2))
    p = torch.softmax(logits.float(), dim=-1)
    assert full.tokens.tolist() == [1, 0]
    assert torch.equal(full.top_p, p.max(dim=-1).values) and full.top_p.dtype == torch.float32
    assert torch.equal(full.probs, p)
    assert full.top_tokens.tolist() == [[1, 3], [0, 2]]  # by probability
    assert torch.equal(full.top_probs, p.topk(2, dim=-1).values)
    assert pick_tokens(logits, TokenPick(softmax=True, top_k=9)).top_tokens.shape == (2, 4)
    with pytest.raises(ValueError, match="softmax=True"):
        TokenPick(top_k=2)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        TokenPick(softmax=True, top_k=-1)


class _State:
    def __init__(self, conf=False, probs=False, top_k=0, sampler=None):
        self.draft_sampler, self.need_confidence, self.need_draft_probs = sampler, conf, probs
        self.draft_top_k = top_k
        self.pending, self.device = torch.zeros(1, 1, dtype=torch.long), torch.device("cpu")
        self.host_values = HostValues()


@pytest.mark.parametrize(("conf", "probs", "top_k"), [(False, False, 0), (True, False, 0), (True, True, 4)])
def test_a_token_picked_in_the_forward_drafts_what_the_builder_picks(conf, probs, top_k):
    state = _State(conf, probs, top_k)
    steps = torch.randn(3, 1, 16, generator=torch.Generator().manual_seed(0))
    after, inside = DraftSteps(state), DraftSteps(state)
    assert inside.pick == TokenPick(softmax=conf or probs or top_k > 0, probs=probs, top_k=top_k)
    for logits in steps:
        a = after.add(logits)
        b = inside.add(logits, picked=pick_tokens(logits, inside.pick))
        assert torch.equal(a[0], b[0]) and a[1] == b[1]
    x, y = after.build(None), inside.build(None)
    for name in ("tokens", "confidences", "probs", "top_tokens", "top_probs"):
        u, v = getattr(x, name), getattr(y, name)
        assert (u is None) == (v is None) and (u is None or torch.equal(u, v)), name


def test_sampling_picks_nothing_in_the_forward_and_one_step_is_a_view():
    sampler = lambda logits: (logits.argmax(-1), torch.softmax(logits, -1))  # noqa: E731
    assert DraftSteps(_State(sampler=sampler)).pick is None
    b = DraftSteps(_State(conf=True))
    tok, _ = b.add(torch.randn(1, 16))
    draft = b.build(None)
    assert draft.tokens.shape == (1, 1) and draft.tokens.data_ptr() == tok.data_ptr()  # no copy


# ------------------------------------------------------------------ forced tokens (DraftView.force)


def _decode_state(adapter, **flags):
    from framework.engine.state import DecodeState
    from framework.testing import random_prompt

    state = DecodeState(adapter, random_prompt(6, 128, 0), 64, **flags)
    state.append(state.prefill().argmax(-1)[:, None])
    return state


def _greedy_after(adapter, ids: list[int]) -> int:
    """The full model's greedy token after ``ids``, from a fresh cache."""
    cache = adapter.new_cache(len(ids) + 1)
    out = adapter.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    return int(out.logits[0, -1].argmax())


def test_forced_tokens_ride_along_in_the_next_draft_forward_and_come_first_in_the_draft(llama_adapter):
    state = _decode_state(llama_adapter, need_confidence=True, need_draft_probs=True)
    committed = list(state.token_ids())
    fed: list[list[int]] = []

    def after(tokens: list[int]) -> list[int]:
        fed.append(tokens)
        return [9] if len(fed) == 1 else []

    state.force([5, 7], after=after)
    assert list(state.token_ids()) == [*committed, 5, 7]  # the context a drafter continues
    t1, _ = state.draft_step(state.pending, None)
    assert state.stats.draft_forwards == 1 and state.draft_len == 3  # pending and the run: one forward
    assert int(t1) == _greedy_after(llama_adapter, [*committed, 5, 7])
    t2, _ = state.draft_step(t1.view(1, 1), None)
    assert fed == [[int(t1)]] and state.draft_len == 5  # t1, then the run `after` forced, in one forward
    assert int(t2) == _greedy_after(llama_adapter, [*committed, 5, 7, int(t1), 9])
    draft = state.drafted(None)
    assert draft.tokens[0].tolist() == [5, 7, int(t1), 9, int(t2)]
    forced = [0, 1, 3]
    assert draft.confidences[0, forced].tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(draft.probs[0, forced].argmax(-1), torch.tensor([5, 7, 9]))
    assert draft.probs[0, forced].sum(-1).tolist() == [1.0, 1.0, 1.0]  # one-hot
    assert list(state.token_ids()) == committed  # the round's draft is built: the context is committed again


def test_a_copy_after_forced_tokens_holds_them_and_leaves_them_for_a_draft_step(llama_adapter):
    state = _decode_state(llama_adapter, need_confidence=True)
    state.force([5, 7])
    copy = state.copied_draft([3, 4], None, 0.5)
    assert copy.tokens[0].tolist() == [5, 7, 3, 4] and copy.source == "lookup"
    assert copy.confidences[0].tolist() == [1.0, 1.0, 0.5, 0.5]
    t, _ = state.draft_step(state.pending, None)  # a drafter that drops the copy drafts after the run
    assert state.stats.draft_forwards == 1 and state.draft_len == 3
    assert state.drafted(None).tokens[0].tolist() == [5, 7, int(t)]
