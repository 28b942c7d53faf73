"""strategies/verifiers/sampling.py: the contract, the acceptance rule, the warping, and losslessness
in distribution (chi-square tests against the exact target distribution, with negative controls).

The rule alone, against its exact law on 10^6 rows and with planted subtle bugs, is tested in
``test_sampling_rule.py``; here the engine end to end (drafters, selectors, length controllers).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch

from framework import Draft, LayerPlan, Verification
from framework.config_fields import ConfigError, build_config
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.draft_head import DraftHead
from framework.kernels import cpu as kernels
from framework.testing import VerifierContract, device_ops, random_prompt, tiny_model
from strategies.drafters.early_exit import EarlyExitDrafter, EarlyExitDrafterConfig
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.clasp_dp import ClaspDPConfig, ClaspDPSelector
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig, warp
from tests.strategies.verifiers.rule import accept_prefix

V = 16  # vocabulary of the statistical tests' model: small enough to sample every cell well


class TestSamplingContract(VerifierContract):
    greedy_lossless = False

    def make(self):
        return SamplingVerifier(SamplingVerifierConfig(temperature=0.8, top_p=0.95))

    def test_contract_state_installs_the_draft_sampler(self):
        _, _, state = self.prepared()
        assert state.draft_sampler is not None


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0.0),
        ("temperature", -1.0),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
    ],
)
def test_config_rejects_out_of_range(field, value):
    with pytest.raises(ConfigError, match=field) as err:
        SamplingVerifierConfig(**{field: value})
    assert err.value.field == field and err.value.allowed


def test_config_from_cli_strings():
    cfg = build_config(
        SamplingVerifierConfig, {"temperature": "0.7", "top_k": "5", "top_p": "0.9", "seed": "3"}
    )
    assert (cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed) == (0.7, 5, 0.9, 3)
    with pytest.raises(ConfigError, match=r"--verifier\.top_p must be in \(0, 1\]"):
        build_config(SamplingVerifierConfig, {"top_p": "0"}, flag_prefix="--verifier.")
    assert SamplingVerifier.lossless == "distribution" and SamplingVerifier.needs_draft_probs


# ------------------------------------------------------------------------------ warping


def _logits(probs):
    return torch.tensor([probs], dtype=torch.float64).log()


def test_warp_temperature_is_scaled_softmax():
    x = torch.randn(3, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(warp(x, temperature=t), torch.softmax(x / t, dim=-1))
    assert warp(x.float()).dtype == torch.float32 and warp(x.half()).dtype == torch.float32


def test_warp_top_k_and_top_p_support():
    x = _logits([0.05, 0.5, 0.15, 0.3])
    want = {
        (0, 1.0): [0.05, 0.5, 0.15, 0.3],
        (2, 1.0): [0, 0.5 / 0.8, 0, 0.3 / 0.8],  # top-k keeps the two largest, renormalised
        (1, 1.0): [0, 1, 0, 0],
        (0, 0.6): [0, 0.5 / 0.8, 0, 0.3 / 0.8],  # smallest set with mass >= 0.6: {0.5, 0.3}
        (0, 0.9): [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95],
        (0, 0.4): [0, 1, 0, 0],  # the top token alone already reaches 0.4
        (0, 1e-9): [0, 1, 0, 0],  # at least one token survives
        # top-p is applied after top-k: on the renormalised {0.625, 0.375} 0.6 keeps the first only
        (2, 0.6): [0, 1, 0, 0],
    }
    for (k, p), probs in want.items():
        got = warp(x, top_k=k, top_p=p)
        torch.testing.assert_close(
            got, torch.tensor([probs], dtype=torch.float64), msg=f"top_k={k} top_p={p}"
        )
    # temperature first: at T = 0.5 the probabilities are ~ p^2, so 0.6 keeps only the 0.5 token
    got = warp(x, temperature=0.5, top_p=0.6)
    assert got[0].nonzero().flatten().tolist() == [1]


def test_choose_and_draft_sampler_sample_the_warped_distribution():
    v = SamplingVerifier(SamplingVerifierConfig(temperature=0.8, top_k=5, seed=1))
    logits = torch.randn(1, V, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    p = v.warp(logits)[0]
    n = 20000
    rows = logits.expand(n, V)
    toks = v.choose(rows)
    assert toks.shape == (n,) and toks.dtype == torch.long
    tok2, q = v.draft_sampler()(device_ops(v.random), rows)
    torch.testing.assert_close(q, v.warp(rows))
    for t in (toks, tok2):
        freq = torch.bincount(t, minlength=V).double() / n
        assert float(freq[p == 0].sum()) == 0.0, "a token outside the top-k was sampled"
        assert 0.5 * float((freq - p).abs().sum()) < 0.02  # TV; its sd at n = 20000 is ~0.004


def test_generator_is_seeded_once_per_run():
    logits = torch.zeros(1, V)
    a, b = SamplingVerifier(SamplingVerifierConfig(seed=5)), SamplingVerifier(SamplingVerifierConfig(seed=5))
    seq_a = [int(a.choose(logits)) for _ in range(20)]
    b.reset()  # reset keeps the stream: it does not re-seed
    assert [int(b.choose(logits)) for _ in range(20)] == seq_a
    a.reset()
    assert [int(a.choose(logits)) for _ in range(20)] != seq_a


# ------------------------------------------------------------------------------ acceptance rule


def _dists(rows: int, seed: int, zero: int = 0) -> torch.Tensor:
    """(rows, V) random distributions; ``zero`` random entries per row set to 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, V, generator=g, dtype=torch.float64) ** 3
    if zero:
        x.scatter_(1, torch.rand(rows, V, generator=g).argsort(1)[:, :zero], 0.0)
    return x / x.sum(-1, keepdim=True)


def test_q_equal_p_accepts_everything():
    k = 4
    p = _dists(k + 1, 0, zero=4)[None]  # (1, K+1, V)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        d = torch.multinomial(p[0, :k], 1, generator=g).T  # (1, K) sampled from q = p
        m, nxt = accept_prefix(d, p[:, :k], p, g)
        assert int(m) == k
        assert float(p[0, k, nxt]) > 0  # the bonus comes from p_{K+1}


def test_zero_target_probability_always_rejects():
    p = _dists(3, 1)[None]
    q = _dists(2, 2)[None]
    d = torch.tensor([[3, 7]])
    p[0, 0, 3] = 0.0
    p[0, 0] /= p[0, 0].sum()
    residual = (p[0, 0] - q[0, 0]).clamp_min(0)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        m, nxt = accept_prefix(d, q, p, g)
        assert int(m) == 0
        seen.add(int(nxt))
    assert 3 not in seen, "the rejected token came back as its own replacement"
    assert all(float(residual[t]) > 0 for t in seen), "replacement outside the support of max(0, p - q)"


def test_empty_residual_falls_back_to_p():
    # With normalised p and q an empty residual (p <= q everywhere) means p == q, where a rejection has
    # probability 0; an unnormalised q forces the case: the replacement then comes from p itself.
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]], dtype=torch.float64)
    q = torch.tensor([[[0.5, 0.5, 0.5, 0.5]]], dtype=torch.float64)  # not normalised: residual is 0
    g = torch.Generator().manual_seed(0)
    out = {int(accept_prefix(torch.tensor([[0]]), q, p, g)[1]) for _ in range(100)}
    assert out == {1, 2}


def test_empty_draft_samples_from_p1():
    p = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]], dtype=torch.float64)
    m, nxt = accept_prefix(torch.empty(1, 0, dtype=torch.long), p.new_zeros(1, 0, 4), p, torch.Generator())
    assert int(m) == 0 and int(nxt) == 2


def test_acceptance_probability_and_single_position_losslessness():
    """Many independent rows at once: d ~ q; accepted with min(1, p(d)/q(d)); output ~ p exactly."""
    n = 40000
    p1, q1 = _dists(1, 3, zero=3), _dists(1, 4, zero=2)
    p = torch.cat([p1, _dists(1, 5)])[None].expand(n, 2, V)  # (n, K+1 = 2, V)
    q = q1[None].expand(n, 1, V)
    g = torch.Generator().manual_seed(7)
    d = torch.multinomial(q1, n, replacement=True, generator=g).T  # (n, 1)
    m, nxt = accept_prefix(d, q, p, g)
    ratio = (p1[0] / q1[0]).clamp(max=1.0).nan_to_num(0.0)
    for tok in range(V):
        rows = d[:, 0] == tok
        if int(rows.sum()) >= 500:
            rate = float(m[rows].double().mean())
            sd = (float(ratio[tok]) * (1 - float(ratio[tok])) / int(rows.sum())) ** 0.5
            assert abs(rate - float(ratio[tok])) <= 4 * sd + 1e-9, (
                f"token {tok}: {rate} vs {float(ratio[tok])}"
            )
    out = torch.where(m == 1, d[:, 0], nxt)
    freq = torch.bincount(out, minlength=V).double() / n
    assert float(freq[p1[0] == 0].sum()) == 0.0
    assert 0.5 * float((freq - p1[0]).abs().sum()) < 0.02  # TV; its sd at n = 40000 is ~0.003
    # the broken rule "replacement from p, not from the residual" visibly misses p (a power check)
    broken = torch.where(m == 1, d[:, 0], torch.multinomial(p1, n, replacement=True, generator=g)[0])
    freq_b = torch.bincount(broken, minlength=V).double() / n
    assert 0.5 * float((freq_b - p1[0]).abs().sum()) > 0.05


def test_verify_requires_draft_probs(llama_adapter):
    from framework.engine.state import DecodeState

    v = SamplingVerifier()
    state = DecodeState(llama_adapter, random_prompt(6, 128, 0), 64, need_draft_probs=True)
    state.append(v.choose(state.prefill())[:, None])
    draft = Draft(torch.tensor([[1, 2]]), LayerPlan.full(4))
    with pytest.raises(ValueError, match="draft_sampler"):
        v.verify(state, draft)


# ------------------------------------------------------------------------------ losslessness
#
# Method: a 4-layer float64 random Llama with a 16-token vocabulary; the draft skips the attention
# and MLP of blocks 1 and 2 (it runs blocks 0 and 3 only), so it differs a lot from the target (about
# a third of the draft tokens are rejected), and the residual path is exercised. Each case
# generates N sequences from one prompt with one verifier whose generator advances from run to run,
# and compares the marginal distribution of each of the first three new tokens with the exact
# target distribution (warped), computed by enumerating every context with batched full forwards of
# the unmodified Hugging Face model. Chi-square goodness of fit per position (cells with expected
# count < 10 pooled); the three positions are Bonferroni-combined: the test passes when every
# p-value > 0.01 / 3, so its false-alarm rate is at most 1%. Seeds are fixed: it is deterministic.

N = 200
ALPHA = 0.01 / 3
SKIP = StaticSelectorConfig(skip_attn=(1, 2), skip_mlp=(1, 2))
CASES = {
    # name: (verifier config, draft length K, token budget); with budget 5 the first round drafts
    # all K = 3 tokens, and generation is cut once 3 tokens exist.
    "t1.0_k3": (SamplingVerifierConfig(temperature=1.0, seed=11), 3, 5),
    "t0.7_p0.9_k3": (SamplingVerifierConfig(temperature=0.7, top_p=0.9, seed=12), 3, 5),
    # K = 1 with budget 3: the third token is the bonus (all accepted) or an empty-draft round.
    "topk8_k1": (SamplingVerifierConfig(temperature=1.0, top_k=8, seed=13), 1, 3),
}


class _FirstTokens(StopCondition):
    """A budget of ``max_new_tokens`` (which bounds the first draft) but a cut after ``keep`` tokens."""

    def __init__(self, max_new_tokens: int, keep: int, controls: Any = None) -> None:
        super().__init__(max_new_tokens, controls=controls)
        self.keep = keep

    def find_cut(self, new_tokens, start):
        return (self.keep, "max_new_tokens") if len(new_tokens) >= self.keep else None


class _AlwaysAccept(SamplingVerifier):
    """Broken on purpose: commits every draft token and the bonus (no acceptance test)."""

    def verify(self, state, draft: Draft) -> Verification:
        block = torch.cat([state.pending, draft.tokens], dim=1)
        out = state.forward_verify(block, logits_at="all")
        bonus = self.choose(out.logits[:, -1])
        k = draft.length
        return Verification(
            num_accepted=torch.tensor([k]),
            new_tokens=torch.cat([draft.tokens, bonus[:, None]], dim=1),
            target_tokens=out.logits.argmax(-1),
        )


@functools.lru_cache(maxsize=1)
def _model():
    return tiny_model("llama", num_layers=4, seed=1, vocab_size=V)


@functools.lru_cache(maxsize=1)
def _kernel_adapter():
    """The same model in float32 with the CPU kernels: the one compressed draft weights need."""
    return adapter_for(
        tiny_model("llama", num_layers=4, seed=1, vocab_size=V, dtype=torch.float32), fast_kernels=True
    )


def _prompt() -> torch.Tensor:
    return random_prompt(5, V, seed=1)


@functools.lru_cache(maxsize=8)
def _target_marginals(
    cfg: SamplingVerifierConfig,
    n_tokens: int = 3,
    small: bool = False,
    f32: bool = False,
    penalty: float = 1.0,
    regex: str | None = None,
) -> list[torch.Tensor]:
    """Exact marginal distribution of each of the first ``n_tokens`` sampled tokens ((V,) each), by
    enumerating every context with batched full forwards of the unmodified model (``small``: the
    power tests' model and prompt; ``f32``: the float32 model of `_kernel_adapter`; ``penalty``:
    transformers' repetition penalty applied to each context's scores before the warping;
    ``regex``: a grammar's mask (`_regex_grammar`) applied after it, each context's own)."""
    model, prompt = (_small_model(), _small_prompt()) if small else (_model(), _prompt())
    if f32:
        model = _kernel_adapter().arch.model
    vocab = model.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)  # over the contexts enumerated so far
    ctx = torch.empty(1, 0, dtype=torch.long)
    out = []
    with torch.no_grad():
        for _ in range(n_tokens):
            ids = torch.cat([prompt.expand(ctx.shape[0], -1), ctx], dim=1)
            logits = model(ids).logits[:, -1]
            if penalty != 1.0:
                from transformers import RepetitionPenaltyLogitsProcessor

                logits = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.float())
            if regex is not None:
                from framework.engine.grammar import GrammarProcessor

                grammar = GrammarProcessor(_regex_grammar(regex).start(prompt.shape[1]))
                logits = grammar(ids, logits.float())
            cond = warp(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # (C, V)
            step = joint[:, None] * cond
            out.append(step.sum(0).double())
            joint = step.reshape(-1)
            ctx = torch.cat(
                [ctx.repeat_interleave(vocab, dim=0), torch.arange(vocab).repeat(ctx.shape[0])[:, None]], 1
            )
    return out


def _chi2_gof(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 10.0) -> float:
    """p-value of Pearson's chi-square goodness of fit (cells with expected < min_expected pooled)."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    if float(counts[probs <= 0].sum()) > 0:
        return 0.0  # a token of probability 0 was produced
    exp = probs * n
    keep = exp >= min_expected
    obs_c, exp_c = list(counts[keep]), list(exp[keep])
    if float(exp[~keep].sum()) > 0:
        obs_c.append(counts[~keep].sum())
        exp_c.append(exp[~keep].sum())
    obs_t, exp_t = torch.stack(obs_c), torch.stack(exp_c)
    stat = ((obs_t - exp_t) ** 2 / exp_t).sum()
    df = obs_t.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _pvalues(
    samples: torch.Tensor,
    cfg: SamplingVerifierConfig,
    small: bool = False,
    f32: bool = False,
    penalty: float = 1.0,
    regex: str | None = None,
) -> list[float]:
    """Per-position chi-square p-values of ``samples`` (n, T) against the exact target marginals."""
    return [
        _chi2_gof(torch.bincount(samples[:, j], minlength=want.numel()), want)
        for j, want in enumerate(_target_marginals(cfg, samples.shape[1], small, f32, penalty, regex))
    ]


#: The characters of `_regex_grammar`'s tokenizer: 3 specials + 13 characters = the model's V = 16.
_CHARS = "xyab012345678"


@functools.lru_cache(maxsize=4)
def _regex_grammar(regex: str) -> Any:
    """``regex`` compiled for a character tokenizer of the statistical tests' 16 tokens."""
    from framework.testing import char_regex_grammar

    return char_regex_grammar(regex, _CHARS, V)


def _speculative_samples(
    verifier: SamplingVerifier,
    k: int,
    budget: int,
    n: int = N,
    head_ids: list[int] | None = None,
    context: bool = False,
    weights: str = "",
    drafter: Any = None,
    controls: Any = None,
) -> torch.Tensor:
    adapter = _kernel_adapter() if weights else adapter_for(_model())
    drafter = LayerSkipDrafter() if drafter is None else drafter
    if weights:  # drafts run a compressed copy: q is whatever distribution they sampled from
        drafter.use_weights(adapter.draft_branches(weights))
    if head_ids is not None:  # a reduced draft head: q is the warped draft distribution over its tokens
        drafter.use_head(DraftHead(adapter, head_ids, context=context))
    dec = SpeculativeDecoder(
        adapter, StaticSelector(SKIP), FixedLength(FixedLengthConfig(k=k)), drafter, verifier
    )
    stop, prompt = _FirstTokens(budget, 3, controls), _prompt()
    rows = []
    for _ in range(n):
        res = dec.generate(prompt, stop)
        assert len(res.tokens) == 3
        rows.append(res.tokens)
    return torch.tensor(rows)


def test_exact_reference_is_normalised():
    for want in _target_marginals(CASES["t0.7_p0.9_k3"][0]):
        assert abs(float(want.sum()) - 1) < 1e-9


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(case):
    cfg, k, budget = CASES[case]
    samples = _speculative_samples(SamplingVerifier(cfg), k, budget)
    pvals = _pvalues(samples, cfg)
    print(f"\n{case}: per-position chi-square p-values {[round(p, 4) for p in pvals]}")
    assert min(pvals) > ALPHA, f"{case}: speculative sampling does not match the target: p = {pvals}"


#: The reduced draft head of the statistical tests: half of the 16 tokens, so that the target often
#: samples a token the draft cannot propose (only the residual distribution produces it).
HEAD_IDS = [0, 2, 3, 5, 8, 9, 12, 14]


@pytest.mark.parametrize("context", [False, True], ids=["static", "context"])
def test_speculative_sampling_with_a_reduced_draft_head_matches_target_distribution(context):
    """q = the warped draft distribution over the head's tokens (zero elsewhere): still exact; with
    ``context`` the set grows with the prompt's and the committed tokens between rounds."""
    cfg, k, budget = CASES["t0.7_p0.9_k3"]
    samples = _speculative_samples(SamplingVerifier(cfg), k, budget, head_ids=HEAD_IDS, context=context)
    pvals = _pvalues(samples, cfg)
    print(f"\nreduced head ({'context' if context else 'static'}): p-values {[round(p, 4) for p in pvals]}")
    assert min(pvals) > ALPHA, f"sampling with a reduced draft head does not match the target: p = {pvals}"
    outside = ~torch.isin(samples, torch.tensor(HEAD_IDS))
    assert outside.any(), "no sampled token lies outside the head: the case does not test the residual"


@pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason}")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_speculative_sampling_with_compressed_draft_weights_matches_target_distribution(fmt):
    """Drafts computed by an int8 or int4 copy of the weights (float32 model, CPU kernels): still
    exact (int4 also quantises the drafts' activations)."""
    cfg, k, budget = CASES["t0.7_p0.9_k3"]
    samples = _speculative_samples(SamplingVerifier(cfg), k, budget, weights=fmt)
    pvals = _pvalues(samples, cfg, f32=True)
    print(f"\n{fmt} draft weights: p-values {[round(p, 4) for p in pvals]}")
    assert min(pvals) > ALPHA, f"sampling with {fmt} draft weights does not match the target: p = {pvals}"


def test_speculative_sampling_with_the_cascade_drafter_matches_target_distribution():
    """The cascade (copies with a one-hot q, layer-skip drafts with their distribution, or a plain
    step, chosen per round by its gates) stays exact under speculative sampling."""
    from strategies.drafters.cascade import CascadeDrafter

    cfg, k, budget = CASES["t0.7_p0.9_k3"]
    samples = _speculative_samples(SamplingVerifier(cfg), k, budget, drafter=CascadeDrafter())
    pvals = _pvalues(samples, cfg)
    print(f"\ncascade: p-values {[round(p, 4) for p in pvals]}")
    assert min(pvals) > ALPHA, f"sampling with the cascade drafter does not match the target: p = {pvals}"


def test_speculative_sampling_with_a_logits_processor_samples_the_processed_target():
    """Issue 47: with a repetition penalty (transformers' processor, which depends on each row's
    prefix), speculative sampling samples the processed target exactly: every verified and drafted
    row processed with its own prefix, then warped."""
    from framework.engine.processing import GenerationControls

    cfg, k, budget = CASES["t0.7_p0.9_k3"]
    plain, processed = _target_marginals(cfg), _target_marginals(cfg, penalty=3.0)
    assert max(float((a - b).abs().sum()) for a, b in zip(plain, processed, strict=True)) > 0.1  # it bites
    controls = GenerationControls(repetition_penalty=3.0)
    samples = _speculative_samples(SamplingVerifier(cfg), k, budget, controls=controls)
    pvals = _pvalues(samples, cfg, penalty=3.0)
    print(f"\nrepetition penalty: p-values {[round(p, 4) for p in pvals]}")
    assert min(pvals) > ALPHA, f"sampling with a processor does not match the processed target: p = {pvals}"


def test_speculative_sampling_under_a_grammar_with_forced_drafts_samples_the_constrained_target():
    """Issue 47: under a grammar (after ``x`` it forces ``ab``; after ``y`` one digit of 0-3, then
    ``ab``), speculative sampling with the grammar-forced drafter (forced runs at the start of a
    round and inside layer-skip drafts, one-hot q) samples the grammar-masked target exactly."""
    pytest.importorskip("llguidance")
    from framework.engine.processing import GenerationControls
    from strategies.drafters.grammar_forced import GrammarForcedDrafter, GrammarForcedDrafterConfig

    regex = "(x|y[0-3])ab[0-8]+"
    cfg, k, budget = CASES["t0.7_p0.9_k3"]
    want = _target_marginals(cfg, regex=regex)
    assert float(want[1][[5, 6]].sum()) < 1 and float(want[2][[5, 6]].sum()) == pytest.approx(1.0)  # it bites
    controls = GenerationControls(grammar=_regex_grammar(regex))
    drafter = GrammarForcedDrafter(GrammarForcedDrafterConfig(then="layer_skip"))
    samples = _speculative_samples(SamplingVerifier(cfg), k, budget, drafter=drafter, controls=controls)
    pvals = _pvalues(samples, cfg, regex=regex)
    print(f"\ngrammar, forced drafts: p-values {[round(p, 4) for p in pvals]}")
    assert min(pvals) > ALPHA, f"sampling under a grammar does not match the constrained target: p = {pvals}"


def test_vanilla_sampling_matches_target_distribution():
    """VanillaDecoder + sampling (the baseline) samples the same warped distribution."""
    cfg = CASES["t0.7_p0.9_k3"][0]
    dec = VanillaDecoder(adapter_for(_model()), SamplingVerifier(cfg))
    samples = torch.tensor([dec.generate(_prompt(), StopCondition(3)).tokens for _ in range(N)])
    pvals = _pvalues(samples, cfg)
    print(f"\nvanilla: per-position chi-square p-values {[round(p, 4) for p in pvals]}")
    assert min(pvals) > ALPHA, f"vanilla sampling does not match the target: p = {pvals}"


def test_negative_control_always_accept_fails():
    """The same test has power: a verifier that accepts every draft token is caught (with N / 2 runs)."""
    cfg, k, budget = CASES["t0.7_p0.9_k3"]
    samples = _speculative_samples(_AlwaysAccept(cfg), k, budget, n=N // 2)
    pvals = _pvalues(samples, cfg)
    print(f"\nalways-accept control: per-position chi-square p-values {pvals}")
    assert min(pvals) < ALPHA, f"the broken verifier passed the losslessness test: p = {pvals}"


# ------------------------------------------------------------------------------ losslessness with power
#
# The tests above run N = 200 generations on a 16-token vocabulary: they catch gross errors only, and
# their three positions never reach the bonus token at K = 3. The tests below are sized to catch a
# total-variation error of 0.02 in the marginal distribution of any of the first five tokens, on a
# model small enough to make that affordable: a 2-layer float64 random Llama with a 4-token vocabulary
# (temperature 0.8, top-k 3), one fixed prompt, 5 new tokens per run, the exact marginals enumerated
# as above. At K = 3 the first round drafts positions 2-4 and its bonus token is position 5; all three
# drafts are accepted in most runs (asserted), so the bonus is part of the distribution checked.
#
# How N follows from TV 0.02: when the tokens at a position follow P instead of the exact P0, Pearson's
# statistic over c <= 4 cells (df <= 3; asserted) is approximately noncentral chi-square with
# noncentrality lambda = N * sum (P - P0)^2 / P0 >= N * (sum |P - P0|)^2 = 4 N TV^2 (Cauchy-Schwarz
# with sum P0 = 1). The false-alarm rate is 0.01 for the 5 positions together (alpha = 0.002 per
# position, critical value 14.8 at df 3); lambda >= 12.8 puts the median of the statistic above it
# (power >= 1/2; lambda >= 24, i.e. TV >= 0.027, gives power 0.9). So N = 12.8 / (4 * 0.02^2) = 8000.
# (Central and noncentral chi-square quantiles computed once with scipy.) The cases that each
# exercise one more engine feature run fewer generations, N = 12.8 / (4 TV^2): N_FEATURE = 1500 for
# early exit (power >= 1/2 against TV 0.046), N_REPLAN = 1000 for clasp_dp, whose DP after every round
# costs more than the rest of the round (TV 0.057).

V_SMALL = 4
N_POWER = 8000
N_FEATURE = 1500
N_REPLAN = 1000
POWER_TOKENS = 5
ALPHA_POSITION = 0.01 / POWER_TOKENS
POWER_CFG = SamplingVerifierConfig(temperature=0.8, top_k=3, seed=21)


@functools.lru_cache(maxsize=1)
def _small_model():
    return tiny_model("llama", num_layers=2, seed=1, vocab_size=V_SMALL)


def _small_prompt() -> torch.Tensor:
    return random_prompt(5, V_SMALL, seed=1)


def _power_run(selector, length, drafter, n: int, budget: int = POWER_TOKENS) -> tuple[torch.Tensor, dict]:
    """n generations cut at POWER_TOKENS tokens (``budget`` bounds the drafts) with one sampling
    verifier (its stream advances from run to run): the tokens (n, POWER_TOKENS) and what the engine
    did (first-round commits, runs whose rounds drafted with different plans, the drafter's summary
    counters, summed)."""
    dec = SpeculativeDecoder(
        adapter_for(_small_model()), selector, length, drafter, SamplingVerifier(POWER_CFG)
    )
    stop, prompt = _FirstTokens(budget, POWER_TOKENS), _small_prompt()
    rows, first, replanned = [], [], 0
    drafter_counts: Counter[str] = Counter()
    for _ in range(n):
        res = dec.generate(prompt, stop)
        rows.append(res.tokens)
        first.append(res.accept_lengths[0])
        replanned += len(set(res.plans)) > 1
        for key, val in res.strategy_summary.get("drafter", {}).items():
            if isinstance(val, int | float):
                drafter_counts[key] += val
    return torch.tensor(rows), {
        "first_commits": torch.bincount(torch.tensor(first), minlength=5),
        "replanned": replanned,
        "drafter": drafter_counts,
    }


def _assert_lossless(case: str, samples: torch.Tensor) -> None:
    want = _target_marginals(POWER_CFG, POWER_TOKENS, small=True)
    assert max(int(w.count_nonzero()) for w in want) <= 4, "N was derived for at most 4 cells (df 3)"
    pvals = _pvalues(samples, POWER_CFG, small=True)
    print(f"\n{case}: per-position chi-square p-values {[round(p, 4) for p in pvals]}")
    assert min(pvals) > ALPHA_POSITION, f"{case}: speculative sampling does not match the target: p = {pvals}"


@pytest.mark.slow  # a statistical check over many decodes (CI runs it)
def test_speculative_sampling_with_power_including_the_bonus():
    """K = 3, static layer skip (block 1 skipped): N_POWER runs; the bonus (position 5) in most."""
    samples, seen = _power_run(
        StaticSelector(StaticSelectorConfig(skip_attn=(1,), skip_mlp=(1,))),
        FixedLength(FixedLengthConfig(k=3)),
        LayerSkipDrafter(),
        N_POWER,
    )
    first = seen["first_commits"]  # first round commits m + 1 tokens; 4 = all three accepted + bonus
    assert int(first[4]) >= N_POWER // 2, f"the bonus is reached too rarely to be tested: {first.tolist()}"
    assert int(first[1:4].sum()) >= N_POWER // 10, (
        f"too few rejections to test the residual: {first.tolist()}"
    )
    _assert_lossless("static K=3", samples)


@pytest.mark.slow  # a statistical check over many decodes (CI runs it)
def test_speculative_sampling_with_early_exit_reuse_and_drop_on_stop():
    """early_exit (E = 1 of 2) reusing the draft's KV and hidden states in verification, stopped by
    the confidence controller with the stopping token dropped (DEL's Algorithm 1)."""
    samples, seen = _power_run(
        StaticSelector(),
        ConfidenceLength(ConfidenceLengthConfig(threshold=0.7, max_length=3)),
        EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=1, reuse_kv=True, on_stop="drop")),
        N_FEATURE,
    )
    counts = seen["drafter"]
    assert counts["reused_positions"] > 0 and counts["verify_blocks_saved"] > 0, counts
    assert N_FEATURE // 20 <= counts["dropped"] < counts["rounds"], counts  # some rounds drop, not all
    _assert_lossless("early_exit reuse + drop", samples)


@pytest.mark.slow  # a statistical check over many decodes (CI runs it)
def test_speculative_sampling_with_a_plan_changing_selector():
    """clasp_dp re-running its DP after every round (interval 1): the plan of a generation's second
    round depends on its first round's tokens. K = 2 and a budget of 7 tokens, so that the second
    round drafts too (position 5 is then always drafted or corrected with the new plan)."""
    samples, seen = _power_run(
        ClaspDPSelector(ClaspDPConfig(num_skip=1, interval=1, init="uniform")),
        FixedLength(FixedLengthConfig(k=2)),
        LayerSkipDrafter(),
        N_REPLAN,
        budget=POWER_TOKENS + 2,
    )
    assert seen["replanned"] >= N_REPLAN // 2, f"the plan changed within only {seen['replanned']} runs"
    _assert_lossless("clasp_dp replanning", samples)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_is_torch_multinomial_draw_for_draw(dtype):
    """`sample` draws its Exp(1) noise first and applies `torch.multinomial`'s own rule for one
    sample (the exponential race): the same tokens from the same stream, which then stands where
    multinomial's would (the rule itself can run in a graph, the draws before it)."""
    from strategies.verifiers.sampling import sample

    w = torch.softmax(torch.randn(3, 500, dtype=dtype, generator=torch.Generator().manual_seed(1)), -1)
    w[:, 7] = 0.0  # a token that never comes
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(100):
        assert torch.equal(sample(w, g1), torch.multinomial(w, 1, generator=g2).squeeze(-1))
    assert torch.equal(g1.get_state(), g2.get_state())


def test_the_draft_rule_draws_inside_from_the_verifiers_stream_what_sample_draws():
    """The draft rule (a module-level function and the warping's values, which the engine keys)
    draws its noise inside, from the stream ``ops`` hands it: the token `sample` draws from the
    warped q with a generator of the same seed, draw for draw."""
    from framework.engine.execution.work import work_key
    from strategies.verifiers.sampling import sample

    ver = SamplingVerifier(SamplingVerifierConfig(temperature=0.7, top_p=0.9, seed=3))
    sampler = ver.draft_sampler()
    key = work_key(sampler, (), {})
    assert key.function.endswith(":sample_draft") and ("temperature", 0.7) in key.params
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    tok, q = sampler(device_ops(ver.random), logits)
    torch.testing.assert_close(q, ver.warp(logits))
    assert torch.equal(tok, sample(ver.warp(logits), torch.Generator().manual_seed(3)))


def test_a_sampled_generation_depends_on_its_verifiers_seed_alone():
    """Every draw of a sampled generation (each draft step's noise, acceptance, the replacement and
    bonus tokens) comes from the verifier's stream: two decoders whose verifiers have one seed give
    the same tokens whatever state torch's global generator is in, and another seed other tokens."""
    adapter = adapter_for(_model())
    prompt = random_prompt(5, V, seed=4)

    def tokens(seed: int, global_seed: int) -> list[int]:
        dec = SpeculativeDecoder(
            adapter,
            StaticSelector(SKIP),
            FixedLength(FixedLengthConfig(k=3)),
            LayerSkipDrafter(),
            SamplingVerifier(SamplingVerifierConfig(temperature=1.0, seed=seed)),
        )
        torch.manual_seed(global_seed)
        res = dec.generate(prompt, StopCondition(32))
        assert res.drafted > 0
        return res.tokens

    first = tokens(7, global_seed=0)
    assert tokens(7, global_seed=12345) == first
    assert any(tokens(s, global_seed=0) != first for s in (8, 9))
