"""strategies/drafters/hybrid.py: the contract (on both sources), the switch between the copy and the
layer-skip draft (and ``min_match``), the per-source summary, losslessness with the greedy, tree and
sampling verifiers, and the config checks."""

from __future__ import annotations

import pytest
import torch

from framework.config import ConfigError, build_config
from framework.decoding import StopCondition, VanillaDecoder
from framework.interfaces import LayerPlan
from framework.testing import DrafterContract, random_prompt
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


class TestHybridLookupContract(_LookupContract):
    """On prompts that hold every token, every round copies (``min_match`` 1)."""

    arch = "qwen2"

    def make(self):
        return HybridDrafter(HybridDrafterConfig(min_match=1))

    def _check_draft(self, draft, state, plan, max_tokens):
        # the lookup contract's checks, with this config's n range (min_match is the min n-gram)
        assert draft.length >= 1, "the hybrid always drafts (the layer-skip draft when nothing matches)"
        if draft.extras["source"] == "lookup":
            super()._check_draft(draft, state, plan, max_tokens)
        else:
            DrafterContract._check_draft(self, draft, state, plan, max_tokens)


def test_copies_on_a_match_without_forward(llama_adapter):
    state = _state(llama_adapter, [5, 6, 7, 8, 5, 6, 7, 8, 5], [6])
    calls = llama_adapter.forward_calls
    d = HybridDrafter().draft(state, PLAN, FixedLength(), 5)
    assert d.tokens.tolist() == [[7, 8, 5, 6, 7]] and d.extras["source"] == "lookup"
    assert llama_adapter.forward_calls == calls and state.draft_len == 0
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
    calls = llama_adapter.forward_calls
    d = HybridDrafter(cfg).draft(state, PLAN, FixedLength(), 3)
    assert d.extras["source"] == "layer_skip"
    assert torch.equal(d.tokens, want.tokens) and d.plan is PLAN
    assert llama_adapter.forward_calls == calls + 3  # one draft forward per token


def test_min_match_decides_the_source(llama_adapter):
    # the last two tokens (3, 4) occurred before, three (2, 3, 4) did not
    prompt, generated = [3, 4, 9, 1, 2, 3], [4]
    for min_match, source in ((1, "lookup"), (2, "lookup"), (3, "layer_skip")):
        state = _state(llama_adapter, prompt, generated)
        d = HybridDrafter(HybridDrafterConfig(min_match=min_match)).draft(state, PLAN, FixedLength(), 2)
        assert d.extras["source"] == source, min_match
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


@pytest.mark.parametrize("verifier", ["greedy", "tree"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_lossless_with_greedy_and_tree(adapters, arch, verifier):
    adapter = adapters[arch]
    selector = StaticSelector(StaticSelectorConfig(skip_ratio=0.5))
    prompts = [LOOP_PROMPT, random_prompt(6, V, 0)[0].tolist(), random_prompt(11, V, 4)[0].tolist()]
    sources = ""
    for length in (FixedLength(FixedLengthConfig(k=4)), ConfidenceLength()):
        dec = _decoder(
            adapter,
            GreedyVerifier() if verifier == "greedy" else TreeVerifier(),
            length,
            HybridDrafter(HybridDrafterConfig(min_match=1)),
            selector,
        )
        for p in prompts:
            prompt, stop = torch.tensor([p]), StopCondition(32)
            res = dec.generate(prompt, stop)
            assert res.tokens == VanillaDecoder(adapter).generate(prompt, stop).tokens, (arch, verifier, p)
            sources += res.strategy_summary["drafter"]["sources"]
    assert "L" in sources and "S" in sources


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
    assert HybridDrafterConfig() == HybridDrafterConfig(max_ngram=3, min_match=2, confidence=1.0)
