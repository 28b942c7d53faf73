"""strategies/drafters/hybrid.py: the contract (on both sources, and with the layer-skip gate), the
switch between the copy and the layer-skip draft (and ``min_match``), the per-source summary,
losslessness with the greedy, tree and sampling verifiers, the layer-skip gate (declines a source that
cannot pay, keeps one that pays, probes, tries a new plan) and the config checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from framework import LayerPlan, LayerSelector
from framework.config_fields import ConfigError, build_config
from framework.engine.cost_model import CostModel
from framework.engine.decoding import StopCondition, VanillaDecoder
from framework.testing import DrafterContract, prepare_context, random_prompt
from strategies.drafters.hybrid import HybridDrafter, HybridDrafterConfig
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.confidence import ConfidenceLength
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier
from strategies.verifiers.tree import TreeVerifier
from tests.strategies.drafters.test_prompt_lookup import (
    LOOP_PROMPT,
    N_SAMPLES,
    P_MIN,
    _decoder,
    _LookupContract,
    _state,
    sampled_marginals_pvalues,
)

L = 4
V = 128
PLAN = LayerPlan.from_indices(L, attn=[1], mlp=[2])


class TestHybridContract(DrafterContract):
    """On the contract's random prompts most rounds find no match: the layer-skip source."""

    def make(self):
        return HybridDrafter()


class TestHybridGatedContract(DrafterContract):
    """With the layer-skip gate a round without a match may decline (an empty draft)."""

    may_decline = True

    def make(self):
        return HybridDrafter(HybridDrafterConfig(skip_gate=True))


class TestHybridLookupContract(_LookupContract):
    """On prompts that hold every token, every round copies (``min_match`` 1)."""

    arch = "qwen2"

    def make(self):
        return HybridDrafter(HybridDrafterConfig(min_match=1))

    def _check_draft(self, draft, state, plan, max_tokens):
        # the lookup contract's checks, with this config's n range (min_match is the min n-gram)
        assert draft.length >= 1, "the hybrid always drafts (the layer-skip draft when nothing matches)"
        if draft.source == "lookup":
            super()._check_draft(draft, state, plan, max_tokens)
        else:
            DrafterContract._check_draft(self, draft, state, plan, max_tokens)


def test_copies_on_a_match_without_forward(llama_adapter):
    state = _state(llama_adapter, [5, 6, 7, 8, 5, 6, 7, 8, 5], [6])
    calls = llama_adapter.executor.forward_calls
    d = HybridDrafter().draft(state, PLAN, FixedLength(), 5)
    assert d.tokens.tolist() == [[7, 8, 5, 6, 7]] and d.source == "lookup"
    assert llama_adapter.executor.forward_calls == calls and state.draft_len == 0
    assert d.plan is PLAN


@pytest.mark.parametrize(
    "prompt, generated, min_match",
    [
        ([1, 2, 3, 4, 5], [6], 1),  # no match at all
        ([1, 2, 9, 3, 4, 5], [9], 2),  # a unigram match only, below min_match
        ([7, 8, 1, 2, 7, 3], [9], 3),  # (7, 3, 9) never occurred, (3, 9) neither: no match
    ],
)
def test_falls_back_to_the_layer_skip_draft(llama_adapter, prompt, generated, min_match):
    cfg = HybridDrafterConfig(min_match=min_match)
    state = _state(llama_adapter, prompt, generated)
    want = LayerSkipDrafter().draft(state, PLAN, FixedLength(), 3)
    state.discard_draft()
    calls = llama_adapter.executor.forward_calls
    d = HybridDrafter(cfg).draft(state, PLAN, FixedLength(), 3)
    assert d.source == "layer_skip"
    assert torch.equal(d.tokens, want.tokens) and d.plan is PLAN
    assert llama_adapter.executor.forward_calls == calls + 3  # one draft forward per token


def test_min_match_decides_the_source(llama_adapter):
    # the last two tokens (3, 4) occurred before, three (2, 3, 4) did not
    prompt, generated = [3, 4, 9, 1, 2, 3], [4]
    for min_match, source in ((1, "lookup"), (2, "lookup"), (3, "layer_skip")):
        state = _state(llama_adapter, prompt, generated)
        d = HybridDrafter(HybridDrafterConfig(min_match=min_match)).draft(state, PLAN, FixedLength(), 2)
        assert d.source == source, min_match
        if source == "lookup":
            assert d.tokens.tolist() == [[9, 1]]


def test_switches_sources_and_reports_them(llama_adapter):
    """On the looping prompt the first round has nothing to copy (layer skip), the loop then copies."""
    prompt, stop = torch.tensor([LOOP_PROMPT]), StopCondition(40)
    want = VanillaDecoder(llama_adapter).generate(prompt, stop).tokens
    drafter = HybridDrafter(HybridDrafterConfig(min_match=1))
    selector = StaticSelector(StaticSelectorConfig(skip_attn=(1,), skip_mlp=(2,)))
    res = _decoder(
        llama_adapter, length=FixedLength(FixedLengthConfig(k=6)), drafter=drafter, selector=selector
    )
    res = res.generate(prompt, stop)
    assert res.tokens == want
    s = res.strategy_summary["drafter"]
    assert s["sources"][0] == "S" and "L" in s["sources"]
    # one letter per drafting round (the last round, with no token budget left, drafts nothing)
    drafting_rounds = sum(k > 0 for k in res.draft_lengths)
    assert len(s["sources"]) == s["lookup"]["rounds"] + s["layer_skip"]["rounds"] == drafting_rounds
    assert s["lookup"]["drafted"] + s["layer_skip"]["drafted"] == res.drafted
    assert s["lookup"]["accepted"] + s["layer_skip"]["accepted"] == res.accepted
    assert s["lookup"]["accepted"] >= 0.8 * s["lookup"]["drafted"] > 0
    # only the layer-skip rounds ran draft forwards
    assert res.draft_forwards == s["layer_skip"]["drafted"]
    assert s["search_ms"] >= 0
    drafter.reset()
    assert drafter.summary()["sources"] == ""


@pytest.mark.parametrize("skip_gate", [False, True])
@pytest.mark.parametrize("verifier", ["greedy", "tree"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_lossless_with_greedy_and_tree(adapters, arch, verifier, skip_gate):
    """Both sources, and with the gate (costs measured: the decoder is not prepared) declined rounds."""
    adapter = adapters[arch]
    selector = StaticSelector(StaticSelectorConfig(skip_ratio=0.5))
    prompts = [LOOP_PROMPT, random_prompt(6, V, 0)[0].tolist(), random_prompt(11, V, 4)[0].tolist()]
    sources = ""
    for length in (FixedLength(FixedLengthConfig(k=4)), ConfidenceLength()):
        dec = _decoder(
            adapter,
            GreedyVerifier() if verifier == "greedy" else TreeVerifier(),
            length,
            HybridDrafter(HybridDrafterConfig(min_match=1, skip_gate=skip_gate)),
            selector,
        )
        for p in prompts:
            prompt, stop = torch.tensor([p]), StopCondition(32)
            res = dec.generate(prompt, stop)
            assert res.tokens == VanillaDecoder(adapter).generate(prompt, stop).tokens, (arch, verifier, p)
            sources += res.strategy_summary["drafter"]["sources"]
    assert "L" in sources and "S" in sources
    assert ("-" in sources) == skip_gate


def test_speculative_sampling_with_both_sources_matches_the_target():
    selector = StaticSelector(StaticSelectorConfig(skip_attn=(1, 2), skip_mlp=(1, 2)))
    pvals, results = sampled_marginals_pvalues(HybridDrafter, selector=selector)
    sources = "".join(r.strategy_summary["drafter"]["sources"] for r in results)
    print(
        f"\nhybrid + sampling: p-values {[round(p, 4) for p in pvals]}, sources L/S {sources.count('L')}/{sources.count('S')}"
    )
    assert sources.count("L") >= N_SAMPLES // 10 and sources.count("S") >= N_SAMPLES // 10
    assert min(pvals) > P_MIN, f"speculative sampling with the hybrid drafter is biased: p = {pvals}"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_ngram": 0}, r"^--drafter\.max_ngram must be an integer in \[1, 32\], got 0$"),
        ({"min_match": 0}, r"^--drafter\.min_match must be an integer in \[1, 3\], got 0$"),
        ({"min_match": 4}, r"^--drafter\.min_match must be an integer in \[1, 3\], got 4$"),
        ({"max_ngram": 5, "min_match": 6}, r"^--drafter\.min_match must be an integer in \[1, 5\], got 6$"),
        ({"confidence": 2}, r"^--drafter\.confidence must be in \[0, 1\], got 2$"),
        ({"skip_gate": 2}, r"^--drafter\.skip_gate must be a boolean \(true/false\), got 2$"),
        ({"skip_gate": "maybe"}, r"^--drafter\.skip_gate must be a boolean \(true/false\), got 'maybe'$"),
        ({"min_ngram": 1}, r"^--drafter\.min_ngram must be a field of HybridDrafterConfig"),
    ],
)
def test_bad_config_names_the_field_and_range(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(HybridDrafterConfig, values, "--drafter.")


def test_config_reaches_the_lookup():
    d = HybridDrafter(
        build_config(HybridDrafterConfig, {"max_ngram": "4", "min_match": "3", "confidence": "0.8"})
    )
    assert (d.lookup.config.max_ngram, d.lookup.config.min_ngram, d.lookup.config.confidence) == (4, 3, 0.8)
    assert HybridDrafterConfig() == HybridDrafterConfig(
        max_ngram=3, min_match=2, confidence=1.0, skip_gate=False
    )
    assert d.gate is None
    assert HybridDrafter(build_config(HybridDrafterConfig, {"skip_gate": "true"})).gate is not None


# --------------------------------------------------------------------------------------------
# The layer-skip gate (skip_gate)
# --------------------------------------------------------------------------------------------


def _costs(base: float, verify_slope: float, attn: float = 0.0, mlp: float = 0.0) -> CostModel:
    """A cost model in units of one plain step: a draft token costs ``base`` (+ ``attn`` / ``mlp``
    per sub-layer run), a verification of T tokens ``1 + verify_slope * (T - 1)``."""
    return CostModel(
        num_layers=L,
        base=base,
        attn=attn,
        mlp=mlp,
        verify_costs=tuple(1.0 + verify_slope * (t - 1) for t in range(1, 17)),
    )


#: A draft token costs a plain step and a longer verification costs more: never pays, at any alpha.
NEVER_PAYS = _costs(1.0, 0.1)
#: A draft token is almost free and verifying more tokens costs nothing extra: pays from alpha 0.01
#: (one draft token) or 0.04 (exactly four).
ALWAYS_PAYS = _costs(0.01, 0.0)
GATE_PROMPTS = [LOOP_PROMPT] + [random_prompt(8, V, seed)[0].tolist() for seed in range(3)]


def _gated_run(adapter, costs, selector=None, prompts=GATE_PROMPTS, new_tokens=40):
    """Generate every prompt with the gated hybrid (``min_match`` 1, fixed K = 4) after preparing
    with ``costs``; checks each output against vanilla greedy; returns the results."""
    dec = _decoder(
        adapter,
        length=FixedLength(FixedLengthConfig(k=4)),
        drafter=HybridDrafter(HybridDrafterConfig(min_match=1, skip_gate=True)),
        selector=selector or StaticSelector(StaticSelectorConfig(skip_attn=(1,), skip_mlp=(2,))),
    )
    dec.prepare(prepare_context(adapter, cost_model=costs))
    results = []
    for p in prompts:
        prompt, stop = torch.tensor([p]), StopCondition(new_tokens)
        res = dec.generate(prompt, stop)
        assert res.tokens == VanillaDecoder(adapter).generate(prompt, stop).tokens, p
        results.append(res)
    return results


def _check_counts(res):
    """The summary's per-source counts agree with each other and with the decode's totals."""
    s = res.strategy_summary["drafter"]
    lookup, skip, gate = s["lookup"], s["layer_skip"], s["skip_gate"]
    assert len(s["sources"]) == lookup["rounds"] + skip["rounds"] + skip["declined"]
    assert (s["sources"].count("L"), s["sources"].count("S"), s["sources"].count("-")) == (
        lookup["rounds"],
        skip["rounds"],
        skip["declined"],
    )
    assert lookup["drafted"] + skip["drafted"] == res.drafted
    assert lookup["accepted"] + skip["accepted"] == res.accepted
    assert res.draft_forwards == skip["drafted"]  # declined rounds ran no forward
    # the gate saw every round without a match, the generation's last one included
    assert gate["rounds"] == skip["rounds"] + skip["declined"]
    assert gate["declined"] + gate["calibration_rounds"] == skip["declined"]
    return s


def test_gate_declines_a_layer_skip_source_that_cannot_pay(llama_adapter):
    results = _gated_run(llama_adapter, NEVER_PAYS)
    summaries = [_check_counts(r) for r in results]
    # the first round without a match drafts (no estimate yet: the gate's first probe); from then
    # on such rounds decline, across generations (the estimate and the plan carry), without
    # probes: no alpha could pay
    first = summaries[0]["sources"]
    assert first[0] == "S" and "S" not in first[1:]
    assert all("S" not in s["sources"] for s in summaries[1:])
    assert summaries[0]["skip_gate"]["probes"] == 1
    assert all(s["skip_gate"]["probes"] == 0 for s in summaries[1:])
    assert sum(s["layer_skip"]["declined"] for s in summaries) >= 20
    assert sum(r.draft_forwards for r in results[1:]) == 0
    # rounds with a match still copy
    assert all(s["lookup"]["rounds"] > 0 for s in summaries)
    assert sum(s["lookup"]["accepted"] for s in summaries) >= 20
    gate = summaries[-1]["skip_gate"]
    assert gate["costs"] == "cost_model" and gate["break_even_alpha"] is None and gate["alpha"] is not None


def test_gate_keeps_a_layer_skip_source_that_pays(llama_adapter):
    results = _gated_run(llama_adapter, ALWAYS_PAYS)
    summaries = [_check_counts(r) for r in results]
    sources = "".join(s["sources"] for s in summaries)
    assert "-" not in sources and "L" in sources
    assert sum(s["layer_skip"]["rounds"] for s in summaries) >= 10
    alphas = [s["skip_gate"]["alpha"] for s in summaries]
    assert all(a is not None and 0.0 <= a <= 1.0 for a in alphas)
    # the fixed controller always drafts K = 4: the gate values S(4) ("exact"), not the best S(k <= 4)
    assert 0.03 < summaries[-1]["skip_gate"]["break_even_alpha"] < 0.05


def test_gate_probes_while_declining(llama_adapter):
    """A source that pays only at high acceptance is declined at this tiny model's, and probed."""
    costs = _costs(0.3, 0.1)  # S(1) >= 1 from alpha 0.4
    selector = StaticSelector(StaticSelectorConfig(skip_ratio=0.5))
    prompts = [random_prompt(8, V, seed)[0].tolist() for seed in range(4)]
    results = _gated_run(llama_adapter, costs, selector, prompts, 48)
    summaries = [_check_counts(r) for r in results]
    assert sum(s["layer_skip"]["declined"] for s in summaries) >= 40
    assert sum(s["skip_gate"]["probes"] for s in summaries) >= 2
    # A layer-skip round right after a declined one is a probe (declined rounds add no data). It
    # drafts the gate's best length at the current alpha (1 or 2 tokens here), not the controller's 4.
    probes = []
    for res, s in zip(results, summaries, strict=True):
        gated = [(c, k) for c, k in zip(s["sources"], res.draft_lengths, strict=False) if c != "L"]
        probes += [
            k for (before, _), (c, k) in zip(gated, gated[1:], strict=False) if (before, c) == ("-", "S")
        ]
    assert len(probes) >= 2 and max(probes) < 4


@dataclass(frozen=True)
class _NoConfig:
    pass


class _SwitchingSelector(LayerSelector):
    """Plan ``before`` until round ``at``, then ``after`` (as an online selector that finds a new set)."""

    Config = _NoConfig

    def __init__(self, before: LayerPlan, after: LayerPlan, at: int) -> None:
        super().__init__()
        self.before, self.after, self.at = before, after, at

    def plan(self, state) -> LayerPlan:
        return self.before if state.round < self.at else self.after


def test_gate_tries_a_new_plan_of_the_selector(llama_adapter):
    """Declined rounds carry the selector's plan: when it changes, the gate probes the new one, even
    though the old one could never pay."""
    costs = _costs(0.1, 0.1, attn=0.25, mlp=0.2)  # the full plan costs 1.9 steps per token
    cheap = LayerPlan.from_indices(L, attn=[1, 2, 3], mlp=[0, 1, 2, 3])  # 0.35 per token
    selector = _SwitchingSelector(LayerPlan.full(L), cheap, at=12)
    prompt = random_prompt(8, V, 0)[0].tolist()
    (res,) = _gated_run(llama_adapter, costs, selector, [prompt], 40)
    s = _check_counts(res)
    before, after = s["sources"][:12].replace("L", ""), s["sources"][12:].replace("L", "")
    assert before[0] == "S" and set(before[1:]) == {"-"}
    # the first declined round after the switch shows the new plan; the next one probes it
    assert after.startswith("-S") and s["skip_gate"]["probes"] >= 1


def test_gate_without_a_cost_model_measures_the_costs(llama_adapter):
    """A decoder that was never prepared: the gate times the layer-skip rounds and plain steps
    (one calibration round) and stays lossless."""
    dec = _decoder(
        llama_adapter,
        length=FixedLength(FixedLengthConfig(k=3)),
        drafter=HybridDrafter(HybridDrafterConfig(skip_gate=True)),
        selector=StaticSelector(StaticSelectorConfig(skip_ratio=0.5)),
    )
    for seed in range(2):
        prompt, stop = random_prompt(8, V, seed), StopCondition(40)
        res = dec.generate(prompt, stop)
        assert res.tokens == VanillaDecoder(llama_adapter).generate(prompt, stop).tokens
        s = _check_counts(res)
    assert s["skip_gate"]["costs"] == "measured"
    assert dec.drafter.gate.measured.needs_plain_step is False


def test_gate_state_carries_but_counters_restart(llama_adapter):
    drafter = HybridDrafter(HybridDrafterConfig(skip_gate=True))
    dec = _decoder(llama_adapter, length=FixedLength(FixedLengthConfig(k=3)), drafter=drafter)
    dec.prepare(prepare_context(llama_adapter, cost_model=NEVER_PAYS))
    dec.generate(random_prompt(8, V, 1), StopCondition(24))
    alpha = drafter.summary()["skip_gate"]["alpha"]
    drafter.reset()
    s = drafter.summary()
    assert s["sources"] == "" and s["layer_skip"] == {"rounds": 0, "drafted": 0, "accepted": 0, "declined": 0}
    assert s["skip_gate"]["rounds"] == 0 and s["skip_gate"]["alpha"] == alpha is not None
