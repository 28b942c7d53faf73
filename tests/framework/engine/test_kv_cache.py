"""framework.engine.kv_cache and the DecodeState forwards: the cache invariants of docs/concepts.md,
checked against fresh full forwards.

Central invariant: whatever sequence of draft steps (random skip plans), verifications, commits,
scratch passes and rollbacks ran, slots ``[0, committed)`` of every layer hold exactly the KV that
a fresh full prefill over the committed tokens computes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework import LayerPlan, Verification
from framework.engine.kv_cache import KVCache
from framework.engine.state import DecodeState
from framework.testing import random_prompt
from framework.testing.syncs import count_host_reads
from strategies.verifiers.greedy import greedy_rule

ATOL = 1e-10
V = 128
L = 4


def _pos(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)[None]


def fresh_prefill_kv(adapter, tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values (L, B, H, n, D) of a full forward over ``tokens[:, :n]`` in a new cache."""
    cache = adapter.new_cache(max(n, 1))
    if n:
        adapter.forward(tokens[:, :n], _pos(0, n), cache, logits_at=None)
    return cache.keys[:, :, :, :n].clone(), cache.values[:, :, :, :n].clone()


def assert_committed_matches_fresh(state: DecodeState) -> None:
    c = state.cache.committed
    assert c == state.num_tokens - 1, "between operations: committed == num_tokens - 1"
    keys, values = fresh_prefill_kv(state.adapter, state.tokens, c)
    torch.testing.assert_close(state.cache.keys[:, :, :, :c], keys, atol=ATOL, rtol=0)
    torch.testing.assert_close(state.cache.values[:, :, :, :c], values, atol=ATOL, rtol=0)
    assert all(n >= c for n in state.cache.lengths)


def reference_plan_logits(adapter, tokens: torch.Tensor, start: int, plan: LayerPlan | None) -> torch.Tensor:
    """Logits of ``plan`` over ``tokens[:, start:]`` attending to the full model's KV of
    ``tokens[:, :start]`` (computed in a brand-new cache)."""
    n = tokens.shape[1]
    cache = adapter.new_cache(n)
    if start:
        adapter.forward(tokens[:, :start], _pos(0, start), cache, logits_at=None)
        cache.commit(start)
    return adapter.forward(tokens[:, start:], _pos(start, n - start), cache, plan).logits


def snapshot(cache: KVCache):
    return (
        list(cache.lengths),
        cache.committed,
        [cache.keys[i, :, :, : cache.lengths[i]].clone() for i in range(cache.num_layers)],
        [cache.values[i, :, :, : cache.lengths[i]].clone() for i in range(cache.num_layers)],
    )


def assert_snapshot_equal(a, b) -> None:
    assert a[0] == b[0] and a[1] == b[1]
    for x, y in zip(a[2] + a[3], b[2] + b[3], strict=True):
        assert torch.equal(x, y), "bit-identical KV expected"


def new_state(adapter, prompt_len: int, capacity: int, seed: int = 0) -> DecodeState:
    state = DecodeState(adapter, random_prompt(prompt_len, V, seed), capacity)
    logits = state.prefill()
    state.append(logits.argmax(-1)[:, None])
    return state


# ------------------------------------------------------------------------------ random sequences

_bits = st.lists(st.booleans(), min_size=L, max_size=L)
_plan = st.builds(
    lambda a, m, e: LayerPlan(tuple(a), tuple(m), e), _bits, _bits, st.none() | st.integers(1, L)
)
_tok = st.integers(0, V - 1)

_ops = st.one_of(
    st.tuples(st.just("draft"), _plan, st.lists(_tok, min_size=0, max_size=3)),
    st.tuples(
        st.just("verify_commit"),
        st.lists(_tok, min_size=0, max_size=4),
        st.integers(0, 4),
        _tok,
        st.booleans(),
    ),
    st.tuples(st.just("verify_rollback"), st.lists(_tok, min_size=0, max_size=3)),
    st.tuples(st.just("scratch"), st.floats(0, 1), st.none() | _plan),
    st.tuples(st.just("rollback")),
    st.tuples(
        st.just("reuse_round"),
        st.integers(1, L - 1),
        st.lists(_tok, min_size=0, max_size=3),
        st.integers(1, 4),
        st.lists(_tok, min_size=0, max_size=2),
        st.integers(0, 5),
        _tok,
    ),
)


def _apply(state: DecodeState, op) -> None:
    kind = op[0]
    if kind == "draft":
        _, plan, extra = op
        state.discard_draft()  # a new round; the draft's KV then stays for later ops to clean up
        # one draft round: pending first, then the extra tokens; each step checked against a
        # fresh forward of the plan over the round's tokens so far
        fed = [int(state.pending)]
        for tok in [None, *extra]:
            x = state.pending if tok is None else torch.tensor([[tok]])
            if tok is not None:
                fed.append(tok)
            out = state.forward_draft(x, plan, logits_at="last")
            seq = torch.cat([state.tokens, torch.tensor([fed[1:]], dtype=torch.long)], dim=1)
            want = reference_plan_logits(state.adapter, seq, state.cache.committed, plan)[:, -1:]
            torch.testing.assert_close(out.logits, want, atol=1e-8, rtol=0)
    elif kind == "verify_commit":
        _, extra, m, bonus, via_state = op
        block = torch.cat([state.pending, torch.tensor([extra], dtype=torch.long).reshape(1, -1)], dim=1)
        t = block.shape[1]
        m = min(m, t - 1)
        c = state.cache.committed
        out = state.forward_verify(block, logits_at="all")
        want = reference_plan_logits(state.adapter, torch.cat([state.tokens, block[:, 1:]], 1), c, None)
        torch.testing.assert_close(out.logits, want, atol=1e-8, rtol=0)
        new = torch.cat([block[:, 1 : m + 1], torch.tensor([[bonus]])], dim=1)
        if via_state:
            state.commit(Verification(num_accepted=torch.tensor([m]), new_tokens=new))
        else:
            state.cache.commit(m + 1)
            state.append(new)
            state.draft_len = 0
        assert state.cache.committed == c + m + 1
        assert state.cache.lengths == [c + m + 1] * L
    elif kind == "verify_rollback":
        _, extra = op
        block = torch.cat([state.pending, torch.tensor([extra], dtype=torch.long).reshape(1, -1)], dim=1)
        state.forward_verify(block, logits_at="last")
        state.discard_draft()
    elif kind == "scratch":
        _, frac, plan = op
        end = state.cache.committed
        if end < 1:
            return
        start = min(end - 1, int(frac * end))
        before = snapshot(state.cache)
        out = state.forward_scratch(start, plan, logits_at="all")
        assert_snapshot_equal(snapshot(state.cache), before)
        want = reference_plan_logits(state.adapter, state.tokens[:, :end], start, plan)
        torch.testing.assert_close(out.logits, want, atol=1e-8, rtol=0)
    elif kind == "rollback":
        state.discard_draft()
        assert state.cache.lengths == [state.cache.committed] * L and state.draft_len == 0
    elif kind == "reuse_round":
        # an early-exit draft declared reusable, then a chain verification of (a cut of) it plus
        # possibly other tokens: reused where the block starts with the fed tokens, else recomputed
        _, e, extra, cut, more, m, bonus = op
        state.discard_draft()
        fed = [int(state.pending), *extra]
        for tok in fed:
            state.forward_draft(torch.tensor([[tok]]), state.prefix_plan(e), reusable=True)
        block_list = fed[:cut] + more
        block = torch.tensor([block_list])
        t = block.shape[1]
        n = min(len(fed), t)
        reused = block_list[:n] == fed[:n]
        c, saved = state.cache.committed, state.stats.verify_blocks_saved
        out = state.forward_verify(block, logits_at="all")
        assert state.stats.verify_blocks_saved - saved == (e * n if reused else 0)
        want = reference_plan_logits(state.adapter, torch.cat([state.tokens, block[:, 1:]], 1), c, None)
        torch.testing.assert_close(out.logits, want, atol=1e-8, rtol=0)
        m = min(m, t - 1)
        state.commit(
            Verification(
                num_accepted=torch.tensor([m]), new_tokens=torch.tensor([block_list[1 : m + 1] + [bonus]])
            )
        )
        assert state.cache.lengths == [c + m + 1] * L


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    prompt_len=st.integers(1, 6),
    slack=st.integers(0, 6),
    ops=st.lists(_ops, min_size=1, max_size=8),
)
def test_committed_kv_matches_fresh_prefill(llama_adapter, prompt_len, slack, ops):
    # a small capacity (down to the prompt length) makes the buffers grow along the way
    state = new_state(llama_adapter, prompt_len, prompt_len + slack)
    assert_committed_matches_fresh(state)
    for op in ops:
        _apply(state, op)
        assert_committed_matches_fresh(state)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_committed_kv_other_archs(adapters, arch):
    """A fixed operation sequence on the other architectures (biases, q/k norms, head_dim != d/H)."""
    adapter = adapters[arch]
    state = new_state(adapter, 4, 6, seed=3)
    plan = LayerPlan.from_indices(L, attn=[1, 2], mlp=[0])
    ops = [
        ("draft", plan, [5, 6]),
        ("verify_commit", [5, 6, 7], 2, 9, True),
        ("scratch", 0.3, plan),
        ("draft", LayerPlan.from_indices(L, mlp=[3], exit_layer=2), [1]),
        ("scratch", 0.0, None),
        ("verify_commit", [1, 2], 0, 3, False),
        ("verify_rollback", [4]),
        ("verify_commit", [], 0, 11, True),
    ]
    for op in ops:
        _apply(state, op)
        assert_committed_matches_fresh(state)


# ------------------------------------------------------------------------------ draft KV layout


def test_draft_writes_only_layers_it_runs(llama_adapter):
    state = new_state(llama_adapter, 5, 16)
    c = state.cache.committed
    plan = LayerPlan.from_indices(L, attn=[0, 2], exit_layer=3)
    state.forward_draft(state.pending, plan)
    state.forward_draft(torch.tensor([[7]]), plan)
    # attention of blocks 0 and 2 skipped, block 3 exited: only block 1 holds the two draft slots
    assert state.cache.lengths == [c, c + 2, c, c]
    assert state.draft_len == 2
    state.discard_draft()
    assert state.cache.lengths == [c] * L and state.draft_len == 0


# ------------------------------------------------------------------------------ tree verification


def _tree_mask(parents: list[int]) -> torch.Tensor:
    """(T, T) ancestor-or-self mask of a tree given each node's parent (node 0 is the root)."""
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


@st.composite
def _trees(draw):
    n = draw(st.integers(2, 7))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(_tok, min_size=n - 1, max_size=n - 1))
    leaf = draw(st.integers(0, n - 1))
    return parents, tokens, leaf


@settings(max_examples=12, deadline=None, derandomize=True)
@given(tree=_trees(), bonus=_tok)
def test_tree_commit_gathers_path(llama_adapter, tree, bonus):
    parents, toks, leaf = tree
    state = new_state(llama_adapter, 4, 32, seed=1)  # growth is covered by test_tree_commit_after_growth_*
    c = state.cache.committed
    block = torch.cat([state.pending, torch.tensor([toks])], dim=1)  # node 0 is pending
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    pos = torch.tensor([[c + d for d in depth]])
    # first dirty the slots with a draft, as a real round would
    state.forward_draft(state.pending, LayerPlan.from_indices(L, mlp=[1]))
    out = state.forward_verify(block, position_ids=pos, tree_mask=_tree_mask(parents), logits_at="all")
    path = []
    j = leaf
    while j >= 0:
        path.append(j)
        j = parents[j]
    path = path[::-1]  # root (pending) .. leaf
    path_tokens = block[:, path]
    # the tree pass's logits at every node equal a plain forward of that node's root path
    seq = torch.cat([state.tokens, path_tokens[:, 1:]], dim=1)
    want = reference_plan_logits(llama_adapter, seq, c, None)
    torch.testing.assert_close(out.logits[:, path], want, atol=1e-8, rtol=0)
    keep = torch.tensor(path)
    new = torch.cat([path_tokens[:, 1:], torch.tensor([[bonus]])], dim=1)
    state.commit(Verification(num_accepted=torch.tensor([len(path) - 1]), new_tokens=new, kv_keep=keep))
    assert state.cache.committed == c + len(path)
    assert torch.equal(state.tokens[:, c:], torch.cat([path_tokens, torch.tensor([[bonus]])], dim=1))
    assert_committed_matches_fresh(state)


def test_tree_commit_after_growth_outside_inference_mode(llama_adapter):
    state = new_state(llama_adapter, 4, 4, seed=1)  # capacity == prompt: the verify below grows it
    c = state.cache.committed
    block = torch.cat([state.pending, torch.tensor([[5, 6]])], dim=1)
    parents = [-1, 0, 0]
    state.forward_verify(block, position_ids=torch.tensor([[c, c + 1, c + 1]]), tree_mask=_tree_mask(parents))
    state.commit(
        Verification(
            num_accepted=torch.tensor([1]), new_tokens=torch.tensor([[6, 1]]), kv_keep=torch.tensor([0, 2])
        )
    )
    assert_committed_matches_fresh(state)


def test_tree_commit_after_growth_inside_inference_mode(llama_adapter):
    """The same sequence works inside inference mode (as SpeculativeDecoder.generate runs it)."""
    with torch.inference_mode():
        state = new_state(llama_adapter, 4, 4, seed=1)
        c = state.cache.committed
        block = torch.cat([state.pending, torch.tensor([[5, 6]])], dim=1)
        state.forward_verify(
            block, position_ids=torch.tensor([[c, c + 1, c + 1]]), tree_mask=_tree_mask([-1, 0, 0])
        )
        new = torch.tensor([[6, 1]])
        state.commit(
            Verification(num_accepted=torch.tensor([1]), new_tokens=new, kv_keep=torch.tensor([0, 2]))
        )
        assert state.cache.capacity > 4
        assert_committed_matches_fresh(state)


# ------------------------------------------------------------------------------ KVCache unit tests


def test_capacity_growth_keeps_contents():
    cache = KVCache(num_layers=2, batch=1, num_kv_heads=2, head_dim=3, capacity=2, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    written_k, written_v = [], []
    for step in range(5):
        t = 1 + step % 2
        cache.begin(t)
        for layer in range(2):
            k = torch.randn(1, 2, t, 3, generator=g, dtype=torch.float64)
            v = torch.randn(1, 2, t, 3, generator=g, dtype=torch.float64)
            ks, vs = cache.update(k, v, layer)
            assert ks.shape[2] == cache.lengths[layer] + t
            if layer == 0:
                written_k.append(k)
                written_v.append(v)
        cache.end()
        cache.commit(t)
    total = sum(1 + s % 2 for s in range(5))
    assert cache.committed == total and cache.capacity >= total
    k0, v0 = cache.committed_kv(0)
    assert torch.equal(k0, torch.cat(written_k, dim=2)) and torch.equal(v0, torch.cat(written_v, dim=2))


def test_decode_state_with_tiny_capacity(llama_adapter):
    state = new_state(llama_adapter, 6, capacity=6)
    for k in (3, 5, 2):
        state.forward_draft(state.pending, LayerPlan.from_indices(L, attn=[1]))
        block = torch.cat([state.pending, torch.arange(k)[None]], dim=1)
        state.forward_verify(block)
        new = torch.cat([block[:, 1:], torch.tensor([[k]])], dim=1)  # all k accepted + a bonus
        state.commit(Verification(num_accepted=torch.tensor([k]), new_tokens=new))
    assert state.cache.capacity >= state.cache.committed
    assert_committed_matches_fresh(state)


def test_decode_state_capacity_below_prompt(llama_adapter):
    state = new_state(llama_adapter, 6, capacity=1)
    assert state.tokens.shape == (1, 7)
    assert_committed_matches_fresh(state)


def test_commit_more_than_written_raises(llama_adapter):
    state = new_state(llama_adapter, 4, 16)
    c = state.cache.committed
    state.forward_verify(torch.cat([state.pending, torch.tensor([[1, 2]])], dim=1))
    with pytest.raises(ValueError, match="cannot commit 4 positions"):
        state.cache.commit(4)
    assert state.cache.committed == c
    with pytest.raises(ValueError, match="keep has 1 offsets, expected 2"):
        state.cache.commit(2, keep=torch.tensor([0]))
    state.cache.commit(3)  # exactly what was written is fine
    assert state.cache.committed == c + 3


def test_commit_after_partial_draft_raises(llama_adapter):
    """A draft that skipped some layer's attention does not hold committable positions there."""
    state = new_state(llama_adapter, 4, 16)
    state.forward_draft(state.pending, LayerPlan.from_indices(L, attn=[2]))
    with pytest.raises(ValueError, match=r"layers \[2\]"):
        state.cache.commit(1)


def test_commit_keep_beyond_written_raises(llama_adapter):
    state = new_state(llama_adapter, 4, 16)
    state.forward_verify(torch.cat([state.pending, torch.tensor([[1, 2]])], dim=1))  # 3 verified slots
    with pytest.raises(ValueError):
        state.cache.commit(2, keep=torch.tensor([0, 5]))


def test_commit_checks_host_offsets_without_reading_the_device(llama_adapter):
    """Offsets the verifier built on the host (``keep_host``) are checked there: the commit makes
    no device read, moves the same KV as with the tensor alone, and still refuses offsets past the
    verified block."""
    from framework.testing.syncs import count_host_reads

    a, b = new_state(llama_adapter, 4, 16), new_state(llama_adapter, 4, 16)
    for state in (a, b):
        state.forward_verify(torch.cat([state.pending, torch.tensor([[1, 2]])], dim=1))
    with count_host_reads() as reads:
        a.cache.commit(2, keep=torch.tensor([0, 2]), keep_host=(0, 2))
    assert reads.total == 0
    b.cache.commit(2, keep=torch.tensor([0, 2]))
    assert torch.equal(a.cache.keys, b.cache.keys) and torch.equal(a.cache.values, b.cache.values)
    c = new_state(llama_adapter, 4, 16)
    c.forward_verify(torch.cat([c.pending, torch.tensor([[1, 2]])], dim=1))
    with pytest.raises(ValueError, match="keep offsets must be in"):
        c.cache.commit(2, keep=torch.tensor([0, 5]), keep_host=(0, 5))


def test_chain_commit_does_not_allocate(llama_adapter):
    state = new_state(llama_adapter, 4, 32)
    kptr, vptr = state.cache.keys.data_ptr(), state.cache.values.data_ptr()
    for _ in range(3):
        state.forward_draft(state.pending, LayerPlan.from_indices(L, mlp=[0]))
        state.forward_draft(torch.tensor([[3]]), LayerPlan.from_indices(L, mlp=[0]))
        state.forward_verify(torch.cat([state.pending, torch.tensor([[3, 4]])], dim=1))
        state.commit(Verification(num_accepted=torch.tensor([1]), new_tokens=torch.tensor([[3, 9]])))
        assert state.cache.keys.data_ptr() == kptr and state.cache.values.data_ptr() == vptr
    assert_committed_matches_fresh(state)


def test_begin_end_protocol():
    cache = KVCache(2, 1, 1, 2, capacity=4)
    with pytest.raises(RuntimeError, match="without begin"):
        cache.end()
    with pytest.raises(RuntimeError, match="outside begin"):
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 0)
    cache.begin(1)
    with pytest.raises(RuntimeError, match="twice"):
        cache.begin(1)
    assert cache.attention_mask(0) is None  # a plain single-token step: SDPA's fast path
    cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 0)
    cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 1)
    cache.end()
    cache.commit(1)
    with pytest.raises(ValueError, match="cannot overwrite committed"):
        cache.begin(2, base=0)
    cache.begin(2, base=0, persist=False)  # scratch may read-only address committed slots
    cache.end()
    assert cache.lengths == [1, 1] and cache.committed == 1


def test_end_truncates_layers_not_written_at_explicit_base():
    """A forward at an explicit base that skips a layer leaves that layer's stale slots beyond base
    dropped (its end pointer becomes min(old, base)); written layers end at base + T."""
    cache = KVCache(3, 1, 1, 2, capacity=8)
    cache.lengths = [5, 5, 2]
    cache.committed = 2
    cache.begin(2, base=3)
    cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    cache.end()
    assert cache.lengths == [5, 3, 2]
    cache.begin(1)  # appending (base None): untouched layers keep their pointer
    cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 2)
    cache.end()
    assert cache.lengths == [5, 3, 3]


def test_attention_mask_layout():
    cache = KVCache(1, 1, 1, 2, capacity=8)
    cache.lengths = [3]
    cache.committed = 3
    cache.begin(2, base=5, visible=2, persist=False)
    mask = cache.attention_mask(0)
    cache.end()
    allowed = mask[0, 0] == 0
    assert mask.shape == (1, 1, 2, 7)
    expect = torch.tensor(
        [[1, 1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 1, 1]], dtype=torch.bool
    )  # visible prefix, hidden [2, 5), causal block
    assert torch.equal(allowed, expect)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    cache.begin(3, base=3, tree_mask=tree)
    allowed = cache.attention_mask(0)[0, 0] == 0
    cache.end()
    assert torch.equal(allowed[:, :3], torch.ones(3, 3, dtype=torch.bool)) and torch.equal(
        allowed[:, 3:], tree
    )


def test_causal_only_iff_the_mask_is_plain_causal():
    """`causal_only` (the fused kernel then limits rows itself) holds exactly when the mask is
    the causal one: every earlier slot visible, no tree."""
    cache = KVCache(1, 1, 1, 2, capacity=16)
    cache.lengths = [4]
    cache.committed = 4
    cases = [
        (dict(num=3), True),
        (dict(num=1), True),
        (dict(num=2, base=2, persist=False), True),  # scratch over the whole visible prefix
        (dict(num=2, base=4, visible=2, persist=False), False),  # hidden slots
        (dict(num=2, tree_mask=torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)), False),
    ]
    for kw, want in cases:
        num = kw.pop("num")
        cache.begin(num, **kw)
        assert cache.causal_only(0) is want
        mask = cache.attention_mask(0)
        if want and mask is not None:
            causal = torch.ones(num, num, dtype=torch.bool).tril()
            allowed = mask[0, 0] == 0
            assert allowed[:, : allowed.shape[1] - num].all() and torch.equal(allowed[:, -num:], causal)
        cache.end()


def test_scratch_span_out_of_range(llama_adapter):
    state = new_state(llama_adapter, 3, 8)
    end = state.cache.committed
    for bad in (-1, end, end + 3):
        with pytest.raises(ValueError, match="scratch span"):
            state.forward_scratch(bad, None)
    for start, stop in ((2, 2), (3, 1), (0, end + 1)):
        with pytest.raises(ValueError, match="scratch span"):
            state.forward_scratch(start, None, end=stop)


def test_scratch_end_limits_the_block(llama_adapter):
    """``end`` feeds a sub-span: its logits equal the leading positions of the full span's."""
    state = new_state(llama_adapter, 10, 16)  # committed KV: positions 0..8
    plan = LayerPlan.from_indices(L, attn=[1])
    full = state.forward_scratch(4, plan).logits
    part = state.forward_scratch(4, plan, end=8).logits
    assert part.shape[1] == 4
    torch.testing.assert_close(part, full[:, :4])


def test_scratch_during_draft_keeps_draft_kv(llama_adapter):
    """A scratch pass mid-round leaves the round's draft KV (beyond committed) bit-identical."""
    state = new_state(llama_adapter, 6, 6)
    plan = LayerPlan.from_indices(L, attn=[3])
    state.forward_draft(state.pending, plan)
    state.forward_draft(torch.tensor([[5]]), plan)
    before = snapshot(state.cache)
    state.forward_scratch(1, LayerPlan.from_indices(L, mlp=[2]))
    assert_snapshot_equal(snapshot(state.cache), before)
    # the draft continues as if nothing happened
    out = state.forward_draft(torch.tensor([[6]]), plan)
    seq = torch.cat([state.tokens, torch.tensor([[5, 6]])], dim=1)
    want = reference_plan_logits(llama_adapter, seq, state.cache.committed, plan)[:, -1:]
    torch.testing.assert_close(out.logits, want, atol=1e-8, rtol=0)


# ------------------------------------------------------------------------------ early-exit reuse


def test_keep_draft_moves_pointers_only():
    cache = KVCache(4, 1, 1, 2, capacity=12)
    cache.committed = 3
    cache.lengths = [7, 7, 6, 3]
    keys = cache.keys.clone()
    cache.keep_draft(2, range(2))
    assert cache.lengths == [5, 5, 3, 3] and cache.committed == 3
    assert torch.equal(cache.keys, keys)
    with pytest.raises(ValueError, match=r"cannot keep 3 draft slots: layers \[0, 1\]"):
        cache.keep_draft(3, range(2))


def _reuse_state(adapter, capture: bool, e: int, n_fed: int, seed: int = 0) -> tuple[DecodeState, list[int]]:
    state = DecodeState(adapter, random_prompt(5, V, seed), 32, capture_hidden=capture)
    state.append(state.prefill().argmax(-1)[:, None])
    fed = [int(state.pending)]
    x = state.pending
    for _ in range(n_fed):
        tok = state.forward_draft(x, state.prefix_plan(e), reusable=True).logits[:, -1].argmax(-1)
        x = tok[:, None]
        fed.append(int(tok))
    return state, fed


@pytest.mark.parametrize("e", [1, 2, 3])
@pytest.mark.parametrize("extra_step", [False, True])
def test_reuse_verification_equals_full_verification(llama_adapter, e, extra_step):
    """Logits, hidden states and committed KV of a reusing verification equal a recomputing one;
    the saving is E blocks for each position the draft fed."""
    results = {}
    for reuse in (True, False):
        state = DecodeState(llama_adapter, random_prompt(5, V, 1), 32, capture_hidden=True)
        state.append(state.prefill().argmax(-1)[:, None])
        x, toks = state.pending, []
        for _ in range(3):
            tok = state.forward_draft(x, state.prefix_plan(e), reusable=reuse).logits[:, -1].argmax(-1)
            toks.append(int(tok))
            x = tok[:, None]
        if extra_step:  # DEL's confidence break: the last token's blocks < E ran too
            state.forward_draft(x, state.prefix_plan(e), reusable=reuse)
        block = torch.tensor([[int(state.pending), *toks]])
        evals = llama_adapter.executor.block_evals
        out = state.forward_verify(block)
        results[reuse] = (out, llama_adapter.executor.block_evals - evals, state)
    (got, evals_reuse, s1), (want, evals_full, s0) = results[True], results[False]
    torch.testing.assert_close(got.logits, want.logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(got.hidden_states, want.hidden_states, atol=1e-10, rtol=0)
    assert got.hidden_states.shape == (L + 1, 1, 4, 64)
    torch.testing.assert_close(s1.last_hidden_states, want.hidden_states, atol=1e-10, rtol=0)
    fed = 4 if extra_step else 3
    assert s1.stats.verify_blocks_saved == e * fed and s1.stats.reused_positions == fed
    assert evals_full == 4 * L and evals_reuse == 4 * L - e * fed
    for state in (s0, s1):
        state.commit(Verification(num_accepted=torch.tensor([2]), new_tokens=block[:, 1:4]))
        assert_committed_matches_fresh(state)


def test_reuse_falls_back_to_recompute(llama_adapter):
    """Different tokens, a tree mask, or a non-reusable step in the round: recompute, still exact."""
    state, fed = _reuse_state(llama_adapter, False, 2, 2)
    other = torch.tensor([[fed[0], (fed[1] + 1) % V, fed[2]]])
    c = state.cache.committed
    out = state.forward_verify(other)
    assert state.stats.verify_blocks_saved == 0
    want = reference_plan_logits(llama_adapter, torch.cat([state.tokens, other[:, 1:]], 1), c, None)
    torch.testing.assert_close(out.logits, want, atol=1e-8, rtol=0)
    state.discard_draft()
    # a tree verification of the same tokens
    state, fed = _reuse_state(llama_adapter, False, 2, 2)
    c = state.cache.committed
    block = torch.tensor([fed])
    state.forward_verify(block, position_ids=_pos(c, 3), tree_mask=torch.ones(3, 3, dtype=torch.bool).tril())
    assert state.stats.verify_blocks_saved == 0
    # a non-reusable step breaks the round's record
    state, fed = _reuse_state(llama_adapter, False, 2, 1)
    state.forward_draft(torch.tensor([[fed[-1]]]), state.prefix_plan(2))
    state.forward_verify(torch.tensor([fed]))
    assert state.stats.verify_blocks_saved == 0


@pytest.mark.parametrize("differ_at", [None, 1, 2, 3])
def test_a_checked_reusing_verification_reads_nothing_and_accepts_only_what_the_target_would(
    llama_adapter, differ_at
):
    """Issue 38 and 46: an acceptance rule (the greedy verifier's) after a reusable draft keeps the draft without comparing the block
    on the host. Where the block leaves the drafted inputs (position ``differ_at``; ``None``: it
    does not; 3: only where the draft fed nothing), rows from there saw the draft's inputs: m
    stops before them, and the target's choices of the rows it uses, and the KV it commits, are
    the full forward's."""
    state, fed = _reuse_state(llama_adapter, False, 2, 3)  # fed: the pending token, then 3 drafted
    block = list(fed)
    if differ_at is not None:
        block[differ_at] = (block[differ_at] + 1) % V
    full = DecodeState(llama_adapter, state.tokens[:, :-1], 32)  # the same tokens, nothing drafted
    full.prefill()
    full.append(state.pending)
    want = full.forward_verify(torch.tensor([block]), rule=greedy_rule).ruled
    c = state.cache.committed
    with count_host_reads() as reads:
        got = state.forward_verify(torch.tensor([block]), rule=greedy_rule).ruled
    assert reads.total == 0 and state.stats.verify_blocks_saved == 2 * 3  # E blocks x 3 inputs fed
    m = int(got["accepted"])
    ref = reference_plan_logits(
        llama_adapter, torch.cat([state.tokens, torch.tensor([block[1:]])], 1), c, None
    )
    torch.testing.assert_close(got["target"][:, : m + 1], ref.argmax(-1)[:, : m + 1], atol=0, rtol=0)
    if differ_at is None or differ_at == 3:  # every fed input agrees: the full forward's check
        assert m == int(want["accepted"]) and torch.equal(got["target"], want["target"])
    else:
        assert m == min(int(want["accepted"]), differ_at - 1)
    state.commit(Verification(num_accepted=got["accepted"], new_tokens=got["target"][:, : m + 1]))
    assert_committed_matches_fresh(state)


def test_a_checked_reusing_verification_never_accepts_from_rows_that_saw_the_drafts_inputs(llama_adapter):
    """The case `framework.engine.execution.spec.seen_ids` is for: the draft fed x2 where the block has the target's own g2, and the
    block's next token is what the target says after x2. Row 2 saw x2, so without the rule the
    check would accept that token and a bonus from a row the target never computed."""

    def greedy_after(seq: torch.Tensor) -> int:
        return int(reference_plan_logits(llama_adapter, seq, seq.shape[1] - 1, None)[:, -1].argmax(-1))

    state = DecodeState(llama_adapter, random_prompt(5, V, 3), 32)
    state.append(state.prefill().argmax(-1)[:, None])
    p = int(state.pending)
    g1 = greedy_after(state.tokens)
    g2 = greedy_after(torch.cat([state.tokens, torch.tensor([[g1]])], 1))
    g3 = greedy_after(torch.cat([state.tokens, torch.tensor([[g1, g2]])], 1))
    x2, h3 = next(
        (x, h)
        for x in range(V)
        if x != g2 and (h := greedy_after(torch.cat([state.tokens, torch.tensor([[g1, x]])], 1))) != g3
    )
    for tok in (p, g1, x2):  # the draft feeds p, g1, x2 with blocks < E = 2
        state.forward_draft(torch.tensor([[tok]]), state.prefix_plan(2), reusable=True)
    with count_host_reads() as reads:
        got = state.forward_verify(torch.tensor([[p, g1, g2, h3]]), rule=greedy_rule).ruled
    assert reads.total == 0
    # the full forward accepts g1, g2 (m = 2); the reusing one stops before row 2: m = 1, bonus g2
    assert int(got["accepted"]) == 1 and got["target"][0, :2].tolist() == [g1, g2]


def test_reusable_needs_a_pure_prefix_plan(llama_adapter):
    state, _ = _reuse_state(llama_adapter, False, 2, 0)
    for plan in (
        None,
        LayerPlan.full(L),
        LayerPlan.from_indices(L, attn=[1], exit_layer=3),
        LayerPlan.from_indices(L, exit_layer=L),
    ):
        with pytest.raises(ValueError, match="reusable"):
            state.forward_draft(state.pending, plan, reusable=True)
    # a skip after the exit layer is irrelevant: blocks >= E do not run
    state.forward_draft(state.pending, LayerPlan.from_indices(L, mlp=[3], exit_layer=2), reusable=True)


# ------------------------------------------------------------------------------ forward_block


def test_forward_block_reproduces_the_full_model_and_leaves_the_cache(llama_adapter):
    """One block on the true input of a committed position gives the full model's next state there
    (for several candidates at once), and the committed cache is bit-identical afterwards."""
    state = DecodeState(llama_adapter, random_prompt(7, V, 3), 16, capture_hidden=True)
    state.append(state.prefill().argmax(-1)[:, None])
    hs = state.last_hidden_states  # (L+1, 1, 7, d)
    p = state.pending_position - 1
    assert p == 6
    before = snapshot(state.cache)
    for b in range(llama_adapter.arch.num_layers):
        x = hs[b, 0, p]
        noise = torch.randn_like(x, dtype=x.dtype)
        out = state.forward_block(b, torch.stack([x, x + noise]), position=p)  # (2, d)
        torch.testing.assert_close(out[0], hs[b + 1, 0, p], atol=ATOL, rtol=0)
        assert not torch.allclose(out[1], out[0])  # candidates do not see each other
    assert_snapshot_equal(snapshot(state.cache), before)
    with pytest.raises(ValueError, match="position must be committed"):
        state.forward_block(0, hs[0, 0, :1], position=state.pending_position)


def test_commit_fills_in_the_hidden_states_a_verifier_did_not_pass(llama_adapter):
    state = DecodeState(llama_adapter, random_prompt(5, V, 4), 16, capture_hidden=True)
    state.append(state.prefill().argmax(-1)[:, None])
    out = state.forward_verify(state.pending)
    result = Verification(torch.tensor([0]), out.logits.argmax(-1)[:, :1])
    state.commit(result)
    assert result.hidden_states is out.hidden_states
    assert result.last_hidden.shape == (llama_adapter.arch.num_layers + 1, 1, out.hidden_states.shape[-1])
