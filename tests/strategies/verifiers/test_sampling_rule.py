"""The speculative-sampling rule (`accept_prefix`) against its exact law, with planted bugs as controls.

The property
------------
One round on synthetic distributions that do not depend on the prefix: target distributions
p_1..p_{K+1} and draft distributions q_1..q_K over V tokens, draft tokens d_j ~ q_j independently.
The rule accepts d_j with probability min(1, p_j(d_j) / q_j(d_j)) in order; at the first rejection
(m = j - 1 accepted) the next token is sampled from norm((p_j - q_j)^+); if all K are accepted it is
the bonus, sampled from p_{K+1}. The round emits Y = (d_1, .., d_m, y), m + 1 tokens.

Lossless means: for every j <= K + 1 and every prefix x_1..x_{j-1} that can be reached,

    P(Y_j = y | m >= j - 1, Y_1..Y_{j-1} = x_1..x_{j-1}) = p_j(y).                          (*)

Proof: given that the first j - 1 drafts were accepted, d_j and its uniform are fresh. For
j = K + 1, Y_j is the bonus ~ p_{K+1}. For j <= K,
P(Y_j = y) = q_j(y) min(1, p_j(y)/q_j(y)) + (1 - sum min(p_j, q_j)) (p_j - q_j)^+(y) / sum (p_j - q_j)^+
= min(p_j, q_j)(y) + (p_j - q_j)^+(y) = p_j(y), because sum (p_j - q_j)^+ = 1 - sum min(p_j, q_j).
So a round followed by sampling the positions it did not reach from p_{m+2}, p_{m+3}, .. gives
independent tokens ~ p_1, p_2, ..: sampling from the target. (With a real model p_j and q_j depend on
the prefix; (*) then holds given the prefix, which is what the chain rule needs.)

Multiplying the factors gives the rule's whole law (which also fixes the acceptance rates):

    P(m = a, Y = (x_1..x_a, y)) = prod_{i <= a} min(p_i, q_i)(x_i) * r_{a+1}(y),              (**)

r_{a+1} = (p_{a+1} - q_{a+1})^+ for a < K and r_{K+1} = p_{K+1}.

The tests
---------
* `exact_law` computes the law of every outcome (m, Y) by enumerating the V^K drafts through the
  rule's textbook definition; it is checked against (**) and (*) exactly.
* `accept_prefix` itself runs on 10^6 rows at once (drafts sampled with ``torch.multinomial``) and
  two checks compare the outcome counts with the exact law: Pearson's goodness of fit over all
  outcomes (**), and (*) alone (per position and reached prefix, the next token against p_j).
* Thresholds: each check is a chi-square test whose p-value must exceed ALPHA = 1e-6 (the
  false-alarm rate of a correct rule, Bonferroni over the positions; cells with expected count < 10
  are pooled so the chi-square approximation holds). With N = 10^6 rows the fit's noncentrality
  N * chi2(P || P0) >= 4 N TV(P, P0)^2 then exceeds the critical value (219 at df 128 for K = 3) with
  probability 1/2 once TV >= 0.005 and 0.9 once TV >= 0.0056: the real rule's test catches any
  deviation of its law of that size. The power against the planted bugs does not come from a
  measured seed: for each, `exact_law` gives the buggy law, whose noncentrality at the controls'
  N_CONTROL = 10^5 rows is asserted to exceed 5x the critical value (it is 10^4 or more); then the
  buggy rule is run and must be rejected by both checks.
* Planted bugs: the residual taken from q[m - 1] instead of q[m]; the bonus sampled from p[K - 1]
  instead of p[K] (0-based); the rule given the unwarped draft softmax while the drafts were sampled
  from the warped q; and Draft & Verify's released-code sampling (greedy draft, unwarped q in the
  ratio), which is not what this framework does. At verifier level the same checks run on
  `SamplingVerifier.draft_sampler` + `SamplingVerifier.verify` with a temperature and a top-k.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from framework import Draft, LayerPlan
from framework.testing import device_ops
from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig, sample
from tests.strategies.verifiers.rule import accept_prefix

V = 5  # small enough to enumerate V^K drafts and fill V + .. + V^(K+1) outcome cells
N = 1_000_000  # rows of a Monte-Carlo run of the real rule, sampled in one vectorised call
N_CONTROL = 100_000  # rows of a run with a planted bug (whose noncentrality at N_CONTROL is checked too)
ALPHA = 1e-6  # false-alarm rate of each check of a correct rule
MIN_EXPECTED = 10.0  # cells with a smaller expected count are pooled
TEMPERATURE, TOP_K = 0.7, 4  # the warping of the synthetic p and q (top-k leaves zeros in both)

Rule = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]
]


# ------------------------------------------------------------------------------ synthetic p and q


def ref_warp(logits: torch.Tensor, temperature: float = TEMPERATURE, top_k: int = TOP_K) -> torch.Tensor:
    """Temperature then top-k, renormalised: written out here, independent of `sampling.warp`."""
    x = logits / temperature
    kth = x.sort(dim=-1, descending=True).values[..., top_k - 1 : top_k]
    return torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)


@functools.cache
def synthetic(k: int, seed: int = 0) -> SimpleNamespace:
    """Random draft and target logits for K = k: ``zq`` (K, V), ``zp`` (K+1, V), and their warped
    distributions ``q``, ``p``. The draft logits are the target's plus noise (a draft resembles its
    target), so that every K-prefix is accepted often and every rejection path occurs too."""
    g = torch.Generator().manual_seed(1000 + 10 * k + seed)
    zp = 2.0 * torch.randn(k + 1, V, generator=g, dtype=torch.float64)
    zq = zp[:k] + 1.0 * torch.randn(k, V, generator=g, dtype=torch.float64)
    return SimpleNamespace(zq=zq, zp=zp, q=ref_warp(zq), p=ref_warp(zp))


# ------------------------------------------------------------------------------ exact law


def num_cells(k: int) -> int:
    return sum(V ** (a + 1) for a in range(k + 1))


def _offsets(k: int) -> torch.Tensor:
    """Cell index of outcome (m = a, Y = (t_0..t_a)): offsets[a] + sum_i t_i V^i."""
    return torch.tensor([sum(V ** (b + 1) for b in range(a)) for a in range(k + 1)])


def exact_law(
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    q_rule: torch.Tensor | None = None,
    residual_from: Callable[[int], int] = lambda j: j,
    bonus_from: int | None = None,
    greedy_draft: bool = False,
) -> torch.Tensor:
    """The probability of every outcome cell of one round, by enumerating the V^K drafts.

    Args:
        p: (K+1, V) target distributions; q: (K, V) the distributions the drafts are sampled from.
        q_rule: the q the rule is given (default: ``q``); differs in the "unwarped q" bug.
        residual_from: j -> the index of the q in the residual after a rejection at (0-based) j.
        bonus_from: the index of the p the bonus is sampled from (default: K).
        greedy_draft: the drafts are the argmax of ``q`` (Draft & Verify's released code).

    Returns:
        float64 (num_cells(K),), summing to 1.
    """
    k = q.shape[0]
    q_rule = q if q_rule is None else q_rule
    bonus = p[k if bonus_from is None else bonus_from]
    offsets = _offsets(k)
    law = torch.zeros(num_cells(k), dtype=torch.float64)
    for d in itertools.product(range(V), repeat=k):
        if greedy_draft:
            prob_d = float(all(d[j] == int(q[j].argmax()) for j in range(k)))
        else:
            prob_d = float(torch.prod(torch.stack([q[j, d[j]] for j in range(k)]))) if k else 1.0
        if prob_d == 0.0:
            continue
        reach = prob_d
        for a in range(k + 1):  # m = a: d_1..d_a accepted, then the rejection of d_{a+1} or the bonus
            if a < k:
                pj, qj = p[a, d[a]], q_rule[a, d[a]]
                acc = float(torch.clamp(pj / qj, max=1.0)) if qj > 0 else float(pj > 0)
                res = (p[a] - q_rule[residual_from(a)]).clamp_min(0)
                nxt = res / res.sum() if float(res.sum()) > 1e-12 else p[a]
                stop, go = reach * (1.0 - acc), reach * acc
            else:
                nxt, stop, go = bonus, reach, 0.0
            code = offsets[a] + sum(d[i] * V**i for i in range(a))
            law[code + torch.arange(V) * V**a] += stop * nxt
            reach = go
            if reach == 0.0:
                break
    return law


def closed_form_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Formula (**) of the module docstring."""
    k = q.shape[0]
    law = []
    for a in range(k + 1):
        r = (p[a] - q[a]).clamp_min(0) if a < k else p[k]
        # the outer product over (x_1..x_a, y), indexed sum_i t_i V^i (t_0 = x_1, .., t_a = y)
        factors = [torch.minimum(p[i], q[i]) for i in range(a)] + [r]
        cell = factors[0]
        for f in factors[1:]:
            cell = (f[:, None] * cell[None, :]).reshape(-1)
        law.append(cell)
    return torch.cat(law)


# ------------------------------------------------------------------------------ running a rule


def draw_drafts(q: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """(n, K) drafts, d_j ~ q_j independently."""
    k = q.shape[0]
    if not k:
        return torch.empty(n, 0, dtype=torch.long)
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)


def outcome_cells(d: torch.Tensor, m: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """The cell index of each row's outcome (m, (d_1..d_m, next))."""
    n, k = d.shape
    toks = torch.cat([d, torch.zeros(n, 1, dtype=torch.long)], dim=1)
    toks[torch.arange(n), m] = nxt
    pos = torch.arange(k + 1)
    code = (toks * V**pos * (pos[None, :] <= m[:, None])).sum(dim=1)
    return _offsets(k)[m] + code


def run_rule(rule: Rule, p: torch.Tensor, q_draft: torch.Tensor, q_rule: torch.Tensor, seed: int, n: int = N):
    """``rule`` on n rows: drafts ~ ``q_draft``, the rule given ``q_rule`` and ``p`` (expanded, no copy)."""
    g = torch.Generator().manual_seed(seed)
    d = draw_drafts(q_draft, n, g)
    k = q_draft.shape[0]
    m, nxt = rule(d, q_rule[None].expand(n, k, V), p[None].expand(n, k + 1, V), g)
    return d, m, nxt


# ------------------------------------------------------------------------------ the checks


def chi2_stat(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; cells with expected < MIN_EXPECTED are pooled
    (into the smallest other cell when the pool itself stays small). An observed cell of expected
    count 0 gives +inf."""
    counts, expected = counts.double(), expected.double()
    if float(counts[expected <= 0].sum()) > 0:
        return float("inf"), 1
    small = expected < MIN_EXPECTED
    obs, exp = counts[~small], expected[~small]
    if small.any() and float(expected[small].sum()) > 0:
        po, pe = counts[small].sum(), expected[small].sum()
        if float(pe) < MIN_EXPECTED and exp.numel():
            i = int(exp.argmin())
            obs, exp = obs.clone(), exp.clone()
            obs[i] += po
            exp[i] += pe
        else:
            obs, exp = torch.cat([obs, po[None]]), torch.cat([exp, pe[None]])
    if exp.numel() < 2:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), exp.numel() - 1


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df >= stat)."""
    if df == 0:
        return 1.0
    if stat == float("inf"):
        return 0.0
    return float(
        torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0))
    )


def fit_pvalue(cells: torch.Tensor, law: torch.Tensor) -> float:
    """Goodness of fit of the outcome cells to the exact law (**)."""
    counts = torch.bincount(cells, minlength=law.numel())
    return chi2_sf(*chi2_stat(counts, law * cells.numel()))


def lossless_pvalue(d: torch.Tensor, m: torch.Tensor, nxt: torch.Tensor, p: torch.Tensor) -> float:
    """Property (*) alone: for each position j, the rows that reached it, grouped by their prefix of
    accepted drafts; within a group the j-th token is multinomial(group size, p_j) under (*), given the
    group sizes, so the groups' Pearson statistics add up. Bonferroni over the K + 1 positions."""
    n, k = d.shape
    worst = 1.0
    for j in range(k + 1):
        rows = m >= j
        tok = torch.where(m[rows] == j, nxt[rows], d[rows, j] if j < k else nxt[rows])
        prefix = (d[rows, :j] * V ** torch.arange(j)).sum(dim=1) if j else torch.zeros_like(tok)
        table = torch.zeros(V**j, V, dtype=torch.float64).index_put_(
            (prefix, tok), torch.ones_like(tok, dtype=torch.float64), accumulate=True
        )
        stat, df = 0.0, 0
        for row in table[table.sum(dim=1) > 0]:
            s, f = chi2_stat(row, row.sum() * p[j])
            stat, df = stat + s, df + f
        worst = min(worst, chi2_sf(stat, df))
    return min(1.0, worst * (k + 1))


def check(d, m, nxt, p, q) -> dict[str, float]:
    """Both checks' p-values for one run (each must exceed ALPHA for a correct rule)."""
    return {
        "fit": fit_pvalue(outcome_cells(d, m, nxt), exact_law(p, q)),
        "lossless": lossless_pvalue(d, m, nxt, p),
    }


def critical_value(df: int, alpha: float = ALPHA) -> float:
    """The chi-square quantile of level 1 - alpha (bisection on `chi2_sf`)."""
    lo, hi = 0.0, df + 100.0 * (df**0.5 + 10)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


# ------------------------------------------------------------------------------ the exact law itself


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_exact_law_is_the_closed_form_and_lossless(k):
    s = synthetic(k)
    law = exact_law(s.p, s.q)
    assert abs(float(law.sum()) - 1) < 1e-12
    torch.testing.assert_close(law, closed_form_law(s.p, s.q), rtol=0, atol=1e-14)
    # (*): per position j and reached prefix, the next token's conditional law is p_j
    offsets = _offsets(k)
    for j in range(k + 1):
        # P(m >= j, prefix, Y_{j+1} = y): the cells of every m = a >= j, summed over the tokens after j
        joint = torch.zeros(V**j, V, dtype=torch.float64)
        for a in range(j, k + 1):
            block = law[offsets[a] : offsets[a] + V ** (a + 1)].reshape(V ** (a - j), V, V**j)
            joint += block.sum(dim=0).T  # index t_0..t_{j-1} (prefix), t_j
        reach = joint.sum(dim=1, keepdim=True)
        torch.testing.assert_close(
            joint, reach * s.p[j][None, :], rtol=0, atol=1e-14, msg=f"position {j + 1}"
        )
    assert float(law[offsets[k] :].sum()) > 0.2, "the bonus must be reached often to be tested"


# ------------------------------------------------------------------------------ the real rule


@pytest.mark.parametrize("k", [1, 2, 3])
def test_accept_prefix_samples_the_exact_law(k):
    """10^6 rows of `accept_prefix`: the outcome counts fit (**), and (*) holds."""
    s = synthetic(k)
    d, m, nxt = run_rule(accept_prefix, s.p, s.q, s.q, seed=k)
    pvals = check(d, m, nxt, s.p, s.q)
    assert min(pvals.values()) > ALPHA, f"K = {k}: accept_prefix does not sample its exact law: {pvals}"
    # every kind of outcome occurs: each m, the bonus included, many times
    assert torch.bincount(m, minlength=k + 1).min() > 10_000


# ------------------------------------------------------------------------------ planted bugs


def _rule_with(residual_shift: int = 0, bonus_from: int | None = None) -> Rule:
    """A re-implementation of `accept_prefix` (same steps, same random stream) with one bug planted:
    ``residual_shift = -1`` takes the residual from q[m - 1]; ``bonus_from`` samples the bonus from
    p[bonus_from] instead of p[K]."""

    def rule(draft, q, p, generator):
        b, k = draft.shape
        rows = torch.arange(b)
        idx = draft[..., None]
        p_d = p[:, :k].gather(-1, idx).squeeze(-1)
        q_d = q.gather(-1, idx).squeeze(-1)
        ratio = torch.where(q_d > 0, (p_d / q_d.clamp_min(1e-300)).clamp(max=1.0), (p_d > 0).double())
        u = torch.rand(b, k, generator=generator, dtype=p.dtype)
        m = (u < ratio).long().cumprod(dim=1).sum(dim=1)
        p_m = p[rows, m]
        q_m = q[rows, (m + residual_shift).clamp(max=k - 1)]  # -1 wraps to q[K - 1] when m = 0
        residual = (p_m - q_m).clamp_min(0)
        mass = residual.sum(dim=-1, keepdim=True)
        fixed = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-12), p_m)
        bonus = p_m if bonus_from is None else p[:, bonus_from]
        return m, sample(torch.where((m < k)[:, None], fixed, bonus), generator)

    return rule


def _unwarped_q(k: int) -> torch.Tensor:
    return torch.softmax(synthetic(k).zq, dim=-1)


#: name: (rule, drafts from the argmax, q the rule is given, exact_law keywords of the buggy law)
BUGS = {
    "residual_from_q_m_minus_1": lambda k: (
        _rule_with(residual_shift=-1),
        False,
        None,
        dict(residual_from=lambda j: j - 1),
    ),
    "bonus_from_p_K_minus_1": lambda k: (_rule_with(bonus_from=k - 1), False, None, dict(bonus_from=k - 1)),
    "unwarped_q": lambda k: (accept_prefix, False, _unwarped_q(k), dict(q_rule=_unwarped_q(k))),
    "dv_released_code": lambda k: (
        accept_prefix,
        True,
        _unwarped_q(k),
        dict(q_rule=_unwarped_q(k), greedy_draft=True),
    ),
}


def test_reimplementation_without_bugs_passes():
    """The re-implementation the bugs are planted in is itself correct (so each failure below is the
    planted bug's)."""
    s = synthetic(3)
    d, m, nxt = run_rule(_rule_with(), s.p, s.q, s.q, seed=30, n=N_CONTROL)
    pvals = check(d, m, nxt, s.p, s.q)
    assert min(pvals.values()) > ALPHA, pvals


def assert_power(bug: str, k: int) -> str:
    """Exactly, without sampling: the law of the rule with ``bug`` is far enough from the correct law
    that the goodness of fit rejects it with probability ~1, at N rows (the real rule's test) and at
    N_CONTROL rows (the controls): its noncentrality exceeds 5x the critical value, or it puts mass
    on an outcome of probability 0 (an infinite statistic). Returns a summary for the messages."""
    s = synthetic(k)
    good, bad = exact_law(s.p, s.q), exact_law(s.p, s.q, **BUGS[bug](k)[3])
    assert abs(float(bad.sum()) - 1) < 1e-12
    seen = good > 0
    chi2_div = float(((bad[seen] - good[seen]) ** 2 / good[seen]).sum())
    crit = critical_value(int(seen.sum()) - 1)
    tv = 0.5 * float((bad - good).abs().sum())
    summary = (
        f"TV {tv:.3f}, noncentrality {N_CONTROL * chi2_div:.0f} at N_CONTROL (critical value {crit:.0f})"
    )
    assert float(bad[~seen].sum()) * N_CONTROL > 20 or N_CONTROL * chi2_div > 5 * crit, (
        f"{bug}: too close to the correct law to be caught: {summary}"
    )
    return summary


@pytest.mark.parametrize("bug", list(BUGS))
def test_checks_reject_each_planted_bug(bug):
    """The same checks reject a rule with a subtle bug: first shown exactly (`assert_power`: the power
    does not rest on a seed), then by running the buggy rule on N_CONTROL rows."""
    k = 3
    s = synthetic(k)
    summary = assert_power(bug, k)
    rule, greedy, q_rule, _ = BUGS[bug](k)
    q_rule = s.q if q_rule is None else q_rule
    if greedy:
        g = torch.Generator().manual_seed(31)
        d = s.q.argmax(dim=-1)[None].expand(N_CONTROL, k).clone()
        m, nxt = rule(d, q_rule[None].expand(N_CONTROL, k, V), s.p[None].expand(N_CONTROL, k + 1, V), g)
    else:
        d, m, nxt = run_rule(rule, s.p, s.q, q_rule, seed=31, n=N_CONTROL)
    pvals = check(d, m, nxt, s.p, s.q)
    print(f"\n{bug}: {summary}; p-values {pvals}")
    assert pvals["fit"] < ALPHA, f"{bug} passed the goodness of fit: {pvals}"
    assert pvals["lossless"] < ALPHA, f"{bug} passed the losslessness check: {pvals}"


# ------------------------------------------------------------------------------ verifier level


class _FixedLogitsState:
    """The part of `DecodeState` that `SamplingVerifier.verify` uses: ``pending`` and a
    ``forward_verify`` returning the same target logits (K+1, V) for every row."""

    def __init__(self, zp: torch.Tensor, rows: int, random) -> None:
        self.pending = torch.zeros(rows, 1, dtype=torch.long)
        self.zp = zp
        self.random = random

    def forward_verify(self, block, logits_at="all", rule=None, rule_inputs=()):
        assert block.shape == (self.pending.shape[0], self.zp.shape[0]) and logits_at == "all"
        logits = self.zp[None].expand(block.shape[0], -1, -1)
        ruled = None if rule is None else rule(device_ops(self.random), block, logits, *rule_inputs)
        return SimpleNamespace(logits=logits, hidden_states=None, ruled=ruled)

    def read(self, **values):
        return {k: v.reshape(-1).tolist() for k, v in values.items()}

    def compute(self, fn, *inputs, **params):
        return fn(device_ops(self.random), *inputs, **params)


class _UnwarpedDraftQ(SamplingVerifier):
    """Planted bug: the draft is sampled from the warped q but Draft.probs keeps softmax(logits)."""

    def draft_sampler(self):
        warped = super().draft_sampler()
        return lambda ops, logits: (warped(ops, logits)[0], torch.softmax(logits, dim=-1))


class _GreedyDraft(SamplingVerifier):
    """Draft & Verify's released code (do_sample_draft=False): the draft token is the argmax, and the
    ratio uses the unwarped softmax."""

    def draft_sampler(self):
        return lambda ops, logits: (logits.argmax(dim=-1), torch.softmax(logits, dim=-1))


@pytest.mark.parametrize(
    ("verifier_cls", "bug"),
    [(SamplingVerifier, None), (_UnwarpedDraftQ, "unwarped_q"), (_GreedyDraft, "dv_released_code")],
    ids=["sampling", "planted_unwarped_draft_q", "dv_released_code"],
)
def test_verifier_draft_sampler_and_verify_sample_the_exact_law(verifier_cls, bug):
    """`SamplingVerifier` end to end on fixed logits (temperature 0.7, top-k 4): drafts and q from
    `draft_sampler` (as `DraftSteps` calls it), then `verify`, on N rows at once; the outcome must
    follow the exact law of the warped p and q (warped here by `ref_warp`, independently). A verifier
    whose draft q is the unwarped softmax, or that drafts greedily (Draft & Verify's released code),
    is rejected (N_CONTROL rows)."""
    k = 3
    s = synthetic(k)
    n = N if bug is None else N_CONTROL
    summary = "" if bug is None else assert_power(bug, k)
    v = verifier_cls(SamplingVerifierConfig(temperature=TEMPERATURE, top_k=TOP_K, seed=5))
    sampler = v.draft_sampler()
    toks, qs = zip(
        *(sampler(device_ops(v.random), s.zq[j][None].expand(n, V)) for j in range(k)), strict=True
    )
    draft = Draft(torch.stack(toks, dim=1), LayerPlan.full(2), probs=torch.stack(qs, dim=1))
    res = v.verify(_FixedLogitsState(s.zp, n, v.random), draft)
    m, nxt = res.num_accepted, res.new_tokens[:, -1]
    pvals = check(draft.tokens, m, nxt, s.p, s.q)
    print(f"\n{verifier_cls.__name__}: {summary} p-values {pvals}")
    if bug is None:
        assert min(pvals.values()) > ALPHA, f"the sampling verifier does not sample the exact law: {pvals}"
    else:
        assert max(pvals.values()) < ALPHA, f"{verifier_cls.__name__} passed: {pvals}"


def test_a_draft_token_the_target_gives_no_mass_is_never_accepted_even_at_u_zero():
    """The acceptance ``u < p(d) / q(d)`` at its boundary: a uniform of exactly 0 (which
    ``torch.rand`` can draw) and a draft token of target probability 0 must reject (0 < 0 is
    false), and accept any token the target gives mass, however small."""
    from strategies.verifiers.sampling import accept_with_noise

    q = torch.tensor([[[0.5, 0.5, 0.0]]])  # (B, K, V): the draft drew token 0 or 1
    p = torch.tensor([[[0.0, 1e-30, 1.0], [1 / 3, 1 / 3, 1 / 3]]])  # (B, K+1, V)
    u, e = torch.zeros(1, 1), torch.ones(1, 3)
    m, nxt = accept_with_noise(torch.tensor([[0]]), q, p, u, e)
    assert m.tolist() == [0] and nxt.tolist() == [2]  # rejected: the residual is token 2's
    m, _ = accept_with_noise(torch.tensor([[1]]), q, p, u, e)
    assert m.tolist() == [1]


def test_a_token_no_row_of_the_verify_forward_saw_is_never_accepted():
    """A verification that reused an early-exit draft hands its rule ``-1`` for every token from
    where the block leaves what the draft fed (`framework.engine.execution.spec.seen_ids`): the sampling
    rule rejects it, whatever the draws, and never indexes the distributions with it."""
    from strategies.verifiers.sampling import accept_with_noise

    p, q = torch.full((1, 3, 4), 0.25), torch.full((1, 2, 4), 0.25)
    u, e = torch.zeros(1, 2), torch.ones(1, 4)  # u = 0: every seen token is accepted
    assert int(accept_with_noise(torch.tensor([[1, 2]]), q, p, u, e)[0]) == 2
    assert int(accept_with_noise(torch.tensor([[1, -1]]), q, p, u, e)[0]) == 1
    assert int(accept_with_noise(torch.tensor([[-1, -1]]), q, p, u, e)[0]) == 0
