"""framework/engine/execution/work.py: a strategy's device work, keyed, randomised and run by the engine
(issue 46, items 2-3). The key is derived from the function, its bound values and its inputs'
shapes and dtypes; what cannot be keyed runs eagerly with one warning; a keyed function's first
call runs eagerly and notes its draws, later calls replay one graph that draws the same numbers
(checked through the stand-in recorder on a CPU); the shipped strategies decide through their
graphs what they decide eagerly."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.execution.executor import Executor
from framework.engine.execution.work import EagerWorkWarning, Unkeyable, WorkGraphs, WorkKey, work_key
from framework.engine.state import DecodeState
from framework.testing import prepare_context, random_prompt, tiny_model
from framework.testing.graphs import StandInRecorder
from framework.types import RandomStream


def _adapter(num_layers: int = 2, graphs: bool = True, recorder: StandInRecorder | None = None):
    adapter = adapter_for(tiny_model("llama", num_layers, seed=0, dtype=torch.float32), fast_kernels=False)
    if graphs:
        adapter.executor.set_cuda_graphs(
            True, capture=True, route="forward", recorder=recorder or StandInRecorder()
        )
    return adapter


def _state(adapter, capture_hidden=False, prompt_len=6):
    state = DecodeState(adapter, random_prompt(prompt_len, seed=8), 48, capture_hidden=capture_hidden)
    state.append(state.prefill().argmax(-1)[:, None])
    return state


# ------------------------------------------------------------------------------ the derived key


def scaled_sum(ops, x, w, *, scale=1.0, mode="sum"):
    out = (x * w).sum(-1) * scale
    return {"out": out if mode == "sum" else -out, "max": x.amax()}


def _noisy(ops, x, *, kind):
    return x + (
        ops.uniform(*x.shape, dtype=x.dtype)
        if kind == "uniform"
        else ops.exponential(*x.shape, dtype=x.dtype)
    )


def test_the_key_is_the_functions_name_its_bound_values_and_the_inputs_shapes_and_dtypes():
    x, w = torch.ones(3, 5), torch.ones(5)
    key = work_key(scaled_sum, (x, w), {"scale": 2.0})
    assert isinstance(key, WorkKey) and key.function.endswith(":scaled_sum")
    assert ("scale", 2.0) in key.params and key.inputs[0] == ((3, 5), torch.float32, torch.device("cpu"))
    same = work_key(functools.partial(scaled_sum, scale=2.0), (x + 1, w), {})
    assert same == key  # a partial's bound values are the same values: the same key
    assert work_key(scaled_sum, (x, w), {"scale": 3.0}) != key  # another bound value
    assert work_key(scaled_sum, (x, w), {"scale": 2.0, "mode": "neg"}) != key
    assert work_key(scaled_sum, (x.double(), w), {"scale": 2.0}) != key  # another dtype
    assert work_key(scaled_sum, (x[:2], w), {"scale": 2.0}) != key  # another shape
    assert work_key(scaled_sum, (None, w), {"scale": 2.0}) != key
    rule = functools.partial(scaled_sum, scale=2.0)
    assert work_key(_noisy, (x,), {"kind": rule}) == work_key(
        _noisy, (x,), {"kind": functools.partial(scaled_sum, scale=2.0)}
    )


@pytest.mark.parametrize(
    ("fn", "params", "why"),
    [
        (lambda ops, x: x, {}, "a lambda"),
        (None, {}, "a closure over held"),
        (DecodeState.pending.fget, {}, "not a function"),
        (scaled_sum, {"scale": [2.0]}, "argument scale is a list"),
        (scaled_sum, {"scale": torch.ones(1)}, "argument scale is a tensor bound as a value"),
        (
            scaled_sum,
            {"mode": functools.partial(lambda: 0)},
            "argument mode is a function that cannot be keyed",
        ),
    ],
    ids=["lambda", "closure", "property", "list", "tensor", "lambda-partial"],
)
def test_what_cannot_be_keyed_is_named_with_why(fn, params, why):
    held = torch.ones(2)

    def closure(ops, x):
        return x * held

    got = work_key(closure if fn is None else fn, (torch.ones(2),), params)
    if fn is DecodeState.pending.fget:  # a plain function after all: keyable
        assert isinstance(got, WorkKey)
        return
    assert isinstance(got, Unkeyable) and why in got.reason, got


def test_a_bound_method_of_a_stateful_object_is_not_keyed():
    class Selector:
        def __init__(self):
            self.scale = 1.0

        def work(self, ops, x):
            return x * self.scale

    got = work_key(Selector().work, (torch.ones(2),), {})
    assert isinstance(got, Unkeyable) and "bound method of a Selector" in got.reason


# ------------------------------------------------------------------------------ running it


def test_a_keyed_function_is_learned_eagerly_then_one_graph_per_key_replayed_with_copies():
    rec = StandInRecorder()
    adapter = _adapter(recorder=rec)
    state = _state(adapter)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, generator=g), torch.full((5,), 2.0)
    want = scaled_sum(None, x, w)
    first = state.compute(scaled_sum, x, w)  # learned: eagerly
    assert rec.graphs == [] and torch.equal(first["out"], want["out"])
    second = state.compute(scaled_sum, x, w)  # recorded
    held = second["out"].clone()
    assert len(rec.graphs) == 1
    x2 = x + 1
    third = state.compute(scaled_sum, x2, w)  # new values, same shapes: a replay
    assert len(rec.graphs) == 1 and rec.graphs[0].replays == 2  # (a recording is replayed at once)
    torch.testing.assert_close(third["out"], scaled_sum(None, x2, w)["out"])  # the inputs were copied in
    assert torch.equal(second["out"], held)  # the caller's copy, not the graph's output
    fg = adapter.executor.graphs.work
    runs = fg.runs
    for changed in (
        dict(inputs=(x[:2], w), params={}),  # another shape
        dict(inputs=(x.double(), w.double()), params={}),  # another dtype
        dict(inputs=(x, w), params={"scale": 3.0}),  # another bound value
    ):
        for _ in range(2):  # learned, then recorded
            out = state.compute(scaled_sum, *changed["inputs"], **changed["params"])
        torch.testing.assert_close(
            out["out"], scaled_sum(None, *changed["inputs"], **changed["params"])["out"]
        )
    assert len(rec.graphs) == 4 and fg.runs == runs + 3  # a graph recorded anew for each


def test_a_closure_or_a_lambda_runs_eagerly_with_one_warning_naming_the_line():
    rec = StandInRecorder()
    state = _state(_adapter(recorder=rec))
    scale = torch.tensor(2.0)

    def closure(ops, x):
        return {"out": x * scale}

    x = torch.ones(3)
    with pytest.warns(
        EagerWorkWarning, match=r"test_work\.py:\d+: device work .*closure runs eagerly.*closure over scale"
    ):
        out = state.compute(closure, x)
    assert torch.equal(out["out"], x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per site and reason
        for _ in range(3):
            state.compute(closure, x)
    with pytest.warns(EagerWorkWarning, match="a lambda"):
        state.compute(lambda ops, x: {"out": x + 1}, x)
    assert rec.graphs == []  # nothing was recorded
    scale.fill_(3.0)
    assert torch.equal(state.compute(closure, x)["out"], x * 3)  # eagerly: never a stale graph


@pytest.mark.parametrize("kind", ["uniform", "exponential"])
def test_draws_inside_a_graph_are_the_streams_draw_for_draw(kind):
    """A function's random numbers come from the generation's stream: eagerly where it asks, and
    from a graph the same kinds and shapes drawn before each replay, in order: the same numbers."""
    x = torch.zeros(2, 7)
    graphed, eager = _state(_adapter()), _state(_adapter(graphs=False))
    graphed.random, eager.random = RandomStream(5), RandomStream(5)
    for _ in range(4):
        a = graphed.compute(_noisy, x, kind=kind)
        b = eager.compute(_noisy, x, kind=kind)
        assert torch.equal(a, b)
    assert graphed.adapter.executor.graphs.work.runs == 3  # the first call learned the draws


def test_a_function_that_reads_a_growing_draft_head_is_one_graph_that_sees_the_rows_it_adds():
    """A draft head that grows with the context is in a graph in its fixed form (room for the
    rows to come, masked): rows added between calls are seen by the next replay, with what the
    growing head itself gives eagerly; when its room doubles, a new graph is recorded."""
    from framework.engine.draft_head import DraftHead

    rec = StandInRecorder()
    adapter = _adapter(recorder=rec)
    state = _state(adapter)
    live = DraftHead(adapter, list(range(0, 128, 4)), context=True).start(state.tokens)
    state.draft_head = live
    h = torch.randn(5, adapter.arch.hidden_size)
    room = live.capacity
    others = [t for t in range(128) if t % 4 and not live.holds(t)]
    for new in ([], others[:1], others[1:3], others[3:]):  # the last one doubles the room
        live.observe(torch.tensor(new, dtype=torch.long), new)
        got = [state.compute(_top1_of, h, draft_head=True) for _ in range(2)]  # learned or recorded, replayed
        want = adapter.top1_from_hidden(h, head=live)
        for toks, probs in got:
            assert torch.equal(toks, want[0])
            torch.testing.assert_close(probs, want[1])
    assert live.capacity > room and len(rec.graphs) == 2  # one graph per room


def _top1_of(ops, h, *, draft_head):
    return ops.top1(h, draft_head=draft_head)


# ------------------------------------------------------------------------------ the strategies


def _eager(monkeypatch):
    """Run every keyed function eagerly (no graph), as the stand-in route's twin."""
    monkeypatch.setattr(WorkGraphs, "run", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(Executor, "_rule_key", lambda self, call: None)  # rules after the forward


def test_del_statistics_through_their_graph_decide_what_they_decide_eagerly(monkeypatch):
    """DEL's chain statistics (`strategies.selectors.del_tpl.chain_sums`) through the graph route,
    recorded once per chain length and replayed: the same decisions, to the bit, as the same
    function run eagerly on the same adapter."""
    from strategies.drafters.early_exit import EarlyExitDrafter, EarlyExitDrafterConfig
    from strategies.length.del_dynamic import DelDynamicLength
    from strategies.selectors.del_tpl import DelTplConfig, DelTplSelector
    from strategies.verifiers.greedy import GreedyVerifier

    def decode():
        adapter = _adapter(num_layers=6)
        sel = DelTplSelector(DelTplConfig(shadow_rows="chain", min_exit=1, init_tokens=8))
        dec = SpeculativeDecoder(
            adapter,
            sel,
            DelDynamicLength(),
            EarlyExitDrafter(EarlyExitDrafterConfig(on_stop="drop")),
            GreedyVerifier(),
        )
        dec.prepare(prepare_context(adapter))
        res = dec.generate(random_prompt(12, 128, seed=4), StopCondition(40))
        return res, adapter.executor.graphs.work.runs

    graphed_res, runs = decode()
    rounds = len(graphed_res.accept_lengths)
    lengths = {n + 1 for n in graphed_res.draft_lengths}
    assert runs == rounds - len(lengths) > 0  # each chain length's first call learned, eagerly
    _eager(monkeypatch)
    eager_res, _ = decode()
    s, w = graphed_res.strategy_summary["selector"], eager_res.strategy_summary["selector"]
    assert graphed_res.tokens == eager_res.tokens
    for key in ("exit_layers", "lengths", "thresholds", "alpha", "rounds_read"):
        assert s[key] == w[key], key


def test_claspss_dp_as_one_graph_chooses_what_the_eager_dp_chooses():
    """CLaSp's dynamic programme through `compute_at` on the forward route: its L block calls (the
    static form of `forward_block`, against the pool) and their glue are one graph, recorded once
    and replayed at any committed position (a device input); the skip set is the eager DP's, and
    the cache's books do not change."""

    from strategies.selectors.clasp_dp import clasp_dp

    rec = StandInRecorder()
    eager, graphed = _adapter(num_layers=8, graphs=False), _adapter(num_layers=8, recorder=rec)
    states = [DecodeState(a, random_prompt(12, seed=3), 48, capture_hidden=True) for a in (eager, graphed)]
    for s in states:
        s.append(s.prefill().argmax(-1)[:, None])
    m = 4
    lengths = list(states[1].cache.lengths)
    for p in (11, 6, 9, 4):  # committed positions of the prompt
        x = states[0].last_hidden_states[:, 0, p]
        want = clasp_dp(x, states[0], p, m)
        got = clasp_dp(x, states[1], p, m)
        assert got.skip == want.skip and got.cosine == pytest.approx(want.cosine, abs=1e-5), p
    works = [k for k in graphed.executor.graphs.store.keys("work")]
    assert len(works) == 1 and graphed.executor.graphs.work.runs == 3  # learned, then one graph
    assert states[1].cache.lengths == lengths
    with pytest.raises(ValueError, match="position must be committed"):
        clasp_dp(x, states[1], 12, m)


def test_clasp_decodes_through_its_dp_graph_as_through_the_eager_dp(monkeypatch):
    from strategies.drafters.layer_skip import LayerSkipDrafter
    from strategies.length.fixed import FixedLength, FixedLengthConfig
    from strategies.selectors.clasp_dp import ClaspDPConfig, ClaspDPSelector
    from strategies.verifiers.greedy import GreedyVerifier

    prompt = random_prompt(10, 128, seed=6)

    def decode():
        adapter = _adapter(num_layers=8)
        sel = ClaspDPSelector(ClaspDPConfig(num_skip=3, interval=2))
        dec = SpeculativeDecoder(
            adapter, sel, FixedLength(FixedLengthConfig(k=3)), LayerSkipDrafter(), GreedyVerifier()
        )
        dec.prepare(prepare_context(adapter))
        res = dec.generate(prompt, StopCondition(30))
        return res, adapter.executor.graphs.work.runs, adapter

    graphed_res, runs, adapter = decode()
    sets = graphed_res.strategy_summary["selector"]["sets"]
    assert runs == len(sets) - 1 >= 3  # the prompt's DP learned, the refreshes each one graph
    assert graphed_res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(30)).tokens
    _eager(monkeypatch)
    eager_res, _, _ = decode()
    assert [s["skip"] for s in sets] == [s["skip"] for s in eager_res.strategy_summary["selector"]["sets"]]
    assert graphed_res.tokens == eager_res.tokens


def test_speculative_sampling_through_its_graphs_draws_what_it_draws_eagerly(monkeypatch):
    """A sampled draft step's rule and the sampling verification (warping, acceptance, the
    replacement or bonus token: the verifier's acceptance rule, inside the verify forward's graph)
    run as device functions whose draws come from the verifier's stream inside them. So the same seed gives the same tokens from their graphs as eagerly."""
    from strategies.drafters.layer_skip import LayerSkipDrafter
    from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
    from strategies.selectors.static import StaticSelector, StaticSelectorConfig
    from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig

    prompt = random_prompt(8, 128, seed=2)

    def decode():
        rec = StandInRecorder()
        adapter = _adapter(num_layers=6, recorder=rec)
        dec = SpeculativeDecoder(
            adapter,
            StaticSelector(StaticSelectorConfig(skip_ratio=0.3)),
            ConfidenceLength(ConfidenceLengthConfig(threshold=0.05, max_length=4)),
            LayerSkipDrafter(),
            SamplingVerifier(SamplingVerifierConfig(temperature=0.8, top_p=0.95, seed=11)),
        )
        dec.prepare(prepare_context(adapter))
        res = dec.generate(prompt, StopCondition(30))
        store = adapter.executor.graphs.store
        works = {k[1].function.rsplit(":", 1)[1] for k in store.keys("work")}
        works |= {k[1].rule[0].function.rsplit(":", 1)[1] for k in store.keys("forward") if k[1].rule}
        return res, works, adapter.executor.graphs.work.runs

    graphed_res, works, runs = decode()
    assert works == {"accept_rule", "sampled_step"} and runs > len(graphed_res.accept_lengths)
    _eager(monkeypatch)
    eager_res, works, runs = decode()
    assert not works and runs == 0
    assert graphed_res.tokens == eager_res.tokens and graphed_res.accept_lengths == eager_res.accept_lengths


# ------------------------------------------------------------------------------ the review's bug classes


def test_exact_modes_backend_holds_on_every_graph_route(monkeypatch):
    """Exact mode pins SDPA to one backend for every attention: the whole-forward graph, its
    precapture and a strategy's device function with blocks (CLaSp's DP graph), not only the eager
    forward. The CPU has no memory-efficient backend, so the mechanism is checked with another."""

    from torch.nn.attention import SDPBackend

    from strategies.selectors.clasp_dp import clasp_dp

    adapter = _adapter(num_layers=4)
    adapter.sdpa_backend = SDPBackend.MATH
    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.flash_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    adapter.executor.prepare_graphs(64, chain=(1, 2), tree=(3,), checked=(2,))  # precapture
    assert seen and not any(seen), "precapture ran an attention outside exact mode's backend"
    seen.clear()
    state = DecodeState(adapter, random_prompt(12, seed=3), 64, capture_hidden=True)
    state.append(state.prefill().argmax(-1)[:, None])
    x = state.last_hidden_states[:, 0, 10].clone()  # the prompt's states of position 10
    for _ in range(2):  # whole-forward graphs
        out = state.forward_verify(state.pending, logits_at="last")
        state.cache.commit(1)
        state.append(out.logits[:, -1].argmax(-1)[:, None])
    assert adapter.executor.graphs.forwards.forwards == 2 and seen and not any(seen)
    seen.clear()
    for _ in range(3):  # learned, recorded, replayed: the DP's blocks in one graph
        clasp_dp(x, state, 10, 2)
    assert adapter.executor.graphs.work.runs == 2 and seen and not any(seen)


def test_a_dp_graph_near_a_spans_end_sees_its_own_scratch_rows():
    """A device function with blocks writes its candidates' keys and values in scratch slots after
    the cache's end: near the end of an attention span (a long context) its span must hold them,
    or the candidates lose sight of themselves. The graph's DP equals the eager DP there."""

    from framework.engine.execution.store import MIN_SPAN
    from strategies.selectors.clasp_dp import clasp_dp

    def model():
        return tiny_model("llama", 6, seed=2, dtype=torch.float32, max_position_embeddings=4 * MIN_SPAN)

    p = MIN_SPAN - 1  # the committed context ends at the first span's last slot: scratch rows after it
    prompt = random_prompt(p, seed=5)
    eager = adapter_for(model(), fast_kernels=False)
    graphed = adapter_for(model(), fast_kernels=False)
    graphed.executor.set_cuda_graphs(True, capture=True, route="forward", recorder=StandInRecorder())
    states = [DecodeState(a, prompt, p + 64, capture_hidden=True) for a in (eager, graphed)]
    for s in states:
        s.append(s.prefill().argmax(-1)[:, None])
    x = states[0].last_hidden_states[:, 0, p - 1]
    want = clasp_dp(x, states[0], p - 1, 3)  # up to 3 candidates a block call
    for _ in range(3):
        got = clasp_dp(x, states[1], p - 1, 3)
        assert got.skip == want.skip and got.cosine == pytest.approx(want.cosine, abs=1e-5)
    assert graphed.executor.graphs.work.runs == 2


def test_a_derived_key_holds_every_bound_value_of_a_shipped_device_function():
    """Two configurations on one adapter never share a graph: each bound value of the shipped
    device functions (a verifier's warping, a selector's DP options) is a term of the key."""
    from strategies.selectors.clasp_dp import dp_choices
    from strategies.verifiers.sampling import accept_rule, sample_draft

    x = torch.ones(2, 5)
    for fn, params, other in (
        (sample_draft, {"temperature": 0.7, "top_k": 0, "top_p": 0.9}, {"top_p": 0.95}),
        (accept_rule, {"temperature": 0.7, "top_k": 4, "top_p": 1.0}, {"top_k": 5}),
        (dp_choices, {"num_skip": 2, "protected": frozenset(), "objective": "max_cosine"}, {"num_skip": 3}),
        (
            dp_choices,
            {"num_skip": 2, "protected": frozenset(), "objective": "max_cosine"},
            {"protected": frozenset({0})},
        ),
    ):
        a, b = work_key(fn, (x,), params), work_key(fn, (x,), {**params, **other})
        assert isinstance(a, WorkKey) and a != b, (fn.__name__, other)
