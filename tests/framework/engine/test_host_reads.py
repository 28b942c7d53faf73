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
from strategies.verifiers.greedy import GreedyVerifier
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


def test_observers_read_accepted_from_the_host_copy():
    v = Verification(
        num_accepted=torch.tensor([2]), new_tokens=torch.tensor([[5, 6, 7]]), host_tokens=(5, 6, 7)
    )
    with count_host_reads() as reads:
        assert [v.accepted for _ in range(5)] == [2] * 5
    assert reads.total == 0
    lazy = Verification(num_accepted=torch.tensor([1]), new_tokens=torch.tensor([[3, 4]]))
    with count_host_reads() as reads:
        assert [lazy.accepted for _ in range(5)] == [1] * 5
        assert lazy.committed_host() == (3, 4)
    assert reads.total == 1  # read once, then cached


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
    assert state.host_tokens() == state.tokens[0].tolist()
    state.append(torch.tensor([[7, 8]]), host=[7, 8])
    want = state.tokens[0].tolist()
    with count_host_reads() as reads:
        assert state.host_tokens() == want
    assert reads.total == 0  # everything was already on the host
    state.num_tokens -= 2  # a shorter state: the copy follows
    assert state.host_tokens() == want[:-2]


def _verified_state(adapter, drafts=(5, 9, 11)):
    """A state after its prefill and first token, with hidden states, and a chain block to verify."""
    from framework.engine.state import DecodeState

    state = DecodeState(adapter, random_prompt(8, 128, seed=0), 64, capture_hidden=True)
    state.append(state.prefill().argmax(-1)[:, None])
    return state, torch.cat([state.pending, torch.tensor([list(drafts)])], dim=1)


def test_a_ride_comes_back_with_the_verifiers_read_aligned_and_exact(adapter):
    """`RoundView.ride`: a strategy's device values travel in the verifier's one read; each ride
    gets its own values back (flattened, in order), the verifier its own, as ints."""
    state, block = _verified_state(adapter)
    shapes = []
    a = state.ride(lambda h: shapes.append(tuple(h.shape)) or h[2, 0, :, :3].sum(-1))  # float32 (T,)
    b = state.ride(lambda h: torch.tensor([[7, -3]]))  # an integer matrix: flattened
    c = state.ride(lambda h: None)  # nothing this round
    out = state.forward_verify(block, logits_at="all", check=True)
    with count_host_reads() as reads:
        row = state.read(out.checked.packed)
    assert reads.total == 1, reads.by_site
    assert row == out.checked.packed.tolist() and all(type(x) is int for x in row)
    assert shapes == [(7, 1, 4, 64)]  # L+1 = 7 layers of the verified chain, 4 positions, d = 64
    assert a.values == out.hidden_states[2, 0, :, :3].sum(-1).tolist()  # float32 -> float64: exact
    assert b.values == [7.0, -3.0] and c.values is None
    with count_host_reads() as reads:
        assert state.read(torch.tensor([1.5, 2.0])) == [1.5, 2.0]  # the rides went with the last read
    assert reads.total == 1


def test_a_ride_runs_on_chains_only_and_lasts_one_round(adapter):
    state, block = _verified_state(adapter)
    pos = torch.arange(block.shape[1])[None] + state.pending_position
    tree = state.ride(lambda h: pytest.fail("computed on a block given its own positions (a tree)"))
    state.forward_verify(block, logits_at="all", position_ids=pos)
    assert state.read(torch.tensor([0])) == [0] and tree.values is None
    # registered, never read (a verifier reading by itself), committed: gone the next round
    stale = state.ride(lambda h: pytest.fail("a ride outlived its round"))
    state.forward_verify(block, logits_at="all")
    new = block[:, :1]
    state.commit(Verification(num_accepted=torch.tensor([0]), new_tokens=new, host_tokens=(int(new[0, 0]),)))
    out = state.forward_verify(torch.cat([state.pending, block[:, 1:]], dim=1), logits_at="all", check=True)
    state.read(out.checked.packed)
    assert stale.values is None


def test_a_ride_registered_before_the_prefill_reads_the_prompts_hidden_states(adapter):
    """What `LayerSelector.begin` registers runs on the prompt and comes with the first token."""
    from framework.engine.decoding import _prefill
    from framework.engine.state import DecodeState

    state = DecodeState(adapter, random_prompt(8, 128, seed=0), 64, capture_hidden=True)
    ride = state.ride(lambda h: h[-1, 0, :, 0])  # (P,): one number per prompt position
    with count_host_reads() as reads:
        _, new, _ = _prefill(state, lambda logits: logits.argmax(-1), StopCondition(4))
    assert reads.total == 1, reads.by_site  # the first token, and the ride with it
    assert new == [int(state.tokens[0, 8])]
    assert ride.values == state.last_hidden_states[-1, 0, :, 0].tolist()
