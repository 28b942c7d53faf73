"""framework/drafting/gate.py: the draft gate (`DraftGate`), its config and the `GatedLength` wrapper
around any length controller."""

from __future__ import annotations

import types

import pytest
import torch

from framework import REGISTRIES, Draft, LayerPlan, LengthController, LengthHint, Verification
from framework.config_fields import ConfigError, build_config
from framework.drafting.gate import (
    DraftGate,
    GateConfig,
    GatedLength,
    MeasuredCosts,
    break_even_alpha,
    gate_value,
    gated,
    length_cap,
    speedups,
)
from framework.engine.context import PreparedCache
from framework.engine.cost_model import CostModel
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.testing import (
    AlwaysAcceptDrafter,
    NeverAcceptDrafter,
    default_strategy_instance,
    prepare_context,
    random_prompt,
    synthetic_cost_model,
)
from framework.testing.stubs import NoConfig as _NoConfig
from framework.types import DecodeStats, RoundRecord
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier

L = 4
COSTS = synthetic_cost_model(L)  # step 1; draft step 0.1 + 0.125 per attention + 0.1 per MLP run
#: attention and MLP of blocks 1, 2 skipped: draft step 0.1 + 0.125 * 2 + 0.1 * 2 = 0.55
PLAN = LayerPlan.from_indices(L, attn=[1, 2], mlp=[1, 2])
FULL = LayerPlan.full(L)
GATED = ("fixed", "confidence", "adaptive_confidence", "finite_state", "del_dynamic")


def _round(plan: LayerPlan, k: int, m: int) -> tuple[Draft, Verification]:
    draft = Draft(torch.zeros(1, k, dtype=torch.long), plan)
    return draft, Verification(torch.tensor([m]), torch.zeros(1, m + 1, dtype=torch.long))


def _gate(alpha: float | None = None, plan: LayerPlan = PLAN, **kw) -> DraftGate:
    """A gate on the synthetic costs whose statistics say ``alpha`` (with 1000 trials), deciding
    on the point estimate unless ``optimism`` is given; its first drafted round is the controller's
    length unless ``first_probe`` is given (the cold start has tests of its own)."""
    lengths = kw.pop("lengths", "upto")
    kw.setdefault("optimism", 0.0)
    kw.setdefault("first_probe", 0)
    gate = DraftGate(GateConfig(**kw), lengths=lengths)
    gate.set_costs(COSTS)
    gate.plan = plan
    if alpha is not None:
        gate.acc, gate.rej = 1000 * alpha, 1000 * (1 - alpha)
    return gate


def _play(gate: DraftGate, k: int, accept, rounds: int) -> list[int]:
    """Rounds of limit -> observe; ``accept(drafted) -> m``; returns the lengths the gate allowed."""
    out = []
    for _ in range(rounds):
        n = gate.limit(None, k)
        out.append(n)
        gate.observe(*_round(gate.plan or PLAN, n, accept(n) if n else 0))
    return out


# ---- the arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.65, 0.9, 1.0])
def test_speedups_are_the_cost_models(alpha):
    got = speedups(COSTS, alpha, PLAN, 8)
    want = [COSTS.expected_speedup(alpha, k, PLAN) for k in range(1, 9)]
    assert got == pytest.approx(want, rel=1e-12)


def test_gate_value_upto_is_the_best_length_and_exact_the_given_one():
    s = speedups(COSTS, 0.8, PLAN, 6)
    assert gate_value(COSTS, 0.8, PLAN, 6, "upto") == (max(s), s.index(max(s)) + 1)
    assert gate_value(COSTS, 0.8, PLAN, 6, "exact") == (s[-1], s.index(max(s)) + 1)


def test_break_even_alpha_by_hand():
    # k = 1 is the best length near break-even: (1 + a) / (0.55 + verify(2) = 1.1) = 1 -> a = 0.65
    assert COSTS.draft_step(PLAN) == pytest.approx(0.55)
    assert break_even_alpha(COSTS, PLAN, 8) == pytest.approx(0.65, abs=1e-8)
    # margin 0.1: (1 + a) / 1.65 = 0.9 -> a = 0.485
    assert break_even_alpha(COSTS, PLAN, 8, margin=0.1) == pytest.approx(0.485, abs=1e-8)
    # the full model as a draft never pays: 2 / (1 + 1.1) < 1 even at alpha = 1
    assert break_even_alpha(COSTS, FULL, 8) is None
    # a free draft step and free verification of extra tokens always pay
    free = CostModel(num_layers=L, base=0.0, attn=0.0, mlp=0.0, verify_costs=(1.0,) * 16)
    assert break_even_alpha(free, PLAN, 4) == 0.0


@pytest.mark.parametrize(("lengths", "k"), [("upto", 8), ("exact", 4), ("exact", 1)])
def test_the_gate_flips_exactly_at_break_even(lengths, k):
    a = break_even_alpha(COSTS, PLAN, k, lengths)
    assert a is not None and 0.0 < a < 1.0
    # at the break-even alpha the cost model's own arithmetic gives a speedup of 1
    if lengths == "exact":
        assert COSTS.expected_speedup(a, k, PLAN) == pytest.approx(1.0, abs=1e-8)
    else:
        assert max(COSTS.expected_speedup(a, j, PLAN) for j in range(1, k + 1)) == pytest.approx(
            1.0, abs=1e-8
        )
    assert _gate(a + 1e-6, lengths=lengths, cap=False).limit(None, k) == k
    assert _gate(a - 1e-6, lengths=lengths, probe=5).limit(None, k) == 0
    # capped (the default): a controller of varying length drafts only what pays at the estimate
    capped = _gate(a + 1e-6, lengths=lengths).limit(None, k)
    assert capped == (k if lengths == "exact" else length_cap(COSTS, a + 1e-6, PLAN, k))


def test_the_cap_is_the_longest_length_that_pays_at_the_point_estimate():
    """Drafting decided on the bound, capped on the estimate: every k up to the cap pays at the
    point estimate, the next one does not; below break-even the cap is the best length."""
    for alpha in (0.7, 0.8, 0.9, 0.97):
        s = speedups(COSTS, alpha, PLAN, 16)
        cap = length_cap(COSTS, alpha, PLAN, 16)
        assert s[cap - 1] >= 1.0 and (cap == 16 or s[cap] < 1.0), (alpha, cap, s)
        gate = _gate(alpha)
        assert gate.limit(None, 16) == cap
        assert _gate(alpha, cap=False).limit(None, 16) == 16
    assert length_cap(COSTS, 0.3, PLAN, 16) == 1  # nothing pays: the best length, k = 1
    assert length_cap(COSTS, 0.97, PLAN, 16) > length_cap(COSTS, 0.8, PLAN, 16)
    # optimistic decision, cautious length: thin evidence of alpha 0.55 drafts (bound above break-even
    # 0.65) but only the best length
    gate = _gate(optimism=1.0)
    gate.acc, gate.rej = 1.1, 0.9
    assert gate.alpha_bound > 0.65 > gate.alpha
    assert gate.limit(None, 16) == 1
    # a controller of exact length is never capped
    assert _gate(0.97, lengths="exact").limit(None, 6) == 6


def test_declines_when_alpha_is_low_and_drafts_when_high():
    assert _gate(0.2).limit(None, 6) == 0
    assert _gate(0.95).limit(None, 6) == 6
    # margin shifts the threshold: alpha 0.6 loses (break-even 0.65) unless a 10% loss is tolerated
    assert _gate(0.6).limit(None, 6) == 0
    assert _gate(0.6, margin=0.1, cap=False).limit(None, 6) == 6
    assert _gate(0.6, margin=0.1).limit(None, 6) == length_cap(COSTS, 0.6, PLAN, 6, 0.9) >= 1
    assert _gate(0.9, margin=-0.2).limit(None, 6) == 0  # asks for a 20% gain


def test_optimism_drafts_on_thin_evidence_and_declines_on_enough():
    """The decision uses alpha + optimism x the Beta posterior's sd: 4 trials at alpha 0.5 (break
    even 0.65) still draft with the default optimism; 400 trials at 0.5 do not; 0 is the point
    estimate."""
    thin = _gate(optimism=1.0)
    thin.acc, thin.rej = 2.0, 2.0  # alpha 0.5, sd of Beta(3, 3) = 0.189
    assert thin.alpha == 0.5 and thin.alpha_bound == pytest.approx(0.5 + (9 / (36 * 7)) ** 0.5)
    assert thin.limit(None, 6) == length_cap(COSTS, 0.5, PLAN, 6) >= 1  # drafts, as far as the estimate pays
    thick = _gate(optimism=1.0)
    thick.acc, thick.rej = 200.0, 200.0
    assert thick.alpha_bound < 0.53 and thick.limit(None, 6) == 0
    point = _gate(optimism=0.0)
    point.acc, point.rej = 2.0, 2.0
    assert point.alpha_bound == 0.5 and point.limit(None, 6) == 0
    assert thin.summary()["alpha_bound"] == round(thin.alpha_bound, 4)
    full = _gate(optimism=3.0)
    full.acc, full.rej = 5.0, 0.0
    assert full.alpha_bound == 1.0  # never above 1


def test_a_few_unlucky_probes_do_not_shut_the_gate_on_a_plan_that_pays():
    """A plan that pays (3 of 4 accepted a round; break-even 0.65) after an unlucky start (three
    rounds of 1 of 4: alpha 0.5 on 5.4 trials): the point estimate declines until a probe, the
    optimistic gate keeps drafting and its estimate recovers."""
    seq = iter([1, 1, 1] + [3] * 40)

    def accept(n: int) -> int:
        return min(n, next(seq))

    optimistic = _gate(optimism=1.0)
    optimistic.acc = optimistic.rej = 0.0
    played = _play(optimistic, 4, accept, 12)
    assert all(n > 0 for n in played)
    assert optimistic.alpha > 0.65
    seq = iter([1, 1, 1] + [3] * 40)
    point = _gate(optimism=0.0, probe=8)
    point.acc = point.rej = 0.0
    assert 0 in _play(point, 4, accept, 12)  # the point estimate declined after the bad start


def test_drafts_until_it_has_statistics_and_a_plan():
    gate = DraftGate(GateConfig(first_probe=0))
    gate.set_costs(COSTS)
    assert gate.alpha is None and gate.plan is None
    assert gate.limit(None, 5) == 5
    assert gate.limit(None, 0) == 0  # the controller's own 0 stays 0


@pytest.mark.parametrize("first_probe, k, want", [(1, 5, 1), (2, 5, 2), (3, 2, 2), (0, 5, 5)])
def test_the_first_drafted_round_is_a_probe_of_first_probe_tokens(first_probe, k, want):
    """Nothing measured yet: the gate drafts at most ``first_probe`` tokens (counted as a probe),
    then decides on what that round measured; the default is 1."""
    assert GateConfig().first_probe == 1
    gate = DraftGate(GateConfig(first_probe=first_probe))
    gate.set_costs(COSTS)
    assert gate.limit(None, k) == want
    assert gate.limit(None, k) == want  # idempotent within the round
    gate.observe(*_round(PLAN, want, want))  # all accepted
    assert gate.probes == (1 if first_probe else 0) and gate.rounds == 1
    assert gate.limit(None, k) == k  # alpha 1 (one trial): drafts the controller's length


def test_a_failed_first_probe_declines_a_plan_that_does_not_pay_after_one_short_round():
    """A hopeless plan (nothing accepted) costs one 1-token round, not a draft of the controller's
    length, before the gate declines; the failed probe doubles the probe interval."""
    gate = DraftGate(GateConfig(probe=4, probe_max=64))
    gate.set_costs(COSTS)
    got = _play(gate, 6, lambda n: 0, 14)
    assert got[0] == 1 and got[1:5] == [0] * 4
    assert sum(got) == 2 and got.index(1, 1) == 9  # the next probe after 8 declined rounds
    assert gate.interval == 16 and gate.probes == 2


def test_limit_is_idempotent_within_a_round():
    gate = _gate(0.1, probe=1)
    gate.wait = 0
    assert [gate.limit(None, 6) for _ in range(3)] == [1, 1, 1]
    assert gate.probes == 0  # counted in observe, once


# ---- probes ------------------------------------------------------------------------------------


def test_probes_at_the_configured_interval():
    gate = _gate(probe=3, probe_max=3)
    got = _play(gate, 4, lambda n: 0, 13)
    # no statistics: draft 4; alpha = 0 then: 3 declined rounds, a probe of the best length (1), ...
    assert got == [4, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert (gate.declined, gate.probes, gate.rounds) == (9, 3, 13)


def test_failed_probes_back_off_up_to_probe_max():
    gate = _gate(probe=2, probe_max=8)
    got = _play(gate, 4, lambda n: 0, 30)
    gaps, run = [], 0
    for n in got[1:]:
        if n:
            gaps.append(run)
            run = 0
        else:
            run += 1
    assert gaps == [2, 4, 8, 8]
    assert all(n == 1 for n in got[1:] if n)


def test_recovers_when_acceptance_improves():
    gate = _gate(probe=2, probe_max=16, decay=0.5)
    bad = _play(gate, 4, lambda n: 0, 12)
    assert bad[0] == 4 and sum(bad[1:]) <= 3  # declining, a few 1-token probes
    good = _play(gate, 4, lambda n: n, 40)  # now every draft token is accepted
    first = good.index(4)
    assert gate.alpha is not None and gate.alpha > 0.65
    assert all(n == 4 for n in good[first:])
    # a fully accepted probe resets the interval: recovery takes a few base intervals, not 16 rounds each
    assert first <= 3 * (2 + 1) + 16


def test_a_plan_that_cannot_pay_is_not_probed_until_the_plan_changes():
    gate = _gate(0.0, plan=FULL, probe=2)
    got = []
    for i in range(12):
        n = gate.limit(None, 4)
        got.append(n)
        gate.observe(*_round(FULL if i < 6 else PLAN, n, 0))
    assert got[:7] == [0] * 7  # the full model as a draft: hopeless at any alpha, no probes
    assert got[7] == 1  # the plan changed in round 7: probe it in round 8
    assert gate.probes == 1


def test_the_costed_plan_is_the_drafted_one_not_the_selectors():
    """An early-exit drafter runs its own prefix plan; the empty drafts of declined rounds carry
    the selector's plan (here the full model, which could never pay)."""
    exit2 = LayerPlan.from_indices(L, exit_layer=2)  # 0.55 steps per draft token
    gate = DraftGate(GateConfig(probe=2, probe_max=2))
    gate.set_costs(COSTS)
    got = []
    for _ in range(10):
        n = gate.limit(None, 4)
        got.append(n)
        gate.observe(*_round(exit2 if n else FULL, n, 0))
        assert gate.plan == exit2
    assert got == [1, 0, 0, 1, 0, 0, 1, 0, 0, 1]  # a first probe, probes on schedule, never stuck on FULL


def test_statistics_are_a_decayed_chain_estimate():
    gate = DraftGate(GateConfig(decay=0.5))
    gate.set_costs(COSTS)
    gate.observe(*_round(PLAN, 4, 1))  # 1 success, 1 failure
    assert (gate.acc, gate.rej) == (1.0, 1.0)
    gate.observe(*_round(PLAN, 3, 3))  # 3 successes, no failure
    assert (gate.acc, gate.rej) == (3.5, 0.5)
    gate.observe(*_round(PLAN, 0, 0))  # a round without a draft leaves the statistics
    assert (gate.acc, gate.rej) == (3.5, 0.5)
    assert gate.alpha == pytest.approx(3.5 / 4.0)


def test_summary_values():
    gate = _gate(probe=2, probe_max=2)
    _play(gate, 4, lambda n: 0, 7)  # [4, 0, 0, 1, 0, 0, 1]
    s = gate.summary()
    assert s["rounds"] == 7 and s["declined"] == 4 and s["probes"] == 2
    assert s["declined_share"] == round(4 / 7, 4)
    assert s["alpha"] == 0.0 and s["calibration_rounds"] == 0
    assert s["trials"] == round(0.9**2 + 0.9 + 1, 3)
    want, best = gate_value(COSTS, 0.0, PLAN, 4)
    assert s["expected_speedup"] == round(want, 4) and s["best_k"] == best == 1
    assert s["break_even_alpha"] == round(break_even_alpha(COSTS, PLAN, 4), 4) == 0.65
    assert s["costs"] == "cost_model" and s["probe_interval"] == 2
    gate.reset()  # a new generation: counters restart, the estimate carries over
    s = gate.summary()
    assert (s["rounds"], s["declined"], s["probes"], s["alpha"]) == (0, 0, 0, 0.0)


# ---- without a cost model: measured timings -----------------------------------------------------


def test_measured_costs_from_the_state_timings():
    stats = DecodeStats()
    state = types.SimpleNamespace(stats=stats, num_tokens=128)
    gate = DraftGate(GateConfig(probe=2))
    assert gate.costs is None

    def play(drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        stats.rounds.append(RoundRecord(drafted, accepted, accepted + 1, PLAN.skip_ratio))
        stats.timings["draft"] += draft_s
        stats.timings["verify"] += verify_s
        gate.observe(*_round(PLAN, drafted, accepted))

    assert gate.limit(state, 4) == 1  # nothing measured yet: a first probe
    play(1, 0, 0.8, 1.3)
    assert gate.limit(state, 4) == 0 and gate.mode == "calibrate"  # time one plain step
    play(0, 0, 0.0, 1.0)
    assert gate.limit(state, 4) == 0 and gate.mode == "decline"  # alpha 0 with the measured costs
    assert gate.measured.draft == pytest.approx(0.8) and gate.measured.verify == pytest.approx(
        {2: 1.3, 1: 1.0}
    )
    model = gate.current_costs(state)
    assert model.step == pytest.approx(1.0) and model.draft_step(PLAN) == pytest.approx(0.8)
    assert model.verify(3) == pytest.approx(1.6)  # linear through T = 1 and T = 2
    assert model.verify(7) == pytest.approx(2.8)  # and beyond
    assert gate_value(model, 0.0, PLAN, 4)[0] < 1.0
    s = gate.summary()
    assert s["costs"] == "measured" and s["calibration_rounds"] == 1 and s["declined"] == 0


@pytest.mark.parametrize(("forwards", "want"), [(0, 4), (4, 0)])
def test_draft_forwards_scale_the_draft_step(forwards, want):
    """A drafter that runs no forward (prompt lookup) drafts for free: with the selector's full
    plan, drafting 1 token then pays from alpha 0.1 on ((1 + alpha) / verify(2) = 1.1)."""
    stats = DecodeStats()
    state = types.SimpleNamespace(stats=stats, num_tokens=128)
    gate = DraftGate(GateConfig(probe=3, first_probe=0))
    gate.set_costs(COSTS)
    assert gate.limit(state, 4) == 4  # no statistics yet (and no first probe)
    stats.rounds.append(RoundRecord(4, 1, 2, 0.0))
    stats.draft_forwards += forwards
    gate.observe(*_round(FULL, 4, 1))  # alpha = 0.5
    assert gate.limit(state, 4) == want
    assert gate.draft_scale == forwards / 4
    s = gate.summary()
    assert s["draft_forwards_per_token"] == forwards / 4
    assert s["break_even_alpha"] == (None if forwards else pytest.approx(0.1, abs=1e-4))


def test_a_token_tree_is_priced_at_the_block_it_verifies():
    """A tree verifier checks several candidates per drafted position: the gate measures the
    tokens verified per drafted token and prices a round of k at verify(1 + k * width)."""
    assert speedups(COSTS, 0.8, PLAN, 4, width=1.0) == speedups(COSTS, 0.8, PLAN, 4)
    wide = speedups(COSTS, 0.8, PLAN, 4, width=3.0)
    for k, (got, chain) in enumerate(zip(wide, speedups(COSTS, 0.8, PLAN, 4), strict=True), 1):
        tokens = (1 - 0.8 ** (k + 1)) / 0.2
        assert got == pytest.approx(
            tokens * COSTS.step / (k * COSTS.draft_step(PLAN) + COSTS.verify(1 + 3 * k))
        )
        assert got < chain
    half = speedups(COSTS, 0.8, PLAN, 1, width=1.5)[0]  # 2.5 tokens: halfway between 2 and 3
    verify = 0.5 * (COSTS.verify(2) + COSTS.verify(3))
    assert half == pytest.approx(1.8 * COSTS.step / (COSTS.draft_step(PLAN) + verify))
    with pytest.raises(ValueError, match="width must be >= 1"):
        speedups(COSTS, 0.8, PLAN, 4, width=0.5)

    stats = DecodeStats()
    state = types.SimpleNamespace(stats=stats, num_tokens=128)
    costs = CostModel(L, 0.05, 0.0, 0.0, tuple(1.0 + 0.1 * t for t in range(16)))  # cheap draft
    gate = DraftGate(GateConfig(probe=3))
    gate.set_costs(costs)
    gate.limit(state, 2)
    stats.rounds.append(RoundRecord(2, 1, 2, 0.0))
    stats.draft_forwards += 2
    stats.verify_tokens += 1 + 2 * 10  # a tree of 10 candidates per position
    gate.observe(*_round(PLAN, 2, 1))
    gate.acc, gate.rej = 600.0, 400.0  # alpha 0.6
    assert gate.limit(state, 2) == 0  # priced as a tree: verify(21) does not pay
    assert gate.width == pytest.approx(10.0) and gate.summary()["verify_width"] == 10.0
    chain = DraftGate(GateConfig(probe=3))
    chain.set_costs(costs)
    chain.plan, chain.acc, chain.rej = PLAN, 600.0, 400.0
    assert chain.width == 1.0 and chain.limit(None, 2) == 2  # the same round as a chain pays


def test_measured_costs_restart_their_baseline_with_each_generation():
    mc = MeasuredCosts()
    a = types.SimpleNamespace(stats=DecodeStats(), num_tokens=128)
    mc.update(a)
    a.stats.rounds.append(RoundRecord(2, 1, 2, 0.0))
    a.stats.timings["draft"] += 1.0
    a.stats.timings["verify"] += 2.0
    mc.update(a)
    assert (mc.draft, mc.verify) == (0.5, {3: 2.0})
    b = types.SimpleNamespace(stats=DecodeStats(), num_tokens=128)  # a new generation's stats
    b.stats.rounds.append(RoundRecord(4, 4, 5, 0.0))
    b.stats.timings["draft"] += 9.0
    mc.update(b)  # only a baseline: these timings are not one round's
    assert (mc.draft, mc.verify) == (0.5, {3: 2.0})
    assert MeasuredCosts().cost_model(L) is None


# ---- config ------------------------------------------------------------------------------------


def test_gate_config_is_off_by_default_and_no_controller_pastes_it():
    cfg = GateConfig()
    assert (cfg.enabled, cfg.margin, cfg.probe, cfg.probe_max, cfg.decay) == (False, 0.0, 8, 256, 0.9)
    for name in REGISTRIES["length"].names():
        fields = REGISTRIES["length"].entry(name).config.__dataclass_fields__
        assert not [f for f in fields if f.startswith(("fallback", "gate"))], name
        assert not hasattr(default_strategy_instance("length", name), "gate")


BAD = [
    ("margin", "0.6", r"in \[-0.5, 0.5\]"),
    ("margin", "-1.0", r"in \[-0.5, 0.5\]"),
    ("probe", "0", r"an integer in \[1, 1024\]"),
    ("probe", "2.5", r"a number \(int\)"),
    ("probe_max", "4", r"an integer in \[8, 4096\]"),
    ("decay", "0.0", r"in \(0, 1\]"),
    ("decay", "1.5", r"in \(0, 1\]"),
    ("enabled", "maybe", r"a boolean \(true/false\)"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD)
def test_bad_gate_option_names_the_field_and_range(field, value, allowed):
    with pytest.raises(ConfigError, match=rf"^--gate\.{field} must be {allowed}, got '?{value}'?$"):
        build_config(GateConfig, {"enabled": "true", field: value}, flag_prefix="--gate.")


@pytest.mark.parametrize("name", GATED)
def test_gate_fields_parse_from_strings_and_reach_the_gate(name):
    cfg = build_config(GateConfig, {"enabled": "true", "margin": "0.05", "probe": "4", "probe_max": "32"})
    assert (cfg.enabled, cfg.margin, cfg.probe, cfg.probe_max) == (True, 0.05, 4, 32)
    length = gated(default_strategy_instance("length", name), cfg)
    assert isinstance(length, GatedLength) and isinstance(length.gate, DraftGate)
    gate = length.gate
    assert (gate.margin, gate.probe, gate.probe_max, gate.decay) == (0.05, 4, 32, 0.9)
    assert gate.lengths == ("exact" if name in ("fixed", "finite_state") else "upto")


def test_gate_constructor_validates_its_lengths():
    with pytest.raises(ConfigError, match=r"^probe_max must be an integer in \[8, 4096\], got 2$"):
        GateConfig(probe=8, probe_max=2)
    with pytest.raises(ConfigError, match=r"^lengths must be one of"):
        DraftGate(lengths="some")


# ---- the wrapper ---------------------------------------------------------------------------------


class _Bare(LengthController):
    """A controller that implements only ``max_length`` (and records what it saw)."""

    Config = _NoConfig
    needs_confidence = True

    def __init__(self) -> None:
        super().__init__()
        self.hints: list[LengthHint | None] = []
        self.seen: list[int] = []

    def max_length(self, state, hint=None) -> int:
        self.hints.append(hint)
        return 5

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        return drafted < 2

    def observe(self, state, draft, result) -> None:
        self.seen.append(draft.length)

    def summary(self):
        return {"bare": len(self.seen)}


class _BareExact(_Bare):
    exact_length = True


def test_gated_returns_the_controller_itself_when_disabled():
    bare = _Bare()
    assert gated(bare, GateConfig()) is bare
    assert isinstance(gated(bare, GateConfig(enabled=True)), GatedLength)


def test_the_wrapper_gates_a_controller_that_only_implements_max_length():
    bare = _Bare()
    ctl = GatedLength(bare, GateConfig(enabled=True, probe=2, probe_max=2))
    ctl.gate.set_costs(COSTS)
    ctl.reset()
    hint = LengthHint(max_length=3, threshold=0.5, source="test")
    got = []
    for _ in range(4):
        k = ctl.max_length(None, hint)
        got.append(k)
        ctl.observe(None, *_round(PLAN, k, 0))
    assert got[0] == 1 and got[1:] == [0, 0, 1]  # a first probe, learns alpha 0, declines, probes
    assert bare.hints == [hint] * 4  # the hint reaches the wrapped controller
    assert bare.seen == got  # and so does every round
    s = ctl.summary()
    assert s["bare"] == 4 and s["gate"]["declined"] == 2 and s["gate"]["probes"] == 2


def test_the_wrapper_delegates_the_stop_rule_flags_and_name():
    bare = _Bare()
    ctl = GatedLength(bare, GateConfig(enabled=True))
    assert ctl.needs_confidence is True and ctl.exact_length is False
    assert ctl.should_continue(1, 0.1) and not ctl.should_continue(2, 0.9)
    assert ctl.name == bare.name


@pytest.mark.parametrize(("inner", "lengths", "want"), [(_Bare, "upto", 5), (_BareExact, "exact", 0)])
def test_the_wrapper_values_exact_and_upto_lengths(inner, lengths, want):
    """alpha 0.7 on the cheap plan: drafting 1 token pays, 5 does not; a controller that may stop
    early is valued at its best length, one that drafts exactly K at K."""
    ctl = GatedLength(inner(), GateConfig(enabled=True, cap=False))
    assert ctl.gate.lengths == lengths
    ctl.gate.set_costs(COSTS)
    ctl.gate.plan = PLAN
    ctl.gate.acc, ctl.gate.rej = 7.0, 3.0
    assert COSTS.expected_speedup(0.7, 1, PLAN) > 1 > COSTS.expected_speedup(0.7, 5, PLAN)
    assert ctl.max_length(None) == want


# ---- in the decoder ------------------------------------------------------------------------------


class _WrongDrafter(NeverAcceptDrafter):
    """Never accepted, and reports the selector's plan (as a real drafter does)."""

    def draft(self, state, plan, length, max_tokens):
        d = super().draft(state, plan, length, max_tokens)
        d.plan = plan
        return d


class _RightDrafter(AlwaysAcceptDrafter):
    """Always accepted, and reports the selector's plan."""

    def draft(self, state, plan, length, max_tokens):
        d = super().draft(state, plan, length, max_tokens)
        d.plan = plan
        return d


def _decoder(adapter, drafter, k: int, gate: GateConfig | None = None):
    selector = StaticSelector(StaticSelectorConfig(skip_ratio=0.5))  # draft step 0.775 steps on 4 blocks
    length = gated(FixedLength(FixedLengthConfig(k=k)), gate or GateConfig())
    dec = SpeculativeDecoder(adapter, selector, length, drafter, GreedyVerifier())
    dec.prepare(prepare_context(adapter))  # the synthetic cost model
    return dec, length


@pytest.mark.parametrize("seed", [0, 1])
def test_declined_rounds_are_plain_steps_in_the_result(llama_adapter, seed):
    dec, length = _decoder(
        llama_adapter, _WrongDrafter(), k=3, gate=GateConfig(enabled=True, probe=2, probe_max=2)
    )
    prompt = random_prompt(6, 128, seed)
    stop = StopCondition(24)
    res = dec.generate(prompt, stop)
    assert res.tokens == VanillaDecoder(llama_adapter).generate(prompt, stop).tokens
    # 24 tokens, one per round (nothing is ever accepted): the first after prefill, then 23 rounds
    assert res.draft_lengths == [1] + [0, 0, 1] * 7 + [0]  # a first probe of 1, then the schedule
    assert res.accepted == 0 and res.drafted == 1 + 7
    s = res.strategy_summary["length"]["gate"]
    assert s["rounds"] == 23 and s["declined"] == 15 and s["probes"] == 8
    assert s["alpha"] == 0.0 and s["costs"] == "cost_model"
    assert s["break_even_alpha"] == round(
        break_even_alpha(synthetic_cost_model(L), dec.selector._plan, 3, "exact"), 4
    )


def test_gate_on_keeps_drafting_when_it_pays(llama_adapter):
    dec, _ = _decoder(llama_adapter, _RightDrafter(), k=3, gate=GateConfig(enabled=True))
    prompt = random_prompt(6, 128, 0)
    stop = StopCondition(24)
    res = dec.generate(prompt, stop)
    assert res.tokens == VanillaDecoder(llama_adapter).generate(prompt, stop).tokens
    assert res.draft_lengths[0] == 1  # the first probe
    assert res.draft_lengths[1:-1] == [3] * (len(res.draft_lengths) - 2)
    s = res.strategy_summary["length"]["gate"]
    assert s["declined"] == 0 and s["probes"] == 1 and s["alpha"] == 1.0


def test_gate_off_changes_nothing(llama_adapter):
    dec, length = _decoder(llama_adapter, _WrongDrafter(), k=3)
    res = dec.generate(random_prompt(6, 128, 0), StopCondition(24))
    assert not isinstance(length, GatedLength) and "length" not in res.strategy_summary
    assert res.draft_lengths == [3] * 20 + [2, 1, 0]  # the budget caps the last rounds


def test_statistics_carry_across_generations(llama_adapter):
    dec, length = _decoder(
        llama_adapter, _WrongDrafter(), k=3, gate=GateConfig(enabled=True, probe=4, probe_max=4)
    )
    dec.generate(random_prompt(6, 128, 0), StopCondition(12))
    res = dec.generate(random_prompt(6, 128, 1), StopCondition(12))
    # declines from the first round: only probes (1 token) draft, on the schedule carried over
    assert all(k <= 1 for k in res.draft_lengths)
    assert res.draft_lengths.count(1) <= 3 and res.draft_lengths[:3].count(0) >= 2
    assert res.strategy_summary["length"]["gate"]["rounds"] == len(res.draft_lengths)


class _CopyDrafter(NeverAcceptDrafter):
    """Drafts without a forward: repeats the last committed tokens (as prompt lookup copies)."""

    def draft(self, state, plan, length, max_tokens):
        toks = state.tokens[:, -max_tokens:]
        return Draft(toks.clone(), plan)


def test_a_drafter_without_forwards_is_priced_free_and_stays_lossless(llama_adapter):
    selector = StaticSelector(StaticSelectorConfig(skip_ratio=0.0))  # the full plan
    length = GatedLength(FixedLength(FixedLengthConfig(k=2)), GateConfig(enabled=True))
    dec = SpeculativeDecoder(llama_adapter, selector, length, _CopyDrafter(), GreedyVerifier())
    dec.prepare(prepare_context(llama_adapter))
    prompt, stop = random_prompt(6, 128, 2), StopCondition(24)
    res = dec.generate(prompt, stop)
    assert res.tokens == VanillaDecoder(llama_adapter).generate(prompt, stop).tokens
    s = res.strategy_summary["length"]["gate"]
    assert s["draft_forwards_per_token"] == 0.0 and res.draft_forwards == 0
    # priced as full-model draft steps the gate would decline for good (no break-even alpha)
    assert break_even_alpha(synthetic_cost_model(L), LayerPlan.full(L), 2, "exact") is None
    assert s["break_even_alpha"] is not None


_prepared: dict[str, PreparedCache] = {}


@pytest.mark.parametrize("length_name", GATED)
@pytest.mark.parametrize("selector_name", REGISTRIES["selector"].names())
def test_every_selector_with_every_gated_controller_is_lossless(deep_adapters, selector_name, length_name):
    adapter = deep_adapters["llama"]
    selector = default_strategy_instance("selector", selector_name, fast=True)
    length = gated(default_strategy_instance("length", length_name), GateConfig(enabled=True, probe=2))
    drafter = default_strategy_instance("drafter", "layer_skip")
    dec = SpeculativeDecoder(adapter, selector, length, drafter, GreedyVerifier())
    dec.prepare(prepare_context(adapter, prepared=_prepared.setdefault("llama", PreparedCache())))
    for seed, plen in ((0, 6), (1, 11)):
        prompt = random_prompt(plen, 128, seed)
        stop = StopCondition(24)
        res = dec.generate(prompt, stop)
        assert res.tokens == VanillaDecoder(adapter).generate(prompt, stop).tokens
        s = res.strategy_summary["length"]["gate"]
        assert s["rounds"] == len(res.draft_lengths)
        assert s["declined"] + s["calibration_rounds"] <= res.draft_lengths.count(0)


def test_the_gate_prices_each_round_at_its_context():
    """A cost model measured at two contexts (`CostModel.at_context`): where verifying extra tokens
    gets dear at a long context, the same acceptance drafts at 128 tokens and declines at 1152."""
    from dataclasses import replace

    n = len(COSTS.verify_costs)
    far = replace(
        COSTS,
        context=128,
        far_context=1152,
        far_attn=COSTS.attn,
        far_verify_costs=tuple(1.0 + 1.0 * t for t in range(n)),  # T tokens cost T steps
    )
    gate = _gate(0.95)
    gate.set_costs(far)
    short = types.SimpleNamespace(stats=DecodeStats(), num_tokens=128)
    long = types.SimpleNamespace(stats=DecodeStats(), num_tokens=1152)
    assert gate.limit(short, 4) > 0
    assert gate.limit(long, 4) == 0
