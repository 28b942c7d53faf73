"""framework/engine/cost_model.py: the arithmetic of the cost model, its measurement and serialisation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from framework import LayerPlan
from framework.engine.adapter import adapter_for
from framework.engine.cost_model import CostModel
from framework.testing import synthetic_cost_model, tiny_model

L = 10


@pytest.fixture
def cm() -> CostModel:
    return synthetic_cost_model(L, max_tokens=4)


def test_draft_step_is_linear_in_the_sub_layers_run(cm):
    assert cm.draft_step(LayerPlan.full(L)) == pytest.approx(1.0)
    plan = LayerPlan.from_indices(L, attn=[1, 2], mlp=[3])
    assert cm.draft_step(plan) == pytest.approx(1.0 - 2 * 0.05 - 0.04)
    # early exit after 5 blocks: the other 5 blocks' sub-layers are not run
    assert cm.draft_step(LayerPlan(plan.attn_skip, plan.mlp_skip, exit_layer=5)) == pytest.approx(
        0.1 + 0.05 * 3 + 0.04 * 4
    )


def test_verify_costs_and_linear_extrapolation(cm):
    assert cm.step == 1.0
    assert cm.verify(3) == pytest.approx(1.2)
    assert cm.verify(6) == pytest.approx(1.5)  # mean slope of the upper half of the table
    # a noisy table whose last size measured cheaper than the one before: never extrapolated down
    noisy = CostModel(L, 0.1, 0.05, 0.04, (1.0, 1.1, 1.3, 1.5, 1.45))
    assert noisy.verify(6) == pytest.approx(1.45 + (1.45 - 1.1) / 3)
    assert all(noisy.verify(t + 1) >= noisy.verify(t) for t in range(5, 300))
    flat = CostModel(L, 0.1, 0.05, 0.04, (1.0, 1.2, 1.1, 0.9))
    assert flat.verify(200) == pytest.approx(0.9)
    with pytest.raises(ValueError, match=">= 1 token"):
        cm.verify(0)


def test_verify_at_interpolates_fractional_blocks(cm):
    assert cm.verify_at(3.0) == cm.verify(3)
    assert cm.verify_at(2.25) == pytest.approx(0.75 * 1.1 + 0.25 * 1.2)
    assert cm.verify_at(5.5) == pytest.approx(1.45)  # between the extrapolated sizes 5 and 6
    assert cm.verify_at(0.5) == cm.verify(1)  # never below one token


def test_decode_time_sums_rounds(cm):
    plan = LayerPlan.from_indices(L, attn=range(L))  # draft step 0.5
    assert cm.decode_time(plan, [0, 2, 3]) == pytest.approx(1.0 + (2 * 0.5 + 1.2) + (3 * 0.5 + 1.3))


def test_expected_speedup_and_ceiling(cm):
    plan = LayerPlan.from_indices(L, attn=range(L))  # draft step 0.5
    assert cm.expected_speedup(0.5, 0, plan) == 1.0
    # alpha = 1, k = 2: 3 tokens for 2 * 0.5 + 1.2 steps
    assert cm.expected_speedup(1.0, 2, plan) == pytest.approx(3 / 2.2)
    want = (1 - 0.8**3) / 0.2 / 2.2
    assert cm.expected_speedup(0.8, 2, plan) == pytest.approx(want)
    best, k = cm.ceiling(0.8, plan, max_k=8)
    assert k >= 1 and best == pytest.approx(max(cm.expected_speedup(0.8, j, plan) for j in range(9)))
    # a draft as expensive as the target never pays: the ceiling is plain decoding
    assert cm.ceiling(0.9, LayerPlan.full(L)) == (1.0, 0)
    with pytest.raises(ValueError, match="alpha"):
        cm.expected_speedup(1.5, 2, plan)


def test_round_trip_dict(cm):
    assert CostModel.from_dict(cm.to_dict()) == cm
    with pytest.raises(ValueError, match="verify_costs"):
        CostModel(num_layers=2, base=0.1, attn=0.1, mlp=0.1, verify_costs=())


def test_measure_on_a_tiny_model():
    adapter = adapter_for(tiny_model("llama", 4, dtype=torch.float32))
    cm = CostModel.measure(adapter, max_tokens=3, context=8, reps=2)
    assert cm.num_layers == 4 and len(cm.verify_costs) == 3 and cm.context == 8
    assert all(math.isfinite(v) and v > 0 for v in (cm.base, *cm.verify_costs))
    assert cm.attn >= 0 and cm.mlp >= 0
    with pytest.raises(ValueError, match="max_tokens"):
        CostModel.measure(adapter, max_tokens=1)


def test_with_head_scales_the_heads_share_of_base(monkeypatch):
    """A reduced head replaces the full head's share of ``base`` in proportion to the measured
    head timings; the share never exceeds ``base`` (separate measurements can disagree)."""
    import dataclasses

    from framework.engine import cost_model as cm_mod

    class Head:
        size = 7

    cm = CostModel(num_layers=2, base=10.0, attn=1.0, mlp=2.0, verify_costs=(20.0,), head=8.0, full_head=8.0)
    monkeypatch.setattr(cm_mod, "head_seconds", lambda adapter, head, reps=31, weights=None: (4.0, 1.0))
    priced = cm.with_head(None, Head())
    assert (priced.base, priced.head, priced.full_head, priced.draft_vocab) == (4.0, 2.0, 8.0, 7)
    again = priced.with_head(None, Head())  # from a priced model: the same result
    assert (again.base, again.head) == (4.0, 2.0)
    noisy = dataclasses.replace(cm, head=12.0, full_head=12.0)  # head measured above base
    assert noisy.with_head(None, Head()).base == pytest.approx(2.5)


def test_with_weights_scales_the_draft_sub_layers_by_the_measured_ratios(monkeypatch):
    """Compressed draft weights change what a draft sub-layer costs, nothing else; the ratios of
    the measured sub-layer times carry over to a cost model in any unit."""
    from framework.engine import cost_model as cm_mod

    class Int8:
        weights = "int8"

    cm = CostModel(num_layers=2, base=10.0, attn=1.0, mlp=2.0, verify_costs=(20.0, 22.0))
    seen = []

    def fake(adapter, weights, reps=7):
        seen.append(weights)
        return [(0.4, 0.8), (0.2, 0.2)]  # (attn, mlp) seconds: own weights, then the copy

    monkeypatch.setattr(cm_mod, "draft_sublayer_seconds", fake)
    priced = cm.with_weights(None, Int8())
    assert (priced.attn, priced.mlp, priced.draft_weights) == (0.5, 0.5, "int8")
    assert (priced.base, priced.verify_costs) == (cm.base, cm.verify_costs)
    assert seen[0][0] is None
    assert cm.with_weights(None, None) == cm  # the model's own weights: unchanged


def test_draft_sublayer_seconds_measure_each_format_on_a_real_forward():
    from framework.engine.adapter import adapter_for
    from framework.engine.cost_model import draft_sublayer_seconds
    from framework.kernels import cpu as kernels
    from framework.testing import tiny_model

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    adapter = adapter_for(tiny_model("llama", num_layers=2, dtype=torch.float32), fast_kernels=True)
    times = draft_sublayer_seconds(adapter, (None, adapter.draft_branches("int8")), context=16, reps=2)
    assert len(times) == 2 and all(t >= 0.0 for pair in times for t in pair)


def test_device_sync_is_a_no_op_on_cpu_and_synchronises_cuda(monkeypatch):
    """Timers read the clock after `device_sync`: CUDA queues kernels, so the clock must wait for
    them; on CPU nothing is queued and CUDA is never touched."""
    from framework.utils import device_sync

    def boom(*a, **k):
        raise AssertionError("torch.cuda touched on CPU")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    device_sync("cpu")
    device_sync(torch.device("cpu"))
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: calls.append(dev))
    device_sync(torch.device("cuda", 1))
    device_sync("cuda:0")
    assert calls == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_head_seconds_on_cpu_never_synchronises(monkeypatch):
    from framework.engine.cost_model import head_seconds

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (_ for _ in ()).throw(AssertionError("sync")))
    full, head = head_seconds(adapter_for(tiny_model("llama", num_layers=2)), reps=2)
    assert full > 0 and head == full


def test_measurements_synchronise_a_cuda_device(monkeypatch):
    """`head_seconds` brackets every timed call with `device_sync` of the adapter's device (which
    waits on CUDA and does nothing on CPU)."""
    import framework.engine.cost_model as cost_model
    from framework.engine.cost_model import head_seconds

    adapter = adapter_for(tiny_model("llama", num_layers=2))
    calls = []
    monkeypatch.setattr(cost_model, "device_sync", lambda dev: calls.append(dev))
    reps = 3
    head_seconds(adapter, reps=reps)
    assert len(calls) == 2 * (reps + 1) and all(c == adapter.arch.device for c in calls)


def test_synced_clock_is_perf_counter_on_cpu_and_syncs_on_cuda(monkeypatch):
    import time

    from framework.utils import synced_clock

    assert synced_clock("cpu") is time.perf_counter
    assert synced_clock(torch.device("cpu")) is time.perf_counter
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: calls.append(dev))
    clock = synced_clock(torch.device("cuda", 0))
    t0 = clock()
    assert clock() >= t0 and calls == [torch.device("cuda", 0)] * 2


def test_head_seconds_times_the_adapters_own_head_path_which_knows_a_split_model():
    """The final norm and LM head are timed through ``adapter.logits_from_hidden`` (which moves the
    residual to the norm's and the head's devices on a ``--device-map`` split), not through the
    architecture's modules directly (on a cuda:0 + cpu split that raised a device mismatch)."""
    from framework.engine.cost_model import head_seconds
    from framework.engine.draft_head import DraftHead

    adapter = adapter_for(tiny_model("llama", num_layers=2))
    head = DraftHead(adapter, torch.arange(64))
    seen = []
    real = adapter.logits_from_hidden
    adapter.logits_from_hidden = lambda x, h=None, w=None: seen.append((h, w)) or real(x, h, w)
    reps = 2
    weights = adapter.draft_branches("bfloat16")  # the head is timed as that draft scores it
    head_seconds(adapter, head, reps=reps, weights=weights)
    assert seen.count((None, None)) == reps + 1 and seen.count((head, weights)) == reps + 1


def _two_context_costs() -> CostModel:
    near = (1.0, 1.1, 1.2, 1.3)
    return CostModel(
        num_layers=4, base=0.1, attn=0.1, mlp=0.2, verify_costs=near, context=128,
        far_context=1152, far_attn=0.3, far_verify_costs=(2.0, 2.3, 2.6, 2.9),
    )  # fmt: skip


def test_at_context_interpolates_attention_and_verification_linearly():
    from framework.engine.cost_model import CONTEXT_STEP

    cost = _two_context_costs()
    assert cost.at_context(128).verify_costs == pytest.approx(cost.verify_costs)
    assert cost.at_context(1152).verify_costs == pytest.approx(cost.far_verify_costs)
    mid = cost.at_context(640)  # half-way
    assert mid.attn == pytest.approx(0.2) and mid.verify_costs == pytest.approx((1.5, 1.7, 1.9, 2.1))
    assert (mid.base, mid.mlp, mid.context) == (0.1, 0.2, 640)
    # beyond the far context: extrapolated; far below the near one: never under half the near cost
    assert cost.at_context(2176).step == pytest.approx(3.0)
    assert cost.at_context(1).verify_costs == pytest.approx((0.9375, 1.025, 1.1125, 1.2))  # at 64
    steep = replace(cost, context=1024, far_context=1088)
    assert steep.at_context(64).step == pytest.approx(0.5)
    # lengths share a bucket (one instance: the gate memoises by identity)
    assert cost.at_context(640) is cost.at_context(640 + CONTEXT_STEP // 2 - 1)
    # one context measured: the same costs everywhere
    flat = replace(cost, far_context=0, far_attn=0.0, far_verify_costs=())
    assert flat.at_context(4000) is flat
    with pytest.raises(ValueError, match="far_verify_costs"):
        replace(cost, far_verify_costs=(1.0,))


def test_cost_models_with_two_contexts_round_trip_and_say_both():
    cost = _two_context_costs()
    assert CostModel.from_dict(cost.to_dict()) == cost
    assert "at context 1152: step 2000.00 ms" in cost.describe()
    old = {k: v for k, v in cost.to_dict().items() if not k.startswith("far_")}  # an older file
    assert CostModel.from_dict(old).far_context == 0


def test_measure_prices_a_far_context_too():
    """`measure` times attention and verifications again on a long prompt (here clamped to what
    the tiny model allows) and fills the block sizes it did not time from the near ones."""
    from framework.engine.cost_model import _fill_sizes

    adapter = adapter_for(tiny_model("llama", num_layers=2))
    cost = CostModel.measure(adapter, max_tokens=4, reps=1)
    assert cost.context == 128 and cost.far_context == adapter.arch.info().max_context - 4 - 2
    assert len(cost.far_verify_costs) == 4 and all(c > 0 for c in cost.far_verify_costs)
    assert CostModel.measure(adapter, max_tokens=4, reps=1, far_context=64).far_context == 0
    # sizes 1, 2 and 4 measured; 3 is the near cost plus the interpolated difference
    filled = _fill_sizes({1: 2.0, 2: 2.2, 4: 3.0}, (1.0, 1.1, 1.2, 1.3))
    assert filled == pytest.approx((2.0, 2.2, 1.2 + (1.1 + 1.7) / 2, 3.0))


def test_a_cost_that_falls_with_the_context_is_measured_again_within_a_budget_then_marked(monkeypatch):
    """Issue 48, item 5, and issue 55, item 1: on a loaded machine a step measured at context 1024
    came out cheaper than at 128; `CostModel.measure` measures once more, within the first
    measurement's own time (a deadline), and if the inconsistency stays, raises the far costs to
    the near ones, marks the model ``inconsistent`` and warns; the reports then print no
    prediction from it."""
    import time
    import warnings

    from framework.benchmark.report import results_markdown, summarize
    from framework.engine import cost_model as cm

    good = CostModel(4, 0.2, 0.02, 0.06, (1.0, 1.1, 1.2), context=128, far_context=1024, far_attn=0.03,
                     far_verify_costs=(1.2, 1.3, 1.4))  # fmt: skip
    bad = CostModel(4, 0.2, 0.02, 0.06, (1.0, 1.1, 1.2), context=128, far_context=1024, far_attn=0.01,
                    far_verify_costs=(0.7, 1.3, 1.4))  # fmt: skip
    assert cm.context_inconsistency(good) == ""
    problem = cm.context_inconsistency(bad)
    assert "context 1024" in problem and "attention" in problem
    calls: list[tuple[int, float | None]] = []

    def once(results):
        def measure(cls, adapter, max_tokens, context, far_context, reps, head, weights, deadline=None):
            calls.append((reps, deadline))
            time.sleep(0.05)  # the first measurement's time is the budget of the second
            return results[min(len(calls), len(results)) - 1]

        return classmethod(measure)

    monkeypatch.setattr(CostModel, "_measure_once", once([bad, good]))
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = time.perf_counter()
        assert CostModel.measure(object(), reps=5, log=said.append) is good  # the second one was consistent
    assert [r for r, _ in calls] == [5, 5] and calls[0][1] is None
    budget = calls[1][1] - before  # the deadline: the first measurement's time again, no more
    assert 0.05 <= budget <= 0.05 + 0.05 + 0.5
    assert len(said) == 1 and "measuring again, at most" in said[0]
    calls.clear()
    monkeypatch.setattr(CostModel, "_measure_once", once([bad]))
    with pytest.warns(cm.CostModelWarning, match="stayed inconsistent after a second measurement"):
        fixed = CostModel.measure(object(), reps=5)
    assert len(calls) == 2  # twice in all: bounded
    assert fixed.far_verify_costs == (1.0, 1.3, 1.4) and fixed.far_attn == 0.02
    assert cm.context_inconsistency(fixed) == "" and fixed.inconsistent == problem
    assert CostModel.from_dict(fixed.to_dict()) == fixed
    # The reports print no prediction from it: the table says why, the story says nothing.
    rec = {"method": "m", "repeat": 0, "question_id": 1, "category": "qa", "new_tokens": 10, "wall_time": 1.0,
           "kind": "preset", "lossless": True, "accept_lengths": [2, 3], "turns": [{"draft_lengths": [2, 2],
           "accept_lengths": [2, 3], "skip_ratio": 0.2}], "drafted": 4, "accepted": 3}  # fmt: skip
    van = {**rec, "method": "vanilla", "kind": "baseline", "accept_lengths": [1] * 5, "drafted": 0,
           "accepted": 0, "turns": []}  # fmt: skip
    for costs in (fixed, {"m": fixed, "vanilla": fixed}):
        summary = summarize([van, rec], ["vanilla", "m"], costs)
        assert summary["methods"]["m"]["cost_model"] is None
        assert cm.LOADED in results_markdown(summary)
    assert summarize([van, rec], ["vanilla", "m"], good)["methods"]["m"]["cost_model"] is not None
    assert cm.LOADED in fixed.describe()
    assert good.inconsistent == "" and cm.LOADED not in good.describe()
