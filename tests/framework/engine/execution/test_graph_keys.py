"""Every key that picks a recorded graph, one term at a time (issue 54, class 1).

A graph is recorded once and replayed for every later call with the same key, so a key that
misses a term replays one configuration's graph for another: on a GPU, the wrong weights, head
rows or buffers (output that differs from plain greedy decoding), or an attention span too short
(a CLaSp DP that no longer sees the context past about 2k tokens). For each key the engine builds,
and for each of its terms, two calls on one adapter that differ only in that term must record two
graphs whose keys differ in that term alone. Checked through the stand-in recorder on the CPU.

The keys: a whole forward's (`ForwardSpec.graph_key`: plan, rows, span, logits, hidden, tree,
weights, pick, rule, head), the reduced draft head's inside it (`DraftHead.graph_key`: its
tokens and size; a growing head's room and buffer set), a branch graph's (kind, block, rows,
span, the draft's low-bit format), a strategy's device work (`WorkKey`: the function, its bound
values, its inputs' shapes, the draft head) and the block graphs of a DP (their span).
"""

from __future__ import annotations

import dataclasses
import gc
from functools import partial

import pytest
import torch

from framework import LayerPlan
from framework.engine.adapter import adapter_for
from framework.engine.draft_head import DraftHead
from framework.engine.execution.spec import GraphKey
from framework.engine.state import DecodeState
from framework.kernels.lowbit import LOWBIT_FORMATS
from framework.testing import random_prompt, tiny_model
from framework.testing.graphs import StandInRecorder
from framework.types import TokenPick

PLAN = LayerPlan.from_indices(4, attn=[2])


def _adapter(route: str = "forward"):
    adapter = adapter_for(tiny_model("llama", 4, seed=0, dtype=torch.float32), fast_kernels=False)
    adapter.executor.set_cuda_graphs(True, capture=True, route=route, recorder=StandInRecorder())
    return adapter


def _state(adapter, prompt_len: int = 6, capacity: int = 48, **kw) -> DecodeState:
    state = DecodeState(adapter, random_prompt(prompt_len, seed=5), max(capacity, prompt_len + 48), **kw)
    state.append(state.prefill().argmax(-1)[:, None])
    return state


def _new_keys(adapter, kind: str, call) -> list:
    """The keys of ``kind`` that ``call()`` recorded (in order)."""
    store = adapter.executor.graphs.store
    before = set(store.keys(kind))
    call()
    return [k for k in store.keys(kind) if k not in before]


def _differ(a: GraphKey, b: GraphKey) -> set[str]:
    return {f.name for f in dataclasses.fields(GraphKey) if getattr(a, f.name) != getattr(b, f.name)}


def _draft(state, plan=PLAN, **kw):
    def call():
        state.forward_draft(state.pending, plan, **kw)
        state.discard_draft()

    return call


def _verify(state, block, **kw):
    def call():
        state.forward_verify(torch.tensor([[int(state.pending), *block]]), **kw)
        state.cache.rollback()

    return call


def _step(state):
    out = state.forward_verify(state.pending, logits_at="last")
    state.cache.commit(1)
    state.append(out.logits[:, -1].argmax(-1)[:, None])


def _one_forward_key(adapter, call) -> GraphKey:
    keys = _new_keys(adapter, "forward", call)
    assert len(keys) == 1, keys
    return keys[0][1]


# ---- a whole forward's key (ForwardSpec.graph_key), term by term -------------------------------
def _pairs_plan(adapter, state):
    return _draft(state, LayerPlan.from_indices(4, attn=[2])), _draft(
        state, LayerPlan.from_indices(4, attn=[1])
    )


def _pairs_rows(adapter, state):
    return _verify(state, [3]), _verify(state, [3, 4])


def _pairs_logits(adapter, state):
    return _draft(state, logits_at="last"), _draft(state, logits_at=None)


def _pairs_hidden(adapter, state):
    def hidden(on):
        def call():
            state.capture_hidden = on
            _verify(state, [3, 4])()

        return call

    return hidden(False), hidden(True)


def _pairs_tree(adapter, state):
    def tree():
        n = int(state.cache.committed)
        positions = torch.arange(n, n + 3)[None]
        mask = torch.ones(3, 3, dtype=torch.bool).tril()
        _verify(state, [3, 4], position_ids=positions, tree_mask=mask)()

    return _verify(state, [3, 4]), tree


def _pairs_pick(adapter, state):
    return _draft(state, pick=TokenPick()), _draft(state, pick=TokenPick(softmax=True))


def _pairs_rule(adapter, state):
    def ruled(rule):
        def call():  # the first call learns the rule eagerly; the second holds it in the graph
            _verify(state, [3, 4], rule=rule)()
            _verify(state, [3, 4], rule=rule)()

        return call

    return ruled(partial(_top2_rule, margin=0.5)), ruled(partial(_top2_rule, margin=2.0))


def _pairs_head(adapter, state):
    """Two reduced heads of one size and one name, over other tokens: only their rows differ."""

    def headed(ids):
        def call():
            state.draft_head = DraftHead(adapter, ids, name="32 tokens")
            _draft(state)()

        return call

    return headed(list(range(0, 64, 2))), headed(list(range(1, 65, 2)))


def _top2_rule(ops, ids, logits, *, margin):
    """Accept a draft token among the target's two most probable within ``margin`` (a test rule)."""
    top = logits.topk(2, dim=-1)
    near = (top.values[..., :1] - top.values[..., 1:]) <= margin
    ok = (ids[:, 1:] == top.indices[:, :-1, 0]) | ((ids[:, 1:] == top.indices[:, :-1, 1]) & near[:, :-1, 0])
    return {"accepted": ok.cumprod(dim=1).sum(dim=1), "target": top.indices[..., 0]}


PAIRS = {
    "plan": _pairs_plan,
    "rows": _pairs_rows,
    "logits": _pairs_logits,
    "hidden": _pairs_hidden,
    "tree": _pairs_tree,
    "pick": _pairs_pick,
    "rule": _pairs_rule,
    "head": _pairs_head,
}


@pytest.mark.parametrize("term", list(PAIRS))
def test_two_forwards_that_differ_in_one_term_record_two_graphs(term):
    adapter = _adapter()
    state = _state(adapter)
    a, b = PAIRS[term](adapter, state)
    first = _new_keys(adapter, "forward", a)[-1][1]
    second = _new_keys(adapter, "forward", b)
    assert second, f"a forward that differs from the last in its {term} replayed the last one's graph"
    assert _differ(first, second[-1][1]) == {term}


def test_every_draft_weights_format_records_graphs_of_its_own():
    """The model's weights and each low-bit format: one graph each (a key that told only "model"
    from "low-bit" would replay int8's graph for an int4 draft)."""
    adapter = _adapter()
    state = _state(adapter)
    keys = []
    for fmt in (None, *LOWBIT_FORMATS):
        state.draft_weights = None if fmt is None else adapter.draft_branches(fmt)
        keys.append(_one_forward_key(adapter, _draft(state)))
    assert [k.weights for k in keys] == ["model", *LOWBIT_FORMATS]
    assert all(_differ(keys[0], k) == {"weights"} for k in keys[1:])


def test_every_pick_records_a_graph_of_its_own():
    adapter = _adapter()
    state = _state(adapter)
    picks = [
        TokenPick(),
        TokenPick(softmax=True),
        TokenPick(softmax=True, probs=True),
        TokenPick(softmax=True, top_k=2),
        TokenPick(softmax=True, top_k=3),
    ]
    keys = [_one_forward_key(adapter, _draft(state, pick=p)) for p in picks]
    assert [k.pick for k in keys] == picks


def test_a_forward_past_the_first_span_records_a_graph_of_its_own():
    """Plain steps of one shape before and after the context crosses the first span (2048 slots):
    two graphs, one per span; a graph of the short span would not read the slots past it."""
    adapter = _adapter()
    state = _state(adapter, prompt_len=2040, capacity=4096)
    first = _one_forward_key(adapter, lambda: _step(state))
    while state.cache.committed + 1 <= 2048:
        _step(state)
    second = _one_forward_key(adapter, lambda: _step(state))
    assert (first.span, second.span) == (2048, 4096) and _differ(first, second) == {"span"}


def test_a_growing_heads_room_and_buffer_set_are_in_the_key():
    """A head that grows with the context: its graph holds room for the rows to come. When the room
    doubles, and for a second live head of the same shared head (its own buffer set), the key
    changes: a graph recorded on one set of buffers never replays on another."""
    adapter = _adapter()
    state = _state(adapter)
    base = DraftHead(adapter, list(range(0, 64, 2)), context=True)
    live = base.start(state.tokens)
    state.draft_head = live
    first = _one_forward_key(adapter, _draft(state))
    room = live.capacity
    more = [t for t in range(64, 128) if not live.holds(t)]
    live.observe(torch.tensor(more), more)  # past the room: it doubles
    assert live.capacity > room
    doubled = _one_forward_key(adapter, _draft(state))
    other = base.start(state.tokens)  # held while ``live`` is: buffers of its own
    state.draft_head = other
    second_set = _one_forward_key(adapter, _draft(state))
    assert _differ(first, doubled) == {"head"} and _differ(first, second_set) == {"head"}
    assert len({first.head, doubled.head, second_set.head}) == 3
    del live


# ---- the branch graphs' keys (kind, block, rows, span, low-bit format) --------------------------
def test_branch_graphs_are_keyed_by_kind_block_rows_span_and_the_drafts_format():
    adapter = _adapter(route="branch")
    state = _state(adapter, prompt_len=2040, capacity=4096)
    for fmt in (None, *LOWBIT_FORMATS):
        state.draft_weights = None if fmt is None else adapter.draft_branches(fmt)
        _draft(state, LayerPlan.full(4))()
    state.draft_weights = None
    mlp = {k for k in adapter.executor.graphs.store.keys("mlp") if k[2] == 1}
    assert {k[-1] for k in mlp} == {None, *LOWBIT_FORMATS}  # one graph per block and format
    assert len(mlp) == 4 * (1 + len(LOWBIT_FORMATS))
    _verify(state, [3, 4])()  # three rows
    n = int(state.cache.committed)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    _verify(state, [3, 4], position_ids=torch.arange(n, n + 3)[None], tree_mask=mask)()
    keys = adapter.executor.graphs.store.keys
    assert {k[2] for k in keys("attn")} == {1, 3} and {k[2] for k in keys("tree")} == {3}
    assert {k[1] for k in keys("attn")} == set(range(4))
    while state.cache.committed + 1 <= 2048:  # the context crosses the first span
        _step(state)
    spans_before = {k[3] for k in keys("attn") if k[2] == 1}
    _step(state)
    assert spans_before == {2048} and {k[3] for k in keys("attn") if k[2] == 1} == {2048, 4096}


# ---- a strategy's device work (WorkKey) and the DP's block graphs -------------------------------
def _top1_of(ops, h, *, draft_head):
    return ops.top1(h, draft_head=draft_head)


def _one_block(ops, states):
    return ops.block(0, states)


def test_device_work_is_keyed_by_the_draft_head_it_reads():
    """Two heads of one size and one name over other tokens, and no head: three graphs of a
    function that scores the draft head (its rows are the graph's)."""
    adapter = _adapter()
    state = _state(adapter)
    h = torch.randn(3, adapter.arch.hidden_size)
    keys = []
    for ids in (None, list(range(0, 64, 2)), list(range(1, 65, 2))):
        state.draft_head = None if ids is None else DraftHead(adapter, ids, name="32 tokens")

        def twice():  # learned eagerly, then recorded
            for _ in range(2):
                toks, _ = state.compute(_top1_of, h, draft_head=True)
                want = adapter.top1_from_hidden(h, head=state.draft_head)[0]
                assert torch.equal(toks, want)

        got = _new_keys(adapter, "work", twice)
        assert len(got) == 1, got
        keys.append(got[0][1])
    assert len({k.engine for k in keys}) == 3
    assert all(
        {f.name for f in dataclasses.fields(k) if getattr(k, f.name) != getattr(keys[0], f.name)}
        == {"engine"}
        for k in keys[1:]
    )


def test_block_graphs_past_the_first_span_are_graphs_of_their_own():
    """A device function with block calls (CLaSp's DP) whose candidates' scratch rows end inside
    the first span (2048 slots), then past it as the context grows: two graphs, each attending to
    its whole context (what the eager function computes)."""
    adapter = _adapter()
    eager = adapter_for(tiny_model("llama", 4, seed=0, dtype=torch.float32), fast_kernels=False)
    states = [_state(a, prompt_len=1976, capacity=4096) for a in (adapter, eager)]
    rows = adapter.executor.graphs.max_tokens  # the scratch rows after the context
    x = torch.randn(2, adapter.arch.hidden_size)

    def twice():  # learned eagerly, then recorded
        for _ in range(2):
            p = states[0].cache.committed - 2
            got = states[0].compute_at(p, _one_block, x)
            torch.testing.assert_close(got, states[1].compute_at(p, _one_block, x), rtol=1e-5, atol=1e-5)

    keys = []
    for _ in range(2):
        got = _new_keys(adapter, "work", twice)
        assert len(got) == 1, got
        keys.append(got[0][1])
        while max(states[0].cache.lengths) + rows <= 2048:
            for s in states:
                _step(s)
    (kind0, work0, span0), (kind1, work1, span1) = keys
    assert kind0 == kind1 == "blocks" and work0 == work1 and (span0, span1) == (2048, 4096)


# ---- the graphs recorded before timing (keys built by `ForwardGraphs.precapture`) ---------------
def _timed_forwards(state) -> None:
    """A plain step, a chain verification with and without the greedy rule, and a token tree."""
    from strategies.verifiers.greedy import greedy_rule

    _step(state)
    _verify(state, [3, 4])()
    _verify(state, [3, 4], rule=greedy_rule)()
    n = int(state.cache.committed)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    _verify(state, [3, 4, 5], position_ids=(n + mask.sum(1) - 1)[None], tree_mask=mask, rule=greedy_rule)()


def test_the_graphs_recorded_before_timing_are_those_the_forwards_of_every_span_replay():
    """`Executor.prepare_graphs` builds each key by hand, span by span: a timed forward of each
    kind, near the start of the context and past the first span, records nothing more (a key it
    built with a term missing or wrong would be recorded again while timed)."""
    from strategies.verifiers.greedy import greedy_rule

    adapter = _adapter()
    store = adapter.executor.graphs.store
    adapter.executor.graphs.pool.reserve(3000)  # spans of 2048 and 4096 slots
    n, _ = adapter.executor.prepare_graphs(
        3000, chain=(1, 3), tree=(4,), hidden=True, checked=(3,), rule=greedy_rule
    )
    assert n == store.captures == 4 * 2
    for prompt_len in (6, 2100):
        state = _state(adapter, prompt_len=prompt_len, capacity=2200)
        state.capture_hidden = True
        _timed_forwards(state)  # the greedy rule's first call is eager: it learns its draws
        _timed_forwards(state)
        assert store.captures == 8, (prompt_len, [k for k in store.keys("forward")][8:])
        del state
        gc.collect()
