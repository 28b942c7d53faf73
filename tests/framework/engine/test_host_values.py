"""framework/engine/host_values.py: what the engine knows on the host of a round's device values
(issue 56): the same tensor or any view of it is found without a transfer, what a round knew is
forgotten at the next round's first device work, and a state's read, upload and commit use it."""

from __future__ import annotations

import torch

from framework.engine.host_values import HostValues
from framework.engine.state import DecodeState
from framework.testing import random_prompt
from framework.testing.syncs import count_host_reads
from framework.types import Verification


def test_a_tensor_and_its_views_are_found_and_nothing_else():
    known = HostValues()
    t = torch.tensor([[4, 5, 6, 7]])
    known.remember(t[0], [4, 5, 6, 7])
    assert known.of(t) == [4, 5, 6, 7]  # the same storage, another shape
    assert known.of(t[:, 1:3]) == [5, 6]
    assert known.of(t[0, ::2]) == [4, 6]
    assert known.of(t[0, 2:][None]) == [6, 7]
    assert known.of(torch.tensor([4, 5, 6, 7])) is None  # equal values, another tensor
    assert known.of(t.float()) is None
    part = torch.tensor([1, 2, 3, 4])
    known.remember(part[:2], [1, 2])
    assert known.of(part[:2]) == [1, 2] and known.of(part) is None  # half of it unknown
    assert known.of(part[1:3]) is None


def test_what_is_known_lasts_until_the_next_rounds_device_work(llama_adapter):
    state = DecodeState(llama_adapter, random_prompt(6, 128, seed=0), 64)
    state.append(torch.tensor([[9]]), host=[9])
    out = state.forward_verify(torch.tensor([[9, 3]]))
    target = out.logits.argmax(-1)
    state.read(target=target[0])
    state.commit(Verification(num_accepted=torch.tensor([1]), new_tokens=target))
    assert state.host_values.of(target[0]) is not None  # the observers still find it
    state.forward_verify(torch.cat([state.pending, torch.tensor([[4]])], dim=1))  # the next round's
    assert state.host_values.of(target[0]) is None


def test_the_state_serves_what_it_knows_and_reads_what_it_does_not(llama_adapter):
    state = DecodeState(llama_adapter, random_prompt(6, 128, seed=0), 64)
    state.append(torch.tensor([[9]]), host=[9])
    up = state.tensor([3, 4, 5])
    out = state.forward_verify(torch.tensor([[9, 3]]))
    fresh = out.logits[0, :, :4].argmax(-1)
    with count_host_reads() as reads:
        got = state.read(a=up[1:], b=fresh)
        assert state.read(b=fresh) == {"b": got["b"]}  # read once this round: not again
    assert got["a"] == [4, 5] and reads.total == 1  # the upload cost nothing
    state.forward_verify(torch.tensor([[9, 3]]))  # another forward: its outputs are new tensors
    with count_host_reads() as reads:
        state.read(b=fresh, a=up)
    assert reads.total == 0


def test_a_commit_of_tokens_the_verifier_read_or_uploaded_reads_nothing(llama_adapter):
    state = DecodeState(llama_adapter, random_prompt(6, 128, seed=1), 64)
    state.append(torch.tensor([[9]]), host=[9])
    out = state.forward_verify(torch.tensor([[9, 3, 4]]))
    target = out.logits.argmax(-1)  # (1, 3)
    m = state.read(target=target[0])["target"]
    with count_host_reads() as reads:
        state.commit(Verification(num_accepted=torch.tensor([1]), new_tokens=target[:, :2]))
    assert reads.total == 0 and state.last_committed == m[:2] and state.token_ids()[-2:] == m[:2]
    out = state.forward_verify(torch.cat([state.pending, torch.tensor([[5]])], dim=1))
    unknown = out.logits.argmax(-1)[:, :1]
    with count_host_reads() as reads:  # a verifier that read nothing: the commit reads once
        state.commit(Verification(num_accepted=torch.tensor([0]), new_tokens=unknown))
    assert reads.total == 1 and state.last_committed == unknown[0].tolist()
