"""strategies/verifiers/tree.py: tree construction, mask, bands, path acceptance and KV compaction."""

from __future__ import annotations

import pytest
import torch

from framework import Draft, LayerPlan
from framework.config_fields import ConfigError
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.kv_cache import KVCache
from framework.engine.state import DecodeState
from framework.testing import VerifierContract, random_prompt
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.tree import (
    TreeVerifier,
    TreeVerifierConfig,
    build_tree,
    node_picks,
    tree_mask,
    tree_nodes,
    tree_shape,
)

L = 4


class TestTreeContract(VerifierContract):
    def make(self):
        return TreeVerifier()


class TestTreeContractQwen2(VerifierContract):
    arch = "qwen2"

    def make(self):
        return TreeVerifier(TreeVerifierConfig(band_widths=(10, 8, 5, 3)))


def test_build_tree_hangs_alternatives_off_the_chain():
    tokens, parents, depths = build_tree([5, 6, 7], [[5, 1, 2], [9, 6, 3], [7, 4, 8]], [3, 2, 1])
    # depth 1: chain 5 (node 1) + alternatives 1, 2; depth 2: chain 6 (node 4) + best other 9;
    # depth 3: chain 7 only. Parents: the root for depth 1, then the previous chain node.
    assert tokens == [5, 1, 2, 6, 9, 7]
    assert parents == [0, 0, 0, 1, 1, 4]
    assert depths == [1, 1, 1, 2, 2, 3]


def test_tree_mask_is_ancestors_and_self():
    _, parents, _ = build_tree([5, 6, 7], [[5, 1, 2], [9, 6, 3], [7, 4, 8]], [3, 2, 1])
    m = tree_mask(parents)
    assert m.shape == (7, 7)
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 3}, 4: {0, 1, 4}, 5: {0, 1, 5}, 6: {0, 1, 4, 6}}
    for i, seen in want.items():
        assert set(torch.nonzero(m[i]).flatten().tolist()) == seen


@pytest.mark.parametrize(
    "p, width",
    [(0.01, 10), (0.5, 10), (0.5001, 5), (0.8, 5), (0.81, 3), (0.95, 3), (0.951, 1), (1.0, 1)],
)
def test_bands_follow_the_paper(p, width):
    assert TreeVerifier().widths([p]) == [width]
    assert TreeVerifier().draft_top_k() == 10


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"temperature": 0.7},
            "temperature must be 0 (tree verification is greedy only; for sampling use --verifier sampling",
        ),
        (
            {"band_edges": (0.8, 0.5), "band_widths": (3, 2, 1)},
            "band_edges must be strictly increasing values in (0, 1)",
        ),
        ({"band_edges": (0.5,), "band_widths": (3, 2, 1)}, "band_widths must be 2 widths"),
        ({"band_widths": (10, 5, 3, 0)}, "band_widths must be an integer in [1, 64]"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ConfigError) as err:
        TreeVerifierConfig(**kwargs)
    assert message in str(err.value)


def _fresh_kv(adapter, tokens: torch.Tensor, n: int):
    cache = KVCache(
        adapter.arch.num_layers,
        1,
        adapter.arch.num_kv_heads,
        adapter.arch.head_dim,
        n + 4,
        adapter.arch.dtype,
    )
    adapter.forward(tokens[:, :n], torch.arange(n)[None], cache, logits_at=None)
    return cache.keys[:, :, :, :n], cache.values[:, :, :, :n]


def test_an_accepted_alternative_commits_its_path_and_kv(llama_adapter):
    """The chain token is wrong but the target's token is the second candidate: the leaf is
    accepted (m = 1), the target's next token follows, and the committed KV equals a fresh
    prefill of the committed tokens (the leaf's KV was gathered into place)."""
    prompt = random_prompt(6, 128, 5)
    want = VanillaDecoder(llama_adapter).generate(prompt, StopCondition(4)).tokens
    state = DecodeState(llama_adapter, prompt, 64)
    state.append(state.prefill().argmax(-1)[:, None])
    wrong = (want[1] + 1) % 128
    other = (want[1] + 2) % 128
    draft = Draft(
        torch.tensor([[wrong]]),
        LayerPlan.full(L),
        top_tokens=torch.tensor([[[wrong, other, want[1]]]]),
        top_probs=torch.tensor([[[0.3, 0.2, 0.1]]]),
    )
    res = TreeVerifier().verify(state, draft)
    assert res.accepted == 1
    assert res.new_tokens[0].tolist() == want[1:3]
    assert res.kv_keep.tolist() == [0, 3]  # root, then the third candidate of depth 1
    state.commit(res)
    assert state.new_tokens[0].tolist() == want[:3]
    k, v = _fresh_kv(llama_adapter, state.tokens, state.cache.committed)
    c = state.cache.committed
    torch.testing.assert_close(state.cache.keys[:, :, :, :c], k, rtol=0, atol=1e-10)
    torch.testing.assert_close(state.cache.values[:, :, :, :c], v, rtol=0, atol=1e-10)


def test_tree_accepts_at_least_as_much_as_the_chain(deep_adapters):
    """Same drafts, same prompts: the tree's accepted length is never below the chain's, and both
    equal vanilla decoding."""
    from strategies.verifiers.greedy import GreedyVerifier

    adapter = deep_adapters["llama"]
    for seed in range(3):
        prompt = random_prompt(8, 128, seed)
        want = VanillaDecoder(adapter).generate(prompt, StopCondition(30)).tokens
        runs = {}
        for ver in (GreedyVerifier(), TreeVerifier()):
            dec = SpeculativeDecoder(
                adapter,
                StaticSelector(StaticSelectorConfig(skip_ratio=0.5)),
                FixedLength(FixedLengthConfig(k=4)),
                LayerSkipDrafter(),
                ver,
            )
            runs[type(ver).__name__] = dec.generate(prompt, StopCondition(30))
            assert runs[type(ver).__name__].tokens == want
        assert runs["TreeVerifier"].mean_accepted_length >= runs["GreedyVerifier"].mean_accepted_length


def test_a_deep_tree_path_commits_its_kv_and_hands_its_hidden_states_to_the_selectors(llama_adapter):
    """The chain is right at depth 1 and wrong at depth 2, where the target's token is the third
    candidate hung off the chain node: the path root -> chain node -> depth-2 alternative is
    accepted (m = 2). The committed KV equals a fresh prefill of the committed tokens, and
    `Verification.path_hidden` (what CLaSp's DP and DEL's statistics read) holds, column by
    column, the full model's states of exactly those committed positions: not the chain's
    rejected node, not a neighbour in the tree's node order."""
    prompt = random_prompt(6, 128, 7)
    want = VanillaDecoder(llama_adapter).generate(prompt, StopCondition(6)).tokens
    state = DecodeState(llama_adapter, prompt, 64, capture_hidden=True)
    state.append(state.prefill().argmax(-1)[:, None])
    start = state.cache.committed  # position of the pending token
    wrong2, other2 = (want[2] + 1) % 128, (want[2] + 2) % 128
    wrong3 = (want[3] + 1) % 128
    draft = Draft(
        torch.tensor([[want[1], wrong2, wrong3]]),
        LayerPlan.full(L),
        top_tokens=torch.tensor([[[want[1], 9, 10], [wrong2, other2, want[2]], [wrong3, 11, 12]]]),
        top_probs=torch.tensor([[[0.3, 0.2, 0.1], [0.3, 0.2, 0.1], [0.3, 0.2, 0.1]]]),
    )
    ver = TreeVerifier(TreeVerifierConfig(band_edges=(0.5, 0.8, 0.95), band_widths=(3, 3, 3, 1)))
    res = ver.verify(state, draft)
    assert res.accepted == 2
    assert res.new_tokens[0].tolist() == want[1:4]
    keep = res.kv_keep.tolist()
    assert keep[:2] == [0, 1] and keep[2] > 3  # the chain node at depth 1, then a depth-2 alternative
    hs = res.path_hidden  # (L+1, 1, m+1, d)
    state.commit(res)
    assert state.new_tokens[0].tolist() == want[:4]
    c = state.cache.committed
    k, v = _fresh_kv(llama_adapter, state.tokens, c)
    torch.testing.assert_close(state.cache.keys[:, :, :, :c], k, rtol=0, atol=1e-10)
    torch.testing.assert_close(state.cache.values[:, :, :, :c], v, rtol=0, atol=1e-10)
    # The full model's hidden states of the committed positions, from a fresh forward.
    fresh = KVCache(
        llama_adapter.arch.num_layers,
        1,
        llama_adapter.arch.num_kv_heads,
        llama_adapter.arch.head_dim,
        c + 4,
        llama_adapter.arch.dtype,
    )
    out = llama_adapter.forward(state.tokens[:, :c], torch.arange(c)[None], fresh, capture_hidden=True)
    assert hs.shape[2] == 3
    torch.testing.assert_close(hs[:, 0], out.hidden_states[:, 0, start : start + 3], rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_the_device_tree_has_build_trees_nodes_and_shape(seed):
    """`tree_nodes` (on the device, without reading the draft) and `tree_shape` (from the widths)
    build what `build_tree` builds from host lists, whether or not the chain token is among its
    depth's candidates."""
    g = torch.Generator().manual_seed(seed)
    k, w = 5, 6
    top = torch.stack([torch.randperm(20, generator=g)[:w] for _ in range(k)])
    chain = top[:, 0].clone()
    chain[1] = top[1, 3]  # a tie broken differently: the chain token is not the first candidate
    chain[3] = next(t for t in range(20) if t not in top[3].tolist())  # nor among them (sampled)
    widths = [int(x) for x in torch.randint(1, w + 1, (k,), generator=g)]
    widths[3] = w  # without the chain token among them, w alternatives would exist: w - 1 are taken
    tokens, parents, depths = build_tree(chain.tolist(), top.tolist(), widths)
    assert tree_nodes(chain, top, widths, torch.tensor(node_picks(widths, w))).tolist() == tokens
    assert tree_shape(widths) == (parents, depths)


def test_tree_nodes_refuses_more_width_than_candidates():
    with pytest.raises(ValueError, match="need 4 candidates per depth; the draft has 3"):
        tree_nodes(torch.tensor([1]), torch.tensor([[1, 2, 3]]), [4], torch.tensor([0]))
