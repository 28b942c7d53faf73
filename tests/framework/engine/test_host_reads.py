"""Device-to-host reads per round (framework/testing/syncs.py): each one is a host-device
synchronisation on a GPU. The decode loop is held to what the algorithm needs: a greedy or sampling
round reads the device once (the verdict and the committed tokens together), a confidence-stopped
draft once more per drafted token (the stop decision), a tree round a fixed handful. Counted on CPU,
where the same calls are made."""

from __future__ import annotations

import pytest
import torch

from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition
from framework.testing import prepare_context, random_prompt, tiny_model
from framework.testing.syncs import count_host_reads
from framework.types import Verification
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier, greedy_rule
from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig
from strategies.verifiers.tree import TreeVerifier

# Once per generation: the prompt's ids into the state's host copy (a host tensor: no device wait
# even on CUDA, but counted on a CPU) and the first token after the prefill.
PREFILL_READS = 2


@pytest.fixture(scope="module")
def adapter():
    return adapter_for(tiny_model("llama", num_layers=6, seed=0))


def _decode(adapter, length, verifier, max_new: int = 40):
    dec = SpeculativeDecoder(
        adapter, StaticSelector(StaticSelectorConfig(skip_ratio=0.2)), length, LayerSkipDrafter(), verifier
    )
    dec.prepare(prepare_context(adapter))
    with torch.inference_mode(), count_host_reads() as reads:
        res = dec.generate(random_prompt(8, 128, seed=1), StopCondition(max_new))
    return res, reads


def test_a_greedy_round_with_a_fixed_length_reads_the_device_once(adapter):
    res, reads = _decode(adapter, FixedLength(FixedLengthConfig(k=3)), GreedyVerifier())
    rounds = len(res.accept_lengths)
    assert res.drafted > 0
    assert reads.total == rounds + PREFILL_READS, reads.table(rounds)


def test_a_confidence_stopped_draft_reads_once_per_drafted_token(adapter):
    length = ConfidenceLength(ConfidenceLengthConfig(threshold=0.01, max_length=4))
    res, reads = _decode(adapter, length, GreedyVerifier())
    rounds = len(res.accept_lengths)
    assert res.drafted > rounds  # several tokens per round, each one a stop decision
    assert reads.total == rounds + res.drafted + PREFILL_READS, reads.table(rounds)


def test_a_sampling_round_reads_the_device_once_plus_its_stop_decisions(adapter):
    verifier = SamplingVerifier(SamplingVerifierConfig(temperature=1.0, seed=0))
    res, reads = _decode(adapter, FixedLength(FixedLengthConfig(k=3)), verifier)
    rounds = len(res.accept_lengths)
    assert reads.total == rounds + PREFILL_READS, reads.table(rounds)


def test_a_tree_round_reads_a_fixed_handful(adapter):
    length = ConfidenceLength(ConfidenceLengthConfig(threshold=0.01, max_length=4))
    res, reads = _decode(adapter, length, TreeVerifier())
    rounds = len(res.accept_lengths)
    # per round: the draft's tokens, candidates and band probabilities together, the target's
    # choices, the bounds of the KV gather; plus the drafter's stop decisions.
    assert reads.total <= 3 * rounds + res.drafted + PREFILL_READS, reads.table(rounds)
    assert not reads.uploads, f"blocking uploads in the decode loop: {dict(reads.uploads)}"


def test_a_prompt_lookup_round_uploads_without_waiting(adapter):
    from strategies.drafters.prompt_lookup import PromptLookupDrafter

    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.0)),
        FixedLength(FixedLengthConfig(k=3)),
        PromptLookupDrafter(),
        GreedyVerifier(),
    )
    dec.prepare(prepare_context(adapter))
    prompt = torch.arange(40).remainder(7)[None] + 3  # repetitive: every round finds a match
    with torch.inference_mode(), count_host_reads() as reads:
        res = dec.generate(prompt, StopCondition(24))
    assert res.drafted > 0 and not reads.uploads, dict(reads.uploads)


def test_observers_read_accepted_from_the_shape():
    v = Verification(num_accepted=torch.tensor([2]), new_tokens=torch.tensor([[5, 6, 7]]))
    with count_host_reads() as reads:
        assert [v.accepted for _ in range(5)] == [2] * 5
    assert reads.total == 0


def test_the_counter_names_the_call_site_and_restores_torch():
    t = torch.arange(3)
    originals = (torch.Tensor.tolist, torch.tensor)
    with count_host_reads() as reads:
        t.tolist()
        int(t[0])
        torch.tensor([1, 2], device="cpu")
    assert reads.total == 2
    assert reads.at("test_host_reads.py") == 2
    assert sum(reads.uploads.values()) == 1
    assert (torch.Tensor.tolist, torch.tensor) == originals
    with count_host_reads(device_type="cuda") as reads:
        t.tolist()
        torch.tensor([1, 2], device="cpu")
    assert reads.total == 0 and not reads.uploads  # CPU tensors, when counting CUDA only


def test_the_state_keeps_row_0_on_the_host(adapter):
    from framework.engine.state import DecodeState

    state = DecodeState(adapter, random_prompt(6, 128, seed=0), 32)
    state.append(torch.tensor([[5]]))  # no host copy given: read once, on demand
    assert state.token_ids() == state.tokens[0].tolist()
    state.append(torch.tensor([[7, 8]]), host=[7, 8])
    want = state.tokens[0].tolist()
    with count_host_reads() as reads:
        assert state.token_ids() == want
    assert reads.total == 0  # everything was already on the host
    state.committed_tokens.count -= 2  # a shorter state: the copy follows
    assert state.token_ids() == want[:-2]


class _Reader:
    """A strategy whose `reads` asks for values of each chain (``compute(hidden) -> dict``)."""

    def __init__(self, compute):
        self.compute, self.chains = compute, []

    def reads(self, state, chain):
        self.chains.append(tuple(chain.shape))
        return self.compute(chain)


def _verified_state(adapter, *readers, drafts=(5, 9, 11)):
    """A state after its prefill and first token (read as the decoder reads it), with hidden
    states and ``readers``, and a chain block to verify."""
    from framework.engine.state import DecodeState

    state = DecodeState(adapter, random_prompt(8, 128, seed=0), 64, capture_hidden=True, readers=readers)
    first = state.prefill().argmax(-1)[:, None]
    state.append(first)
    state.read(token=first[0])
    return state, torch.cat([state.pending, torch.tensor([list(drafts)])], dim=1)


def test_strategies_reads_come_back_with_the_verifiers_read_by_name_and_exact(adapter):
    """`Strategy.reads`: a strategy's device values travel in the verifier's one read; each
    strategy gets its own values back by name (flattened, in order), the verifier its own, as ints
    for integer tensors."""
    a = _Reader(lambda h: {"sums": h[2, 0, :, :3].sum(-1), "ids": torch.tensor([[7, -3]])})
    b = _Reader(lambda h: {"first": h[0, 0, :1, 0]} if h.shape[2] == 8 else None)  # the prompt's only
    state, block = _verified_state(adapter, a, b)
    assert a.chains == [(7, 1, 8, 64)]  # the prompt's, at the first token's read
    assert list(state.values_for(b)) == ["first"]
    out = state.forward_verify(block, logits_at="all", rule=greedy_rule)
    accepted, target = out.ruled["accepted"], out.ruled["target"]
    with count_host_reads() as reads:
        got = state.read(accepted=accepted, target=target[0])
    assert reads.total == 1, reads.by_site
    assert got == {"accepted": accepted.tolist(), "target": target[0].tolist()}
    assert all(type(x) is int for x in got["target"])
    assert a.chains[-1] == (7, 1, 4, 64)  # L+1 = 7 layers of the verified chain, 4 positions, d = 64
    values = state.values_for(a)
    assert values["sums"] == out.hidden_states[2, 0, :, :3].sum(-1).tolist()  # float32 -> float64: exact
    assert values["ids"] == [7, -3] and state.values_for(b) == {}  # nothing this round: not the prompt's
    with count_host_reads() as reads:
        assert state.read(x=torch.tensor([1.5, 2.0])) == {"x": [1.5, 2.0]}  # served once a chain
    assert reads.total == 1 and len(a.chains) == 2


def test_a_tree_or_a_verifier_reading_by_itself_gets_its_readers_served_at_the_commit(adapter):
    """A tree's path is known only after the read, and a verifier may read by itself: the engine
    then reads the strategies' values at the commit, of the committed path (a tree's) or the
    verified chain, in one read."""
    reader = _Reader(lambda h: {"first": h[-1, 0, :, 0]})
    state, block = _verified_state(adapter, reader)
    pos = torch.arange(block.shape[1])[None] + state.pending_position
    out = state.forward_verify(block, logits_at="all", position_ids=pos)  # a tree's positions
    assert state.read(x=torch.tensor([0])) == {"x": [0]} and len(reader.chains) == 1  # not the tree
    new = state.tensor([[int(out.logits[0, 0].argmax())]])  # built on the host: known there
    tree = Verification(
        num_accepted=torch.tensor([0]),
        new_tokens=new,
        kv_keep=state.tensor([0]),
        hidden_states=out.hidden_states,
    )
    with count_host_reads() as reads:
        state.commit(tree)
    assert reads.total == 1 and reader.chains[-1] == (7, 1, 1, 64)  # the committed path: 1 node
    assert state.values_for(reader)["first"] == out.hidden_states[-1, 0, :1, 0].tolist()
    block = torch.cat([state.pending, block[:, 1:]], dim=1)
    out = state.forward_verify(block, logits_at="all")  # a chain, read by nobody
    new = state.tensor([[int(out.logits[0, 0].argmax())]])
    chain = Verification(num_accepted=torch.tensor([0]), new_tokens=new, hidden_states=out.hidden_states)
    with count_host_reads() as reads:
        state.commit(chain)
    assert reads.total == 1 and reader.chains[-1] == (7, 1, 4, 64)  # the verified chain
    assert state.values_for(reader)["first"] == out.hidden_states[-1, 0, :, 0].tolist()


def test_the_prompts_values_come_with_the_first_token(adapter):
    """What a strategy `reads` of the prompt (DEL's initialisation) comes with the first token,
    which is on the device when it is asked (a reference for the prompt's last position)."""
    from framework.engine.decoding import _prefill
    from framework.engine.state import DecodeState

    seen = []

    def compute(h):
        seen.append(state.tokens[0, 8].clone())  # the first token, on the device
        return {"last": h[-1, 0, :, 0]}

    reader = _Reader(compute)
    state = DecodeState(adapter, random_prompt(8, 128, seed=0), 64, capture_hidden=True, readers=(reader,))
    with count_host_reads() as reads:
        _, new, _ = _prefill(state, lambda logits: logits.argmax(-1), StopCondition(4))
    assert reads.total == 1, reads.by_site  # the first token, and the values with it
    assert new == [int(state.tokens[0, 8])] == [int(t) for t in seen]
    assert state.values_for(reader)["last"] == state.last_hidden_states[-1, 0, :, 0].tolist()
