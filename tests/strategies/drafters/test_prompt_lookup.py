"""strategies/drafters/prompt_lookup.py and the copy helpers of framework/drafting/builder.py: the contract,
the n-gram search (longest n, most recent occurrence, overlapping copy, no match), the incremental
index against a brute-force search, no forward while drafting, accepted copies on repetitive text,
losslessness with every verifier (token for token, and in distribution for speculative sampling),
and the config checks."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework import LayerPlan, LengthController
from framework.config_fields import ConfigError, build_config
from framework.drafting.copying import NgramIndex, copy_draft
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.testing import DrafterContract, random_prompt, tiny_model
from strategies.drafters.prompt_lookup import PromptLookupDrafter, PromptLookupDrafterConfig
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier
from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig, warp
from strategies.verifiers.tree import TreeVerifier

L = 4
V = 128


def reference_lookup(seq: list[int], min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    """Brute force: the longest n-gram ending at seq[-1] that also ends at an earlier position; its
    latest such position e; the k tokens after e, continued from the output past the end."""
    size = len(seq)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        query = seq[size - n :]
        ends = [e for e in range(n - 1, size - 1) if seq[e - n + 1 : e + 1] == query]
        if ends:
            ext = list(seq)
            for i in range(k):
                ext.append(ext[ends[-1] + 1 + i])
            return n, ext[size:]
    return 0, []


# --------------------------------------------------------------------------------------------
# Contract
# --------------------------------------------------------------------------------------------


class _LookupContract(DrafterContract):
    """The drafter contract, on states whose prompt holds every token once (a permutation of the
    vocabulary), so that the pending token always occurred earlier and every draft is a copy.

    The contract's own states (``test_confidences_when_requested``) have short random prompts, where
    a round may find no match: the draft is then empty, which is checked against the brute-force
    search instead of the contract's ``1 <= K`` (a prompt-lookup round without a match declines)."""

    def new_state(self, adapter, strategies, prompt_seed=0, prompt_len=6):
        vocab = adapter.arch.config.vocab_size
        prompt = torch.randperm(vocab, generator=torch.Generator().manual_seed(prompt_seed))[None]
        state = DecodeState.for_strategies(
            adapter, prompt, vocab + 64, strategies["selector"], strategies["length"], strategies["verifier"]
        )
        state.append(strategies["verifier"].choose(state.prefill())[:, None])
        return state

    def _check_draft(self, draft, state, plan, max_tokens):
        if draft.length == 0:
            c = self.make().config
            assert reference_lookup(state.tokens[0].tolist(), c.min_ngram, c.max_ngram, 1)[0] == 0, (
                "an empty prompt-lookup draft although the context has a match"
            )
            return
        super()._check_draft(draft, state, plan, max_tokens)
        want = reference_lookup(state.tokens[0].tolist(), 1, 3, max_tokens)[1]
        assert draft.tokens[0].tolist() == want[: draft.length]


class TestPromptLookupContract(_LookupContract):
    def make(self):
        return PromptLookupDrafter()


class TestPromptLookupContractQwen3(_LookupContract):
    arch = "qwen3"

    def make(self):
        return PromptLookupDrafter(PromptLookupDrafterConfig(confidence=0.5))


# --------------------------------------------------------------------------------------------
# The n-gram search
# --------------------------------------------------------------------------------------------


def _index(seq, min_n=1, max_n=3) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(seq)
    return index


def test_longest_ngram_wins():
    # unigram 6 last occurred at position 7 (followed by 1), but the bigram (5, 6) occurred at 0-1
    seq = [5, 6, 7, 8, 9, 9, 9, 6, 1, 5, 6]
    assert _index(seq).lookup(3) == (2, [7, 8, 9])
    assert _index(seq, max_n=1).lookup(3) == (1, [1, 5, 6])


def test_most_recent_occurrence_is_copied():
    seq = [5, 6, 7, 9, 5, 6, 8, 1, 5, 6]  # (5, 6) occurred twice: followed by 7, then by 8
    assert _index(seq).match() == (2, 5)
    assert _index(seq).lookup(2) == (2, [8, 1])


def test_copy_runs_on_past_the_end_periodically():
    # the most recent (1, 2, 3) ends 3 tokens back: the draft repeats the last 3 tokens
    assert _index([1, 2, 3, 1, 2, 3, 1, 2, 3]).lookup(7) == (3, [1, 2, 3, 1, 2, 3, 1])
    assert _index([4, 4]).lookup(4) == (1, [4, 4, 4, 4])


def test_no_match_gives_nothing():
    assert _index([1, 2, 3, 4]).lookup(5) == (0, [])
    assert _index([7]).lookup(5) == (0, [])
    assert _index([]).lookup(5) == (0, [])
    # a unigram match is ignored below min_n
    assert _index([1, 2, 3, 1], min_n=2).lookup(5) == (0, [])
    assert _index([1, 2, 3, 1], min_n=1).lookup(2) == (1, [2, 3])


def test_the_query_never_matches_itself():
    index = _index([3, 1, 2])
    assert index.match() == (0, -1)
    index.extend([9])
    assert index.match() == (0, -1)
    index.extend([1, 2])
    assert index.lookup(2) == (2, [9, 1])


@settings(max_examples=60, deadline=None)
@given(
    seq=st.lists(st.integers(0, 4), min_size=0, max_size=40),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=20),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_incremental_index_equals_brute_force(seq, cuts, min_n, extra):
    """Extended in chunks of any size, the index answers every prefix as a full scan would."""
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    i, c = 0, 0
    while i < len(seq):
        j = min(len(seq), i + cuts[c % len(cuts)])
        index.extend(seq[i:j])
        c, i = c + 1, j
        assert index.lookup(6) == reference_lookup(seq[:i], min_n, max_n, 6), seq[:i]


def test_index_cost_does_not_grow_with_the_context():
    """A round on a 16k-token context (index the new tokens, look up) stays in microseconds; a model
    step on the default model is ~50-80 ms. Generous bound: the CPU is shared."""
    g = torch.Generator().manual_seed(0)
    index = NgramIndex(1, 3)
    index.extend(torch.randint(0, 1000, (16384,), generator=g).tolist())
    new = torch.randint(0, 1000, (200, 3), generator=g).tolist()
    t0 = time.perf_counter()
    for toks in new:
        index.extend(toks)
        index.lookup(10)
    per_round = (time.perf_counter() - t0) / len(new)
    assert per_round < 1e-3, f"{per_round * 1e6:.0f} us per round"


# --------------------------------------------------------------------------------------------
# The drafter on a decode state
# --------------------------------------------------------------------------------------------


def _state(adapter, prompt: list[int], generated: list[int] = (), **flags) -> DecodeState:
    """A state after prefill whose committed tokens are ``prompt + generated`` (the generated
    tokens are appended without KV: the copy drafter reads only the tokens)."""
    state = DecodeState(adapter, torch.tensor([prompt]), len(prompt) + 64, **flags)
    state.prefill()
    state.append(torch.tensor([list(generated) or [prompt[-1]]]))
    return state


@dataclass(frozen=True)
class _NoConfig:
    pass


class _Recorder(LengthController):
    """Records what the drafter reported after each token; stops after ``stop_after`` tokens."""

    Config = _NoConfig

    def __init__(self, stop_after: int = 99) -> None:
        super().__init__()
        self.calls: list[tuple[int, float | None]] = []
        self.stop_after = stop_after

    def max_length(self, state, hint=None) -> int:
        return 8

    def should_continue(self, drafted, confidence):
        self.calls.append((drafted, confidence))
        return drafted < self.stop_after


def test_match_spanning_prompt_and_generated_text(llama_adapter):
    # the query (10, 11, 12) ends in the generated text; its earlier occurrence is in the prompt
    state = _state(llama_adapter, [1, 10, 11, 12, 13, 14, 2, 10, 11], [12])
    d = PromptLookupDrafter().draft(state, LayerPlan.full(L), FixedLength(), 3)
    assert d.tokens.tolist() == [[13, 14, 2]]
    # an occurrence that itself spans the boundary: (20, 21) at prompt end / first generated token
    state = _state(llama_adapter, [3, 4, 20], [21, 22, 23, 5, 20, 21])
    d = PromptLookupDrafter().draft(state, LayerPlan.full(L), FixedLength(), 4)
    assert d.tokens.tolist() == [[22, 23, 5, 20]]


def test_no_match_is_an_empty_draft_and_a_plain_step(llama_adapter):
    state = _state(llama_adapter, [1, 2, 3, 4, 5], [6])
    d = PromptLookupDrafter().draft(state, LayerPlan.full(L), FixedLength(), 4)
    assert d.length == 0 and d.tokens.shape == (1, 0) and d.tokens.dtype == torch.long
    result = GreedyVerifier().verify(state, d)  # the round verifies pending alone
    assert result.accepted == 0 and result.new_tokens.shape == (1, 1)


def test_drafting_runs_no_forward(llama_adapter):
    state = _state(llama_adapter, [5, 6, 7, 8, 5, 6, 7, 8, 5], [6])
    calls, draft_len = llama_adapter.executor.forward_calls, state.draft_len
    d = PromptLookupDrafter().draft(state, LayerPlan.full(L), FixedLength(), 6)
    assert d.tokens.tolist() == [[7, 8, 5, 6, 7, 8]] and d.source == "lookup"
    assert llama_adapter.executor.forward_calls == calls
    assert state.draft_len == draft_len and state.stats.draft_forwards == 0


def test_length_controller_and_confidence(llama_adapter):
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5]
    rec = _Recorder(stop_after=2)
    cfg = PromptLookupDrafterConfig(confidence=0.7)
    d = PromptLookupDrafter(cfg).draft(_state(llama_adapter, prompt, [6]), LayerPlan.full(L), rec, 6)
    assert d.tokens.tolist() == [[7, 8]]  # stopped after 2: that token kept, no more
    assert rec.calls == [(1, 0.7), (2, 0.7)]
    # a threshold controller never cuts a confidence-1.0 copy short...
    conf = ConfidenceLength(ConfidenceLengthConfig(threshold=0.9, max_length=12))
    state = _state(llama_adapter, prompt, [6], need_confidence=True)
    d = PromptLookupDrafter().draft(state, LayerPlan.full(L), conf, 5)
    assert d.length == 5 and d.confidences.tolist() == [[1.0] * 5]
    # ... and stops after the first token of a copy whose confidence is below its threshold
    d = PromptLookupDrafter(cfg).draft(state, LayerPlan.full(L), conf, 5)
    assert d.length == 1 and d.confidences.tolist() == [[pytest.approx(0.7)]]


def test_extras_only_when_asked(llama_adapter):
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5]
    d = PromptLookupDrafter().draft(_state(llama_adapter, prompt, [6]), LayerPlan.full(L), FixedLength(), 3)
    assert d.confidences is None and d.probs is None and d.top_tokens is None
    state = _state(llama_adapter, prompt, [6], need_draft_probs=True)
    d = PromptLookupDrafter().draft(state, LayerPlan.full(L), FixedLength(), 3)
    assert d.probs.shape == (1, 3, V) and d.probs.dtype == torch.float32
    assert torch.equal(d.probs.argmax(-1), d.tokens) and d.probs.sum().item() == 3  # one-hot q
    assert d.confidences.tolist() == [[1.0, 1.0, 1.0]]


def test_index_follows_the_commits_and_is_per_generation(llama_adapter):
    state = _state(llama_adapter, [5, 6, 7, 8, 5, 6, 7, 8, 5], [6])
    index = NgramIndex(1, 3)
    assert index.follow(state.token_ids()) is index and index.tokens == state.tokens[0].tolist()
    table = index._last
    state.append(torch.tensor([[9, 9]]))
    index.follow(state.token_ids())
    assert index.tokens == state.tokens[0].tolist()
    assert index._last is table and table[(6, 9)] == 10  # extended by the new tokens, not rebuilt
    other = _state(llama_adapter, [1, 2, 3], [4])
    assert index.follow(other.token_ids()).tokens == [1, 2, 3, 4]  # another generation: afresh
    assert index.match() == (0, -1)


def test_the_drafter_indexes_each_generation_afresh(llama_adapter):
    d = PromptLookupDrafter()
    first = d.draft(
        _state(llama_adapter, [5, 6, 7, 8, 5, 6, 7, 8, 5], [6]), LayerPlan.full(L), FixedLength(), 2
    )
    assert first.tokens.tolist() == [[7, 8]]
    d.reset()
    assert d.draft(_state(llama_adapter, [1, 2, 3], [4]), LayerPlan.full(L), FixedLength(), 2).length == 0


def test_copy_draft_caps_at_max_tokens(llama_adapter):
    state = _state(llama_adapter, [1, 2, 3], [4])
    d = copy_draft(state, [7, 8, 9, 10], LayerPlan.full(L), FixedLength(), 2, 1.0)
    assert d.tokens.tolist() == [[7, 8]]
    d = copy_draft(state, [], LayerPlan.full(L), FixedLength(), 2, 1.0)
    assert d.length == 0


def test_summary_counts(llama_adapter):
    drafter = PromptLookupDrafter()
    drafter.draft(_state(llama_adapter, [5, 6, 7, 5, 6], [7]), LayerPlan.full(L), FixedLength(), 3)
    drafter.draft(_state(llama_adapter, [1, 2, 3], [4]), LayerPlan.full(L), FixedLength(), 3)
    s = drafter.summary()
    assert s["rounds"] == 2 and s["matched"] == 1 and s["no_match"] == 1 and s["drafted"] == 3
    assert s["matched_ngram"] == {"3": 1} and s["search_ms"] >= 0
    drafter.reset()
    assert drafter.summary()["rounds"] == 0


# --------------------------------------------------------------------------------------------
# Decoding: accepted copies, losslessness
# --------------------------------------------------------------------------------------------

#: The 4-layer llama tiny model answers this repeated pattern with one token repeated (checked
#: below against vanilla): the copies of that loop are accepted.
LOOP_PROMPT = [37, 107, 12, 72] * 5


def _decoder(adapter, verifier=None, length=None, drafter=None, selector=None) -> SpeculativeDecoder:
    return SpeculativeDecoder(
        adapter,
        selector or StaticSelector(StaticSelectorConfig(skip_ratio=0.0)),
        length or FixedLength(FixedLengthConfig(k=8)),
        drafter or PromptLookupDrafter(),
        verifier or GreedyVerifier(),
    )


def test_repetitive_text_is_accepted(llama_adapter):
    prompt, stop = torch.tensor([LOOP_PROMPT]), StopCondition(40)
    want = VanillaDecoder(llama_adapter).generate(prompt, stop).tokens
    assert len(set(want[1:])) <= 3, f"the tiny model no longer loops on this prompt: {want}"
    res = _decoder(llama_adapter).generate(prompt, stop)
    assert res.tokens == want
    assert res.accepted >= 0.8 * res.drafted and res.drafted >= 20
    assert res.mean_accepted_length > 4
    assert res.target_forwards <= 12  # prefill + a few rounds for 40 tokens
    assert res.draft_forwards == 0


@pytest.mark.parametrize("verifier", ["greedy", "tree"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lossless_with_greedy_and_tree(adapters, arch, verifier):
    adapter = adapters[arch]
    prompts = [LOOP_PROMPT, random_prompt(6, V, 0)[0].tolist(), random_prompt(11, V, 4)[0].tolist()]
    drafted = 0
    for length in (FixedLength(FixedLengthConfig(k=5)), ConfidenceLength()):
        dec = _decoder(adapter, GreedyVerifier() if verifier == "greedy" else TreeVerifier(), length)
        for p in prompts:
            prompt, stop = torch.tensor([p]), StopCondition(32)
            want = VanillaDecoder(adapter).generate(prompt, stop).tokens
            res = dec.generate(prompt, stop)
            assert res.tokens == want, (arch, verifier, p)
            drafted += res.drafted
    assert drafted > 0


# ---- speculative sampling: lossless in distribution ------------------------------------------

SV = 16  # vocabulary of the statistical test: small, so that every cell is sampled well
N_SAMPLES = 200
P_MIN = 0.01 / 3  # Bonferroni over the 3 positions


@functools.lru_cache(maxsize=1)
def _small_model():
    return tiny_model("llama", num_layers=4, seed=1, vocab_size=SV)


@functools.lru_cache(maxsize=4)
def _marginals(cfg: SamplingVerifierConfig, prompt: tuple[int, ...], n_tokens: int = 3) -> list[torch.Tensor]:
    """Exact marginal distribution (SV,) of each of the first tokens sampled from the target."""
    model = _small_model()
    joint, ctx, out = torch.ones(1, dtype=torch.float64), torch.empty(1, 0, dtype=torch.long), []
    with torch.no_grad():
        for _ in range(n_tokens):
            ids = torch.cat([torch.tensor([prompt]).expand(ctx.shape[0], -1), ctx], dim=1)
            step = joint[:, None] * warp(model(ids).logits[:, -1], cfg.temperature, cfg.top_k, cfg.top_p)
            out.append(step.sum(0))
            joint = step.reshape(-1)
            ctx = torch.cat([ctx.repeat_interleave(SV, 0), torch.arange(SV).repeat(ctx.shape[0])[:, None]], 1)
    return out


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 10.0) -> float:
    """Pearson's chi-square goodness of fit (cells expecting < min_expected pooled)."""
    counts, probs = counts.double(), probs.double()
    if float(counts[probs <= 0].sum()) > 0:
        return 0.0
    exp = probs * counts.sum()
    keep = exp >= min_expected
    obs, ex = list(counts[keep]), list(exp[keep])
    if float(exp[~keep].sum()) > 0:
        obs.append(counts[~keep].sum())
        ex.append(exp[~keep].sum())
    obs_t, ex_t = torch.stack(obs), torch.stack(ex)
    stat = ((obs_t - ex_t) ** 2 / ex_t).sum()
    return float(
        torch.special.gammaincc(torch.tensor((obs_t.numel() - 1) / 2.0, dtype=torch.float64), stat / 2)
    )


class _CutAfter(StopCondition):
    """A budget of ``max_new_tokens`` (which bounds the drafts) but a cut after ``keep`` tokens."""

    def __init__(self, max_new_tokens: int, keep: int) -> None:
        super().__init__(max_new_tokens)
        self.keep = keep

    def find_cut(self, new_tokens, start):
        return (self.keep, "max_new_tokens") if len(new_tokens) >= self.keep else None


#: Ends in a loop the small model tends to continue (its greedy output is 1, 1, 1, ...): at
#: temperature 0.5 about 40% of the copies are accepted, so both branches of the test are exercised.
SAMPLING_PROMPT = (8, 15, 13, 8, 6, 0, 1, 1, 1)
SAMPLING = SamplingVerifierConfig(temperature=0.5, seed=21)


def sampled_marginals_pvalues(drafter_factory, n: int = N_SAMPLES, selector=None) -> tuple[list[float], list]:
    """Sample the first 3 tokens n times with speculative sampling, ``drafter_factory()`` and
    ``selector`` (default: no skipping); p-values against the exact marginals, and the results."""
    cfg, prompt = SAMPLING, SAMPLING_PROMPT
    dec = _decoder(
        adapter_for(_small_model()),
        SamplingVerifier(cfg),
        FixedLength(FixedLengthConfig(k=3)),
        drafter_factory(),
        selector=selector,
    )
    results = [dec.generate(torch.tensor([prompt]), _CutAfter(6, 3)) for _ in range(n)]
    samples = torch.tensor([r.tokens for r in results])
    pvals = [
        _chi2_pvalue(torch.bincount(samples[:, j], minlength=SV), want)
        for j, want in enumerate(_marginals(cfg, prompt))
    ]
    return pvals, results


def test_speculative_sampling_with_copies_matches_the_target():
    pvals, results = sampled_marginals_pvalues(PromptLookupDrafter)
    drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
    print(
        f"\nprompt_lookup + sampling: p-values {[round(p, 4) for p in pvals]}, {accepted}/{drafted} accepted"
    )
    assert drafted >= N_SAMPLES and 0.2 * drafted < accepted < 0.8 * drafted  # both branches ran
    assert min(pvals) > P_MIN, f"speculative sampling with copied drafts is biased: p = {pvals}"


class _UniformQ(PromptLookupDrafter):
    """Broken on purpose: reports a uniform q for its deterministic copies (instead of one-hot), so
    the verifier accepts a copy with probability min(1, V p(d)): far too often."""

    def draft(self, state, plan, length, max_tokens):
        d = super().draft(state, plan, length, max_tokens)
        if d.probs is not None:
            d.probs = torch.full_like(d.probs, 1.0 / d.probs.shape[-1])
        return d


def test_negative_control_wrong_q_is_caught():
    """The same test has power: the wrong q for a copy biases the output, and the test sees it."""
    pvals, _ = sampled_marginals_pvalues(_UniformQ, n=N_SAMPLES // 2)
    print(f"\nuniform-q control: p-values {pvals}")
    assert min(pvals) < P_MIN, f"a biased drafter passed the losslessness test: p = {pvals}"


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_ngram": 0}, r"^--drafter\.max_ngram must be an integer in \[1, 32\], got 0$"),
        ({"max_ngram": 33}, r"^--drafter\.max_ngram must be an integer in \[1, 32\], got 33$"),
        ({"max_ngram": "2.5"}, r"^--drafter\.max_ngram must be a number \(int\), got '2.5'$"),
        ({"min_ngram": 4}, r"^--drafter\.min_ngram must be an integer in \[1, 3\], got 4$"),
        ({"max_ngram": 2, "min_ngram": 3}, r"^--drafter\.min_ngram must be an integer in \[1, 2\], got 3$"),
        ({"min_ngram": 0}, r"^--drafter\.min_ngram must be an integer in \[1, 3\], got 0$"),
        ({"confidence": 1.5}, r"^--drafter\.confidence must be in \[0, 1\], got 1\.5$"),
        ({"confidence": -0.1}, r"^--drafter\.confidence must be in \[0, 1\], got -0\.1$"),
        ({"ngram": 3}, r"^--drafter\.ngram must be a field of PromptLookupDrafterConfig"),
    ],
)
def test_bad_config_names_the_field_and_range(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(PromptLookupDrafterConfig, values, "--drafter.")


def test_config_from_cli_strings():
    cfg = build_config(PromptLookupDrafterConfig, {"max_ngram": "5", "min_ngram": "2", "confidence": "0.9"})
    assert (cfg.max_ngram, cfg.min_ngram, cfg.confidence) == (5, 2, 0.9)
    assert PromptLookupDrafterConfig() == PromptLookupDrafterConfig(max_ngram=3, min_ngram=1, confidence=1.0)
