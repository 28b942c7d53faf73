"""strategies/selectors/swift.py: on-the-fly random search + interval GP, matchness, phases."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from framework import Draft, LayerPlan, ModelInfo, Verification
from framework.config_fields import ConfigError, build_config
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.search.budget import WorkBudget
from framework.testing import (
    FakeClock,
    LayerSelectorContract,
    cached_tiny_model,
    default_strategy_instance,
    random_prompt,
)
from strategies.selectors.swift import SwiftConfig, SwiftSelector

L = 8
SMALL = {"context_window": 4, "bo_interval": 3, "skip_ratio": 0.3}


def make(**kw) -> SwiftSelector:
    return SwiftSelector(build_config(SwiftConfig, {**SMALL, **kw}))


@pytest.fixture(scope="module")
def adapter():
    return adapter_for(cached_tiny_model("llama", L, seed=1))


def decoder(adapter, sel, length="confidence", verifier="greedy"):
    return SpeculativeDecoder(
        adapter,
        sel,
        default_strategy_instance("length", length),
        default_strategy_instance("drafter", "layer_skip"),
        default_strategy_instance("verifier", verifier),
    )


def greedy_state(adapter, prompt_len=6, new=20, seed=0) -> DecodeState:
    """A state holding ``new`` greedily generated tokens (committed KV = full model)."""
    prompt = random_prompt(prompt_len, 128, seed)
    toks = VanillaDecoder(adapter).generate(prompt, StopCondition(new)).tokens
    state = DecodeState(adapter, torch.cat([prompt, torch.tensor([toks[:-1]])], 1), prompt_len + new + 8)
    state.prefill()
    state.append(torch.tensor([[toks[-1]]]))
    state.prompt_len = prompt_len  # the generated part is the window's source
    return state


class TestSwiftContract(LayerSelectorContract):
    num_layers = 6

    def make(self):
        return make()


@pytest.mark.parametrize("verifier", ["greedy", "tree"])
@pytest.mark.parametrize("window", ["first", "sliding"])
def test_lossless_while_optimising(adapter, window, verifier):
    sel = make(window=window, matchness_stop=1.0)  # never stops: every round after the window optimises
    dec = decoder(adapter, sel, verifier=verifier)
    steps = 0
    for seed in range(3):
        prompt = random_prompt(6, 128, seed)
        want = VanillaDecoder(adapter).generate(prompt, StopCondition(40)).tokens
        res = dec.generate(prompt, StopCondition(40))
        assert res.tokens == want
        steps += res.strategy_summary["selector"]["opt_steps"]
    assert steps > 10 and sel.bo.num_fits > 0


def test_matchness_of_the_full_model_is_one_and_leaves_the_cache_intact(adapter):
    state = greedy_state(adapter)
    sel = make(context_window=8)
    sel.setup(adapter.arch.info())
    sel.reset()
    c = state.cache.committed

    def committed_kv():
        return [t[..., :c, :].clone() for t in (state.cache.keys, state.cache.values)], list(
            state.cache.lengths
        )

    before = committed_kv()
    assert sel.matchness(state, LayerPlan.full(L)) == 1.0  # the window is the full model's greedy output
    skip = LayerPlan.from_indices(L, attn=range(1, 7), mlp=range(1, 7))
    m = sel.matchness(state, skip)
    assert 0.0 <= m < 1.0
    after = committed_kv()
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
    assert before[1] == after[1] and state.cache.committed == c == state.num_tokens - 1


def test_matchness_counts_next_token_agreement(adapter):
    """The score is the fraction of window positions whose draft argmax is the next committed token."""
    state = greedy_state(adapter)
    sel = make(context_window=8)
    sel.setup(adapter.arch.info())
    plan = LayerPlan.from_indices(L, attn=[2, 5], mlp=[3])
    start, end = sel.window_span(state)
    assert (start, end) == (6, 14)
    logits = state.forward_scratch(start, plan, end=end).logits
    want = (logits.argmax(-1) == state.tokens[:, start + 1 : end + 1]).float().mean().item()
    assert sel.matchness(state, plan) == pytest.approx(want)
    sliding = make(context_window=8, window="sliding")
    sliding.setup(adapter.arch.info())
    assert sliding.window_span(state) == (state.num_tokens - 9, state.num_tokens - 1)


def test_random_search_respects_the_ratio_and_gp_runs_every_beta_steps(adapter, monkeypatch):
    sel = make(skip_ratio=0.4, bo_interval=4)
    sel.setup(adapter.arch.info())
    assert sel.n_skip == int(0.4 * 2 * (L - 2))
    proposed = []
    real = sel.matchness
    monkeypatch.setattr(sel, "matchness", lambda state, plan: proposed.append(plan) or real(state, plan))
    dec = decoder(adapter, sel)
    dec.generate(random_prompt(6, 128, 0), StopCondition(64))
    assert len(proposed) == sel.steps >= 8
    for plan in proposed:
        assert plan.num_skipped == sel.n_skip
        assert not (plan.attn_skip[0] or plan.mlp_skip[0] or plan.attn_skip[-1] or plan.mlp_skip[-1])
    assert sel.bo.num_fits == sel.steps // 4  # exactly the beta-th steps asked the GP
    assert len(sel.bo.Y) == sel.steps  # every evaluated candidate feeds the GP


def test_best_set_drafts_and_strict_improvement(adapter):
    sel = make()
    dec = decoder(adapter, sel)
    res = dec.generate(random_prompt(6, 128, 1), StopCondition(48))
    s = res.strategy_summary["selector"]
    assert s["best_matchness"] == pytest.approx(max(s["matchness"]))
    assert sel.best == max(sel.bo.Y)
    assert (
        LayerPlan.from_indices(L, **{"attn": s["plan"]["attn_skip"], "mlp": s["plan"]["mlp_skip"]})
        == sel.current
    )


def test_initial_sets(adapter):
    sel = make()
    sel.setup(adapter.arch.info())
    assert sel.current == LayerPlan.from_indices(L, attn=[1, 3, 5], mlp=[1, 3, 5])  # odd blocks 1..L-3
    uni = make(initial_set="uniform")
    uni.setup(adapter.arch.info())
    assert uni.current.num_skipped == int(0.3 * 2 * (L - 2))


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"matchness_stop": 0.01}, "matchness"),
        ({"patience": 2}, "patience"),
        ({"max_opt_steps": 3}, "max_opt_steps"),
    ],
)
def test_stop_conditions_end_optimisation_for_good(adapter, overrides, reason):
    sel = make(**overrides)
    dec = decoder(adapter, sel)
    dec.generate(random_prompt(6, 128, 0), StopCondition(64))
    assert not sel.optimising and sel.stop_reason == reason
    steps, plan = sel.steps, sel.current
    res = dec.generate(random_prompt(6, 128, 1), StopCondition(48))
    assert sel.steps == steps and sel.current == plan  # acceleration phase: no more steps
    assert res.strategy_summary["selector"]["phase"] == "accelerating"


@pytest.mark.parametrize("persist", [True, False])
def test_state_across_prompts(adapter, persist):
    sel = make(persist_across_prompts=persist, matchness_stop=1.0)
    dec = decoder(adapter, sel)
    dec.generate(random_prompt(6, 128, 0), StopCondition(40))
    first = sel.steps
    res = dec.generate(random_prompt(6, 128, 1), StopCondition(40))
    gen = res.strategy_summary["selector"]["opt_steps"]
    assert first > 0 and gen > 0
    assert sel.steps == (first + gen if persist else gen)


def test_retrigger_restarts_optimisation(adapter):
    sel = make(matchness_stop=0.01, retrigger_below=0.99, retrigger_window=2)
    dec = decoder(adapter, sel, length="fixed")
    for seed in range(3):
        dec.generate(random_prompt(6, 128, seed), StopCondition(48))
    assert sel.retriggers >= 1


def test_summary_logs_the_optimisation(adapter):
    sel = make()
    res = decoder(adapter, sel).generate(random_prompt(6, 128, 0), StopCondition(40))
    s = res.strategy_summary["selector"]
    assert s["opt_steps"] == len(s["matchness"]) > 0
    assert 0 < s["opt_seconds"] <= res.wall_time and 0 < s["opt_share"] < 1
    assert s["bo_steps"] == sel.bo.num_fits
    assert set(s["plan"]) >= {"attn_skip", "mlp_skip", "skip_ratio"}


def test_bad_config_and_model():
    for field, value, match in [
        ("skip_ratio", 0.0, "skip_ratio"),
        ("skip_ratio", 1.0, "skip_ratio"),
        ("context_window", 1, "context_window"),
        ("bo_interval", 0, "bo_interval"),
        ("matchness_stop", 0.0, "matchness_stop"),
        ("window", "all", "window"),
        ("initial_set", "random", "initial_set"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_config(SwiftConfig, {field: value})
    sel = make(skip_ratio=0.1)
    with pytest.raises(ConfigError, match="skip_ratio"):
        sel.setup(ModelInfo(num_layers=4, hidden_size=8, vocab_size=16, max_context=64))


# ---- the work budget (an extension) ------------------------------------------------------------


def on_fake_clock(sel, monkeypatch, step_seconds: float) -> FakeClock:
    """Give ``sel`` a budget of its configured share on a fake clock where every decoding round
    takes 1 s and every optimisation step ``step_seconds`` (the steps themselves run for real)."""
    clock = FakeClock()
    sel.budget = WorkBudget(sel.config.work_budget, clock=clock)
    plan, step = sel.plan, sel._step

    def timed_plan(state):
        clock.t += 1.0
        return plan(state)

    def timed_step(state):
        step(state)
        clock.t += step_seconds

    monkeypatch.setattr(sel, "plan", timed_plan)
    monkeypatch.setattr(sel, "_step", timed_step)
    return clock


def due_steps(res, context_window: int = SMALL["context_window"]) -> int:
    """Rounds of a generation after which a step was due (opt_interval 1): once more than
    ``context_window + 1`` tokens are new (the prefill's token included)."""
    return sum(1 + n > context_window + 1 for n in itertools.accumulate(res.accept_lengths))


def test_work_budget_skips_steps_and_reports_it(adapter, monkeypatch):
    sel = make(work_budget=0.25, matchness_stop=1.0)  # never stops on its own
    dec = decoder(adapter, sel)
    on_fake_clock(sel, monkeypatch, step_seconds=1.0)
    prompt = random_prompt(6, 128, 0)
    res = dec.generate(prompt, StopCondition(64))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(64)).tokens
    s = res.strategy_summary["selector"]
    # a skipped step advances no counter: the steps taken are exactly the budget's units
    assert 0 < s["opt_steps"] == s["budget_units"] == sel.steps == len(s["matchness"])
    assert s["budget_units"] + s["budget_skipped"] == due_steps(res)
    assert s["budget_skipped"] >= s["opt_steps"]  # a 1 s step fits in one of every 3-4 rounds
    assert s["opt_seconds"] == s["opt_steps"] * 1.0  # the steps' timing is the budget's
    assert s["work_share"] <= 0.25 + 1.0 / sel.budget.wall_seconds  # at most one step over
    assert s["phase"] == "optimising" and s["stop_reason"] == ""


def test_zero_work_budget_changes_nothing(adapter, monkeypatch):
    """Unlimited: every due step runs however long it takes, exactly as without the budget."""
    prompt = random_prompt(6, 128, 1)
    want = decoder(adapter, make(matchness_stop=1.0)).generate(prompt, StopCondition(48))
    sel = make(work_budget=0.0, matchness_stop=1.0)
    dec = decoder(adapter, sel)
    on_fake_clock(sel, monkeypatch, step_seconds=1000.0)
    res = dec.generate(prompt, StopCondition(48))
    s, w = res.strategy_summary["selector"], want.strategy_summary["selector"]
    assert res.tokens == want.tokens and res.accept_lengths == want.accept_lengths
    assert s["matchness"] == w["matchness"] and s["plan"] == w["plan"]
    assert s["budget_skipped"] == 0 and s["budget_units"] == s["opt_steps"] > 0


@pytest.mark.parametrize("persist", [True, False])
def test_work_budget_lives_as_long_as_the_optimisation_state(adapter, monkeypatch, persist):
    """Carried across generations with the state (idle time in between earns no budget), or
    restarted with it."""
    sel = make(work_budget=0.25, matchness_stop=1.0, persist_across_prompts=persist)
    dec = decoder(adapter, sel)
    clock = on_fake_clock(sel, monkeypatch, step_seconds=1.0)
    dec.generate(random_prompt(6, 128, 0), StopCondition(48))
    units, skipped = sel.budget.units, sel.budget.skipped
    clock.t += 1e6  # e.g. other methods of a benchmark decode meanwhile
    res = dec.generate(random_prompt(6, 128, 1), StopCondition(48))
    s = res.strategy_summary["selector"]
    if not persist:
        units = skipped = 0
    assert s["budget_units"] == units + s["opt_steps"]
    assert s["budget_units"] + s["budget_skipped"] == units + skipped + due_steps(res)
    assert s["budget_skipped"] > skipped  # (persisting) the idle 1e6 s gave no credit


@pytest.mark.parametrize("value", ["-0.1", "1.0", "nan"])
def test_bad_work_budget(value):
    with pytest.raises(ConfigError, match=r"^--selector\.work_budget must be in \[0, 1\), got "):
        build_config(SwiftConfig, {"work_budget": value}, flag_prefix="--selector.")


def test_matchness_scores_with_the_draft_head(adapter):
    """With a reduced draft head the window's predictions are the argmax among the head's tokens
    (what the draft would propose), mapped to token ids."""
    from framework.engine.draft_head import DraftHead

    state = greedy_state(adapter)
    sel = make(context_window=8)
    sel.setup(adapter.arch.info())
    plan = LayerPlan.from_indices(L, attn=[2, 5], mlp=[3])
    start, end = sel.window_span(state)
    target = state.tokens[:, start + 1 : end + 1]
    full = state.forward_scratch(start, plan, end=end).logits  # (1, T, V)
    ids = sorted(set(target[0, ::2].tolist()) | set(range(0, 128, 5)))  # some targets outside the head
    state.draft_head = DraftHead(adapter, ids)
    want = (torch.tensor(ids)[full[..., ids].argmax(-1)] == target).float().mean().item()
    assert sel.matchness(state, plan) == pytest.approx(want)


# ---- adaptive r (the later revision's App. C.2 footnote) ----------------------------------------

ADAPT = {"skip_ratio": 0.5, "adaptive_r_below": 0.7, "adaptive_r_window": 3}
NOT_YET = SimpleNamespace(num_new=0)  # a state before the context window: observe runs no step


def _round(drafted: int, accepted: int) -> tuple[Draft, Verification]:
    tokens = torch.zeros(1, drafted, dtype=torch.long)
    new = torch.zeros(1, accepted + 1, dtype=torch.long)
    return Draft(tokens, LayerPlan.full(L)), Verification(torch.tensor([accepted]), new)


def _drive(sel: SwiftSelector, outcomes) -> list[float]:
    """r after each scripted (drafted, accepted) round."""
    rs = []
    for drafted, accepted in outcomes:
        sel.observe(NOT_YET, *_round(drafted, accepted))
        rs.append(sel.ratio)
    return rs


def test_adaptive_r_defaults_and_validation():
    c = SwiftConfig()
    assert (c.adaptive_r_below, c.adaptive_r_step, c.adaptive_r_window, c.adaptive_r_min) == (
        0.0,
        0.1,
        50,
        0.2,
    )
    for field, value, match in [
        ("adaptive_r_below", 1.0, r"^adaptive_r_below must be in \[0, 1\), got 1\.0$"),
        ("adaptive_r_below", -0.1, r"^adaptive_r_below must be in \[0, 1\)"),
        ("adaptive_r_step", 0.0, r"^adaptive_r_step must be in \(0, 1\)"),
        ("adaptive_r_window", 0, r"^adaptive_r_window must be an integer >= 1"),
        ("adaptive_r_min", 0.0, r"^adaptive_r_min must be in \(0, 1\)"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_config(SwiftConfig, {field: value})
    with pytest.raises(
        ConfigError, match=r"^adaptive_r_min must be at most skip_ratio \(0\.3\) when adaptive"
    ):
        build_config(SwiftConfig, {"skip_ratio": 0.3, "adaptive_r_below": 0.7, "adaptive_r_min": 0.35})
    build_config(SwiftConfig, {"skip_ratio": 0.15})  # off: the floor is not checked


def test_adaptive_r_follows_the_rule_on_scripted_rounds(adapter):
    """While optimising, r drops by adaptive_r_step once the acceptance rate of the last
    adaptive_r_window drafting rounds is below adaptive_r_below (0.5 -> 0.4 as in the footnote),
    and never below adaptive_r_min."""
    sel = make(**ADAPT)
    sel.setup(adapter.arch.info())  # L_eff = 2 * 6 = 12
    assert (sel.ratio, sel.n_skip) == (0.5, 6)
    x = sel._random_candidate()
    sel.bo.observe(x, 0.5)
    sel.steps, sel.stale = 7, 3
    # not yet 3 drafting rounds (an empty round does not count); then 6 of 12 accepted: 0.5 < 0.7
    assert _drive(sel, [(4, 4), (4, 1), (0, 0), (4, 1)]) == [0.5, 0.5, 0.5, 0.4]
    assert (sel.n_skip, sel.bo.cardinality, sel.r_adjustments) == (4, 4, 1)
    assert sel.rebase and sel.steps == sel.stale == 0 and len(sel.recent_opt) == 0
    assert sel.bo.X == [x] and sel.bo.Y == [0.5]  # the GP keeps what it observed
    # a fresh window at the new r: 7 of 10 accepted is not below 0.7 (strict), 8 of 10 neither, 7 of 11 is
    assert _drive(sel, [(4, 3), (3, 2), (3, 2), (4, 4), (4, 1)]) == [0.4, 0.4, 0.4, 0.4, 0.3]
    assert sel.n_skip == 3
    assert _drive(sel, [(2, 0), (2, 0), (2, 0)]) == [0.3, 0.3, 0.2]
    assert _drive(sel, [(2, 0)] * 6) == [0.2] * 6  # the floor: 0.2 - 0.1 < adaptive_r_min
    assert sel.r_adjustments == 3
    s = sel.summary()
    assert (s["r"], s["r_adjustments"]) == (0.2, 3)


def test_adaptive_r_only_while_optimising_and_only_when_on(adapter):
    off = make(skip_ratio=0.5)
    off.setup(adapter.arch.info())
    assert _drive(off, [(4, 0)] * 60) == [0.5] * 60 and off.r_adjustments == 0
    done = make(**ADAPT)
    done.setup(adapter.arch.info())
    done._stop("patience")
    assert _drive(done, [(4, 0)] * 6) == [0.5] * 6  # the acceleration phase keeps r


@pytest.mark.parametrize("persist", [True, False])
def test_adaptive_r_lives_as_long_as_the_optimisation_state(adapter, persist):
    sel = make(**ADAPT, persist_across_prompts=persist)
    sel.setup(adapter.arch.info())
    _drive(sel, [(4, 0)] * 3)
    assert sel.ratio == 0.4
    sel.reset()
    assert (sel.ratio, sel.n_skip) == ((0.4, 4) if persist else (0.5, 6))


def test_after_lowering_r_the_next_candidate_replaces_the_current_set(adapter):
    """The current set has the old cardinality: the first candidate at the new r drafts next,
    whatever its matchness; later candidates must improve strictly, as before."""
    state = greedy_state(adapter)
    sel = make(**ADAPT, matchness_stop=1.0)
    sel.setup(adapter.arch.info())
    sel.best = 2.0  # nothing can beat it
    sel._step(state)
    assert sel.current.num_skipped == 6 and sel.gen_improvements == 0  # odd blocks: not replaced
    sel.set_ratio(0.25)
    sel._step(state)
    assert sel.current.num_skipped == sel.n_skip == 3 and not sel.rebase
    assert sel.best == sel.bo.Y[-1] < 2.0  # replaced though it did not beat the best
    first = sel.current
    sel.best = 2.0
    sel._step(state)
    assert sel.current == first  # strict improvement again


def test_adaptive_r_in_the_decoder_is_lossless_and_proposes_the_new_cardinality(adapter, monkeypatch):
    sel = make(skip_ratio=0.5, adaptive_r_below=0.99, adaptive_r_window=2, matchness_stop=1.0)
    proposed = []
    real = sel.matchness
    monkeypatch.setattr(
        sel,
        "matchness",
        lambda state, plan: proposed.append((plan.num_skipped, sel.n_skip)) or real(state, plan),
    )
    dec = decoder(adapter, sel)
    for seed in range(3):
        prompt = random_prompt(6, 128, seed)
        res = dec.generate(prompt, StopCondition(48))
        assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(48)).tokens
    s = res.strategy_summary["selector"]
    assert s["r_adjustments"] >= 1 and s["r"] < 0.5
    assert all(k == n for k, n in proposed)  # every candidate has the cardinality of its time
    assert any(n < 6 for _, n in proposed), "no candidate was proposed at a lowered r: vacuous"
