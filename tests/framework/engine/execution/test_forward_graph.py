"""One graph per forward (framework.engine.execution.forward_graph, ``--cuda-graph-route forward``), run without
capture on the CPU: it computes what the eager path computes for plain steps, draft steps of any
plan, early exits, chain and tree verifications and captured hidden states; it keeps the KV cache's
books once per forward; it leaves prefills and scratch passes to the other routes; and its graph
cache (recorded on first use, bounded, least recently used dropped first, every graph dropped once
too many are retired) keeps its books, checked through a stand-in for CUDA's graph recording."""

from __future__ import annotations

import pytest
import torch

from framework import REGISTRIES, LayerPlan
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.execution.spec import GraphKey
from framework.engine.execution.store import span, spans
from framework.engine.state import DecodeState
from framework.testing import ARCHS, default_strategy_instance, prepare_context, random_prompt, tiny_model
from framework.testing.graphs import StandInRecorder
from strategies.verifiers.greedy import greedy_rule


def _adapters(arch: str = "llama", num_layers: int = 4, seed: int = 0, **graphs):
    """(eager adapter, whole-forward adapter) over two copies of one model, no CPU kernels."""
    make = lambda: adapter_for(  # noqa: E731
        tiny_model(arch, num_layers, seed=seed, dtype=torch.float32), fast_kernels=False
    )
    eager, graphed = make(), make()
    graphed.executor.set_cuda_graphs(True, capture=graphs.pop("capture", False), route="forward", **graphs)
    return eager, graphed


def _started(adapters, prompt, capacity=48):
    states = [DecodeState(a, prompt, capacity) for a in adapters]
    for s in states:
        s.append(s.prefill().argmax(-1)[:, None])
    return states


def _close(a, b):
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_steps_as_whole_forwards_compute_what_the_eager_path_computes(arch):
    eager, graphed = _adapters(arch)
    states = _started((eager, graphed), random_prompt(7, seed=3))
    for _ in range(10):
        outs = [s.forward_verify(s.pending, logits_at="last").logits[:, -1] for s in states]
        _close(outs[0], outs[1])
        tok = outs[0].argmax(-1)[:, None]
        for s in states:
            s.cache.commit(1)
            s.append(tok)
    n = states[0].cache.committed
    for layer in range(eager.arch.num_layers):
        for a, b in zip(
            states[0].cache.committed_kv(layer), states[1].cache.committed_kv(layer), strict=True
        ):
            _close(a[:, :, :n], b[:, :, :n])
    assert graphed.executor.graphs.forwards.forwards == 10  # the prefill ran eagerly
    assert graphed.executor.graphs.store.replays == 10  # one call of the whole forward each, no branch calls
    assert states[1].cache.lengths == states[0].cache.lengths


def test_a_draft_chain_of_a_skip_plan_keeps_the_books_once_per_forward():
    eager, graphed = _adapters(num_layers=6)
    plan = LayerPlan.from_indices(6, attn=[1, 4], mlp=[2])
    states = _started((eager, graphed), random_prompt(5, seed=1))
    committed = states[1].cache.committed
    drafts = []
    for s in states:
        toks = []
        for _ in range(4):  # later draft tokens attend to the earlier draft slots
            logits = s.forward_draft(s.pending if not toks else toks[-1], plan).logits[:, -1]
            toks.append(logits.argmax(-1)[:, None])
        drafts.append((logits, torch.cat(toks, 1)))
    _close(drafts[0][0], drafts[1][0])
    assert torch.equal(drafts[1][1], drafts[0][1])
    # the skipped attentions wrote nothing; every other layer has the 4 draft slots
    want = [committed + (0 if i in (1, 4) else 4) for i in range(6)]
    assert states[1].cache.lengths == states[0].cache.lengths == want
    assert graphed.executor.graphs.forwards.forwards == 4


def test_an_early_exit_draft_and_captured_hidden_states_take_the_route():
    eager, graphed = _adapters(num_layers=6)
    states = _started((eager, graphed), random_prompt(6, seed=2))
    exit_plan = LayerPlan.from_indices(6, exit_layer=3)
    outs = [s.forward_draft(s.pending, exit_plan) for s in states]
    _close(outs[0].logits, outs[1].logits)
    assert states[1].cache.lengths[:3] == states[0].cache.lengths[:3]
    for s in states:
        s.discard_draft()
        s.capture_hidden = True
    block = torch.tensor([[int(states[0].pending), 5, 9]])
    outs = [s.forward_verify(block) for s in states]
    assert outs[1].hidden_states.shape == (7, 1, 3, eager.arch.hidden_size)
    _close(outs[0].hidden_states, outs[1].hidden_states)
    _close(outs[0].logits, outs[1].logits)
    assert graphed.executor.graphs.forwards.forwards == 2


def test_prefills_scratch_passes_and_long_blocks_take_the_other_routes():
    _, graphed = _adapters(num_layers=4, max_tokens=4)
    state = _started((graphed,), random_prompt(12, seed=4))[0]
    assert graphed.executor.graphs.forwards.forwards == 0  # the prefill
    state.forward_scratch(2, LayerPlan.from_indices(4, mlp=[1]), end=6)
    assert graphed.executor.graphs.forwards.forwards == 0  # hides part of the prefix
    state.forward_verify(torch.tensor([[int(state.pending), 1, 2, 3, 4]]))  # 5 > max_tokens
    assert graphed.executor.graphs.forwards.forwards == 0
    state.forward_verify(torch.tensor([[int(state.pending), 1, 2]]))
    assert graphed.executor.graphs.forwards.forwards == 1


COMBOS = [
    ("static", "fixed", "layer_skip", "greedy"),
    ("static", "confidence", "layer_skip", "tree"),
    ("clasp_dp", "fixed", "layer_skip", "greedy"),  # captured hidden states, plans that change
    ("del_tpl", "del_dynamic", "early_exit", "greedy"),  # early exits, early-exit reuse
    ("swift", "confidence", "layer_skip", "tree"),  # scratch passes besides whole forwards
    ("static", "confidence", "hybrid", "greedy"),
]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(c))
def test_speculative_decoding_through_whole_forwards_equals_plain_greedy(combo):
    _, adapter = _adapters(num_layers=6, seed=1)
    kinds = ("selector", "length", "drafter", "verifier")
    s = {k: default_strategy_instance(k, n, fast=True) for k, n in zip(kinds, combo, strict=True)}
    dec = SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    dec.prepare(prepare_context(adapter))
    for seed, plen in ((0, 6), (1, 11)):
        prompt = random_prompt(plen, 128, seed)
        want = VanillaDecoder(adapter).generate(prompt, StopCondition(40)).tokens
        before = adapter.executor.graphs.forwards.forwards
        res = dec.generate(prompt, StopCondition(40))
        assert res.tokens == want, f"{combo}, prompt {seed}"
        assert adapter.executor.graphs.forwards.forwards > before


def test_a_reduced_draft_head_runs_after_the_graph():
    _, adapter = _adapters(num_layers=6, seed=1)
    entry = REGISTRIES["drafter"].entry("layer_skip")
    from framework.config_fields import build_config

    drafter = entry.cls(build_config(entry.config, {"draft_vocab": 32}))
    sel, length, ver = (
        default_strategy_instance(k, n, fast=True)
        for k, n in (("selector", "static"), ("length", "fixed"), ("verifier", "greedy"))
    )
    dec = SpeculativeDecoder(adapter, sel, length, drafter, ver)
    dec.prepare(prepare_context(adapter))
    prompt = random_prompt(8, 128, 5)
    want = VanillaDecoder(adapter).generate(prompt, StopCondition(30)).tokens
    res = dec.generate(prompt, StopCondition(30))
    assert res.tokens == want and res.drafted > 0
    specs = {k[1] for k in adapter.executor.graphs.store.keys("forward")}
    assert any(s.plan is not None and s.logits in ("none", "head") for s in specs)  # drafts: a head


# ---- the graph cache's books, through a stand-in for CUDA's graph recording -------------------
_Recorder = StandInRecorder


def _step(state):
    out = state.forward_verify(state.pending, logits_at="last")
    tok = out.logits[:, -1].argmax(-1)[:, None]
    state.cache.commit(1)
    state.append(tok)
    return out


def test_a_spec_is_recorded_once_replayed_after_and_its_outputs_are_copies():
    rec = _Recorder()
    eager, graphed = _adapters(num_layers=4, recorder=rec, capture=True)
    store, pool = graphed.executor.graphs.store, graphed.executor.graphs.pool
    states = _started((eager, graphed), random_prompt(6, seed=7))
    first = _step(states[1])
    _close(_step(states[0]).logits, first.logits)
    held = first.logits.clone()
    assert store.captures == 1 and len(rec.graphs) == 1
    for _ in range(5):
        out = _step(states[1])
        ref = _step(states[0])
        _close(ref.logits, out.logits)
    assert store.captures == 1 and rec.graphs[0].replays == 6
    assert torch.equal(first.logits, held)  # the caller's copy, not the graph's output
    # another row count, another plan: other graphs
    states[1].forward_draft(states[1].pending, LayerPlan.from_indices(4, attn=[2]))
    states[1].discard_draft()
    states[1].forward_verify(torch.tensor([[int(states[1].pending), 3]]))
    assert store.captures == 3
    specs = [k[1] for k in store.keys("forward")]
    assert {(s.rows, s.plan is None) for s in specs} == {(1, True), (1, False), (2, True)}
    assert all(isinstance(s, GraphKey) and s.span == pool.capacity == 512 for s in specs)


def test_spans_are_coarse_and_precapture_records_the_full_models_forwards():
    rec = _Recorder()
    _, graphed = _adapters(num_layers=4, recorder=rec, capture=True)
    store, pool = graphed.executor.graphs.store, graphed.executor.graphs.pool
    pool.reserve(10_000)  # a pool of 16,384 slots
    assert spans(pool.capacity) == [2048, 8192, 16384]
    assert [span(end, pool.capacity) for end in (1, 2048, 2049, 9000)] == [2048, 2048, 8192, 16384]
    n, _ = graphed.executor.prepare_graphs(
        10_000, chain=(1, 3), tree=(4,), hidden=True, checked=(3,), rule=greedy_rule
    )
    assert n == store.captures == 4 * 3  # four kinds at three spans, nothing else
    specs = {k[1] for k in store._graphs}
    assert {(s.rows, s.tree, s.hidden, s.plan, s.rule is not None) for s in specs} == {
        (1, False, True, None, False),
        (3, False, True, None, False),
        (3, False, True, None, True),  # a greedy verification's, its rule inside
        (4, True, True, None, True),  # a tree verification holds the rule too
    }
    # a timed decode's plain steps and verifications of those sizes record nothing more
    state = _started((graphed,), random_prompt(6, seed=8))[0]
    state.capture_hidden = True
    _step(state)
    block = torch.tensor([[int(state.pending), 3, 4]])
    state.forward_verify(block)
    state.forward_verify(block, rule=greedy_rule)
    assert store.captures == 12


def test_the_cache_is_bounded_least_recently_used_first_and_starts_anew_once_too_many_retire():
    rec = _Recorder()
    _, graphed = _adapters(num_layers=4, recorder=rec, capture=True, max_graphs=2)
    store = graphed.executor.graphs.store
    state = _started((graphed,), random_prompt(6, seed=8))[0]
    plans = [LayerPlan.from_indices(4, attn=[i]) for i in (0, 1, 2)]

    def draft(plan):
        state.forward_draft(state.pending, plan)
        state.discard_draft()

    draft(plans[0])
    draft(plans[1])
    draft(plans[0])  # plans[0] is now the most recently used
    assert (store.captures, store.evicted) == (2, 0)
    draft(plans[2])  # a third: plans[1], the least recently used, goes
    assert (store.captures, store.evicted, store.retired) == (3, 1, 1)
    assert [k[1].plan for k in store.keys("forward")] == [plans[0], plans[2]]
    draft(plans[0])  # still there: replayed
    assert store.captures == 3
    draft(plans[1])  # recorded again; plans[2] goes; two retired = the bound: every graph goes
    assert (store.captures, store.evicted, store.resets) == (4, 2, 1)
    assert store.retired == 0 and not store._graphs
    draft(plans[1])
    assert store.captures == 5  # recorded anew after the reset


# ---- the draft token chosen inside the forward (issue 38, item 3) ------------------------------
def test_a_draft_step_picks_its_token_inside_the_whole_forward_graph():
    """``pick`` puts the draft token's choice (argmax, or softmax top-1 with its probability, the
    distribution and the top k) into the forward's graph: part of the spec's key, computed from
    the last row's logits as the eager path computes it, handed back as copies."""
    from framework.types import TokenPick, pick_tokens

    rec = _Recorder()
    eager, graphed = _adapters(num_layers=4, recorder=rec, capture=True)
    plan = LayerPlan.from_indices(4, attn=[2])
    states = _started((eager, graphed), random_prompt(6, seed=7))
    for pick in (TokenPick(), TokenPick(softmax=True, probs=True, top_k=3)):
        outs = [s.forward_draft(s.pending, plan, pick=pick) for s in states]
        for s in states:
            s.discard_draft()
        want = pick_tokens(outs[0].logits[:, -1], pick)
        for out in outs:
            got = out.picked
            assert torch.equal(got.tokens, want.tokens)
            for name in ("top_p", "probs", "top_tokens", "top_probs"):
                a, b = getattr(want, name), getattr(got, name)
                assert (a is None) == (b is None), name
                if a is not None:
                    _close(a, b)
    specs = [k[1] for k in graphed.executor.graphs.store.keys("forward")]
    assert {s.pick for s in specs} == {TokenPick(), TokenPick(softmax=True, probs=True, top_k=3)}
    held = outs[1].picked.tokens.clone()
    states[1].forward_draft(states[1].pending, plan, pick=TokenPick())  # a replay
    assert torch.equal(outs[1].picked.tokens, held)  # the caller's copy, not the graph's output
    # no pick asked: nothing picked
    assert states[1].forward_draft(states[1].pending, plan).picked is None


@pytest.mark.parametrize("grows", [False, True])
def test_a_reduced_draft_heads_pick_comes_in_vocabulary_ids_from_inside_the_forward(grows):
    """Issue 46: with a reduced draft head the forward picks too, through the head's ids, inside
    the draft forward's graph (the head's logits and the pick). A head that grows with the context
    is there in its fixed form (room for the rows to come, masked): rows it adds between steps are
    seen by the same graph's next replay, and the next generation's head replays it too."""
    from framework.engine.draft_head import DraftHead
    from framework.types import TokenPick, pick_tokens

    rec = _Recorder()
    eager, graphed = _adapters(num_layers=4, recorder=rec, capture=True)
    plan = LayerPlan.from_indices(4, attn=[2])
    states = _started((eager, graphed), random_prompt(6, seed=7))
    heads = [DraftHead(s.adapter, list(range(0, 64, 2)), context=grows) for s in states]
    for s, head in zip(states, heads, strict=True):
        s.draft_head = head.start(s.tokens) if grows else head
    for step, pick in enumerate((TokenPick(), TokenPick(softmax=True, probs=True, top_k=3), TokenPick())):
        if grows and step:  # a context row more: token 65 + step, outside the shared head
            for s in states:
                s.draft_head.observe(torch.tensor([65 + step]), [65 + step])
        outs = [s.forward_draft(s.pending, plan, pick=pick) for s in states]
        for s in states:
            s.discard_draft()
        want = pick_tokens(outs[0].logits[:, -1], pick, outs[0].head)
        for out in outs:
            assert out.head is not None and torch.equal(out.picked.tokens, want.tokens)
            assert set(out.picked.tokens.tolist()) <= set(range(0, 64, 2)) | set(range(64, 128))
            if pick.probs:
                _close(out.picked.probs, want.probs)
                assert out.picked.probs.shape[-1] == graphed.arch.info().vocab_size
    drafts = [k[1] for k in graphed.executor.graphs.store.keys("forward") if k[1].plan is not None]
    assert {k.logits for k in drafts} == {"head"} and len(drafts) == 2  # the two picks' graphs
    assert {k.head for k in drafts} == {states[1].draft_head.graph_key}  # the head is in the key
    if grows:  # the next generation's head: the same buffers, the same graphs
        del states, outs, out  # the first generation's head gives its buffers back
        state = _started((graphed,), random_prompt(6, seed=9))[0]
        state.draft_head = heads[1].start(state.tokens)
        out = state.forward_draft(state.pending, plan, pick=TokenPick())
        assert len([k for k in graphed.executor.graphs.store.keys("forward") if k[1].plan is not None]) == 2
        want = pick_tokens(out.logits[:, -1], TokenPick(), out.head)
        assert torch.equal(out.picked.tokens, want.tokens)


def test_a_verifiers_rule_is_folded_into_the_whole_forward_graph_after_one_eager_call():
    """Issue 46, item 4: a verifier's acceptance rule (here the greedy verifier's) runs inside
    the verify forward's graph: its first call runs right after the forward (it shows the engine
    what it draws), every later one inside the graph, with the same outputs as the rule run on an
    eager forward's logits; it needs every row's logits."""
    rec = _Recorder()
    eager, graphed = _adapters(num_layers=4, recorder=rec, capture=True)
    states = _started((eager, graphed), random_prompt(6, seed=2))
    pending = int(states[0].pending)
    want_next = int(states[0].forward_verify(states[0].pending, logits_at="last").logits[0, -1].argmax())
    states[0].cache.rollback()
    store, ex = graphed.executor.graphs.store, graphed.executor
    after = []  # the rule's calls after the graphed forward, outside its graph
    apply_rule = ex.apply_rule
    ex.apply_rule = lambda *args: after.append(args) or apply_rule(*args)
    for block in ([[pending, want_next, 5, 9]], [[pending, 3, want_next, 1]], [[pending, 3, 2, 1]]):
        ids = torch.tensor(block)
        outs = [s.forward_verify(ids, rule=greedy_rule) for s in states]
        ref = greedy_rule(None, ids, outs[0].logits)
        for out in outs:
            assert out.ruled.keys() == {"target", "accepted"}
            assert torch.equal(out.ruled["target"], ref["target"])
            assert torch.equal(out.ruled["accepted"], ref["accepted"])
        for s in states:
            s.cache.rollback()
        assert int(outs[1].ruled["accepted"][0]) == (1 if block[0][1] == want_next else 0)
    ruled = [k[1] for k in store.keys("forward") if k[1].rule is not None]
    assert len(ruled) == 1 and ruled[0].rows == 4  # learned on the first block, then one graph
    assert len(after) == 1  # the learning call only: the later ones ran inside the graph
    with pytest.raises(ValueError, match="acceptance rule needs logits_at='all'"):
        states[1].forward_verify(states[1].pending, logits_at="last", rule=greedy_rule)


def top2_rule(ops, ids, logits, *, margin):
    """A rule written outside the project: accept a draft token among the target's two most
    probable when its logit is within ``margin`` of the best (not lossless: a test of the path)."""
    top = logits.topk(2, dim=-1)
    near = (top.values[..., :1] - top.values[..., 1:]) <= margin
    ok = (ids[:, 1:] == top.indices[:, :-1, 0]) | ((ids[:, 1:] == top.indices[:, :-1, 1]) & near[:, :-1, 0])
    return {"accepted": ok.cumprod(dim=1).sum(dim=1), "target": top.indices[..., 0]}


def test_a_rule_written_outside_the_project_gets_the_one_launch_path_keyed_by_its_bound_values():
    """A verifier's own rule goes through the same path without touching the engine: one graph
    per bound value (the derived key holds ``margin``), and its outputs equal the rule's run after
    an eager forward."""
    from functools import partial

    rec = _Recorder()
    eager, graphed = _adapters(num_layers=4, recorder=rec, capture=True)
    states = _started((eager, graphed), random_prompt(6, seed=3))
    store = graphed.executor.graphs.store
    ids = torch.tensor([[int(states[0].pending), 3, 5]])
    for margin in (0.5, 0.5, 0.5, 2.0, 2.0):
        rule = partial(top2_rule, margin=margin)
        outs = [s.forward_verify(ids, rule=rule) for s in states]
        ref = top2_rule(None, ids, outs[0].logits, margin=margin)
        assert all(torch.equal(o.ruled["accepted"], ref["accepted"]) for o in outs)
        for s in states:
            s.cache.rollback()
    margins = {dict(k[1].rule[0].params)["margin"] for k in store.keys("forward") if k[1].rule is not None}
    assert margins == {0.5, 2.0}


def test_a_draft_with_low_bit_weights_takes_whole_forward_graphs_of_its_own():
    """The weights a draft runs are part of its graph's key: a draft step with a low-bit copy of
    the weights and one with the model's own (same plan, same rows) are two graphs, and each
    computes what its weights compute eagerly."""
    eager, graphed = _adapters(num_layers=4)
    plan = LayerPlan.from_indices(4, attn=[2])
    states = _started((eager, graphed), random_prompt(6, seed=4))
    for fmt in ("int8", None, "int8"):
        for s in states:
            s.draft_weights = None if fmt is None else s.adapter.draft_branches(fmt)
        outs = [s.forward_draft(s.pending, plan) for s in states]
        for s in states:
            s.discard_draft()
        _close(outs[0].logits, outs[1].logits)
    keys = [k[1] for k in graphed.executor.graphs.store.keys("forward") if k[1].plan is not None]
    assert sorted(k.weights for k in keys) == ["int8", "model"]
