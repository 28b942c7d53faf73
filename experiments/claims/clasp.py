"""CLaSp: the claims of seeds-clasp-del.md Part D #1-#8 (the DP vs brute force and
random sets, the sequence-parallel DP, sparse persistence, the layer-optimisation interval, M, the
draft-exit threshold)."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from typing import Any

import numpy as np
import torch

from framework import LayerPlan
from framework.engine.state import DecodeState
from strategies.selectors.clasp_dp import clasp_dp

from . import stats
from .common import CL, R2, Claim, Ctx, check, committed, decode, fmt, measured, monotone, ternary
from .measure import dp_cosine, dp_positions
from .stats import above, alpha, show, speed

#: The length controller every CLaSp decode uses: DET 0.7, K = 12.
CLASP_LENGTH = ("confidence", {"threshold": 0.7, "max_length": 12})


def clasp_m(ctx: Ctx) -> int:
    return max(1, round(0.2 * ctx.L))


def c_cl_bruteforce(ctx: Ctx) -> dict[str, Any]:
    L = ctx.L
    n, m = (4, 2) if ctx.smoke else ((10, 3) if ctx.mode == "quick" else (14, 5))
    lo = (L - n) // 2
    window = list(range(lo, lo + n))
    protected = [b for b in range(L) if b not in window]
    pts = dp_positions(ctx, 2 if ctx.smoke else 3, 2 if ctx.smoke else (4 if ctx.mode == "quick" else 7))
    rows = []
    for i, state, x, pos in pts:
        res = clasp_dp(x, state, pos, m, protected=protected)
        every = [dp_cosine(state, x, pos, s) for s in itertools.combinations(window, m)]
        rows.append(
            {
                "prompt": i,
                "position": pos,
                "dp": res.cosine,
                "best": max(every),
                "mean": statistics.mean(every),
                "sets": len(every),
            }
        )
    gap = [(r["best"] - r["dp"]) / abs(r["best"]) for r in rows]
    text = (
        f"blocks {window[0]}-{window[-1]} free, M = {m}, C({n},{m}) = {rows[0]['sets']} sets, {len(rows)} tokens: mean DP "
        f"cosine {fmt(statistics.mean(r['dp'] for r in rows), 4)}, best {fmt(statistics.mean(r['best'] for r in rows), 4)}, "
        f"mean of all sets {fmt(statistics.mean(r['mean'] for r in rows), 4)}; DP optimal at {sum(g <= 1e-9 for g in gap)} "
        f"of {len(rows)} tokens, largest gap {100 * max(gap):.2f}%"
    )
    return measured(text, {"rows": rows, "window": window, "M": m})


def d_cl_bruteforce(n: dict[str, Any]) -> tuple[str, str]:
    rows = n["rows"]
    gap = np.asarray([(r["best"] - r["dp"]) / abs(r["best"]) for r in rows])
    over = np.asarray([r["dp"] - r["mean"] for r in rows])
    g = stats.bootstrap(lambda i: float(gap[i].mean()), len(rows))
    o = stats.bootstrap(lambda i: float(over[i].mean()), len(rows))
    v, why = ternary(
        {"within 1% of brute force (CI)": g["hi"] <= 0.01, "above the mean of all sets (CI)": above(o)}
    )
    return v, why + f"; relative gap {show(g, 2, pct=True)}; DP - mean of all sets {show(o, 4)}"


def _random_blocks(ctx: Ctx, m: int) -> list[list[int]]:
    rng = random.Random(1)
    return [sorted(rng.sample(range(ctx.L), m)) for _ in range(ctx.n_random)]


def c_cl_dp_vs_random(ctx: Ctx) -> dict[str, Any]:
    m = clasp_m(ctx)
    L = ctx.L
    rng = random.Random(1)
    pts = dp_positions(ctx, 3 if not ctx.full else 6, len(ctx.ids))
    cos_dp, cos_rand, cos_prompt = [], [], []
    first_set: dict[int, tuple[int, ...]] = {}
    for i, state, x, pos in pts:
        if i not in first_set:  # the set of LOI = infinity: the DP on the prompt's last token
            p = state.prompt_len - 1
            hs_prompt = _prompt_hidden(ctx, i)
            first_set[i] = clasp_dp(hs_prompt, state, p, m).skip
        res = clasp_dp(x, state, pos, m)
        cos_dp.append(res.cosine)
        cos_prompt.append(dp_cosine(state, x, pos, first_set[i]))
        cos_rand.append(statistics.mean(dp_cosine(state, x, pos, rng.sample(range(L), m)) for _ in range(4)))
    dp = decode(ctx, f"clasp M={m}", ("clasp_dp", {"num_skip": m}), CLASP_LENGTH)
    never = decode(
        ctx, f"clasp M={m} LOI=inf", ("clasp_dp", {"num_skip": m, "interval": 100000}), CLASP_LENGTH
    )
    rdec = [
        decode(
            ctx,
            f"random {m} blocks #{j}",
            ("static", {"skip_attn": tuple(s), "skip_mlp": tuple(s)}),
            CLASP_LENGTH,
        )
        for j, s in enumerate(_random_blocks(ctx, m))
    ]
    text = (
        f"M = {m} of {L} blocks; final-layer cosine over {len(pts)} tokens: DP {fmt(statistics.mean(cos_dp), 4)}, "
        f"prompt-time set (LOI = inf) {fmt(statistics.mean(cos_prompt), 4)}, random sets {fmt(statistics.mean(cos_rand), 4)}; "
        f"alpha: DP every 8 rounds {fmt(dp.alpha)} (M {fmt(dp.M, 2)}), LOI = inf {fmt(never.alpha)}, {len(rdec)} random "
        f"sets {', '.join(fmt(r.alpha) for r in rdec)} (mean {fmt(statistics.mean(r.alpha for r in rdec))})"
    )
    return measured(
        text,
        {
            "cos_dp": cos_dp,
            "cos_prompt_set": cos_prompt,
            "cos_random": cos_rand,
            "dp": dp.counts(),
            "loi_inf": never.counts(),
            "random": [r.counts() for r in rdec],
        },
    )


def d_cl_dp_vs_random(n: dict[str, Any]) -> tuple[str, str]:
    dr = stats.diff_vs_sets(alpha, n["dp"], n["random"])
    dl = stats.diff(alpha, n["dp"], n["loi_inf"])
    v, why = ternary(
        {
            "DP > random sets in alpha (CI)": above(dr),
            "DP > prompt-time set (LOI = inf) in alpha (CI)": above(dl),
        }
    )
    return v, why + f"; DP - random {show(dr)}; DP - LOI=inf {show(dl)}"


def _prompt_hidden(ctx: Ctx, i: int) -> torch.Tensor:
    """The full model's states (L+1, d) of prompt i's last token (a fresh prefill)."""
    key = f"prompt_hidden:{i}"
    if key not in ctx.memo:
        st = DecodeState(ctx.adapter, ctx.ids[i], ctx.ids[i].shape[1] + 4, capture_hidden=True)
        st.prefill()
        ctx.memo[key] = st.last_hidden_states[:, 0, -1]
    return ctx.memo[key]


def _parallel_runs(ctx: Ctx) -> dict[str, Any]:
    """The sequence-parallel and the sequential DP at M = L/2 on one token, timed: 7 parallel DPs
    each paired with a full-depth forward of 4 tokens (a verification of 3 drafts), and 3
    sequential DPs."""
    if "cl_parallel" in ctx.memo:
        return ctx.memo["cl_parallel"]
    m = max(1, ctx.L // 2)
    (i, state, x, pos) = dp_positions(ctx, 1, 1)[0]
    full = LayerPlan.full(ctx.L)
    start = max(0, state.num_tokens - 1 - 4)
    tp, tv, ts = [], [], []
    for _ in range(7):
        t0 = time.perf_counter()
        par = clasp_dp(x, state, pos, m)
        tp.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state.forward_scratch(start, full, end=start + 4, logits_at="all")
        tv.append(time.perf_counter() - t0)
    for _ in range(3):
        t0 = time.perf_counter()
        seq = clasp_dp(x, state, pos, m, sequence_parallel=False)
        ts.append(time.perf_counter() - t0)
    out = {
        "M": m,
        "same_set": par.skip == seq.skip,
        "cosine_gap": abs(par.cosine - seq.cosine),
        "block_calls": par.block_calls,
        "evaluations": par.evaluations,
        "unpruned": m * (2 * ctx.L - m - 1) // 2,
        "parallel_seconds": tp,
        "verify4_seconds": tv,
        "sequential_seconds": ts,
        "layers_with_candidates": ctx.L,
    }
    ctx.memo["cl_parallel"] = out
    return out


def c_cl_parallel(ctx: Ctx) -> dict[str, Any]:
    r = _parallel_runs(ctx)
    tp, tv, ts = (
        statistics.median(r[k]) for k in ("parallel_seconds", "verify4_seconds", "sequential_seconds")
    )
    text = (
        f"M = {r['M']} of {ctx.L}: the sequence-parallel DP {1e3 * tp:.0f} ms (median of 7) = {tp / tv:.2f} "
        f"full-depth forwards of 4 tokens (each timed right after it, median {1e3 * tv:.0f} ms); the sequential DP "
        f"{1e3 * ts:.0f} ms (median of 3, {ts / tp:.1f}x the parallel DP)"
    )
    return measured(text, r)


def d_cl_parallel(n: dict[str, Any]) -> tuple[str, str]:
    p, v = np.asarray(n["parallel_seconds"]), np.asarray(n["verify4_seconds"])
    r = stats.bootstrap(lambda i: float(np.median(p[i] / v[i])), len(p))
    faster = max(n["parallel_seconds"]) * 2 < min(n["sequential_seconds"])
    verdict_, why = ternary(
        {
            "DP <= 1.5 verify passes (CI)": r["hi"] <= 1.5,
            "sequence parallelism >= 2x faster than sequential (every run)": faster,
        }
    )
    return verdict_, why + f"; DP / verify (median of paired runs) {show(r, 2)}"


def c_cl_parallel_exact(ctx: Ctx) -> dict[str, Any]:
    r = _parallel_runs(ctx)
    text = (
        f"M = {r['M']}: same set sequential vs parallel: {r['same_set']} (cosine gap {r['cosine_gap']:.1e}); parallel "
        f"{r['block_calls']} block calls (<= L = {ctx.L}), {r['evaluations']} state evaluations (<= the unpruned "
        f"M(2L-M-1)/2 = {r['unpruned']})"
    )
    return measured(
        text,
        {
            k: r[k]
            for k in (
                "M",
                "same_set",
                "cosine_gap",
                "block_calls",
                "evaluations",
                "unpruned",
                "layers_with_candidates",
            )
        },
    )


def d_cl_parallel_exact(n: dict[str, Any]) -> tuple[str, str]:
    ok = (
        n["same_set"]
        and n["cosine_gap"] < 1e-5
        and n["block_calls"] <= n["layers_with_candidates"]
        and n["evaluations"] <= n["unpruned"]
    )
    return check(
        ok,
        "same set and cosine, at most one block call per layer, no more evaluations than the unpruned count",
    )


def c_cl_persistence(ctx: Ctx) -> dict[str, Any]:
    m = clasp_m(ctx)
    n_prompts = 2 if ctx.smoke else len(ctx.ids)
    ks = [1, 2, 4, 8, 16, 32]
    per_prompt: list[dict[str, list[float]]] = []
    rng = random.Random(2)
    for i in range(min(n_prompts, len(ctx.ids))):
        state, hs = committed(ctx, i, capture_hidden=True)
        if hs is None:
            continue
        sets = [set(clasp_dp(hs[:, j], state, state.prompt_len + j, m).skip) for j in range(hs.shape[1])]
        jac = {
            str(k): [len(sets[a] & sets[a + k]) / len(sets[a] | sets[a + k]) for a in range(len(sets) - k)]
            for k in ks
        }
        per_prompt.append(jac)
    rand = []
    for _ in range(2000):
        s, t = set(rng.sample(range(ctx.L), m)), set(rng.sample(range(ctx.L), m))
        rand.append(len(s & t) / len(s | t))
    means = {
        str(k): statistics.mean(v for p in per_prompt for v in p[str(k)])
        for k in ks
        if any(p[str(k)] for p in per_prompt)
    }
    text = (
        f"DP (M = {m}) at every generated token of {len(per_prompt)} prompts: mean Jaccard(S_t, S_t+k) "
        + ", ".join(f"k={k}: {fmt(v)}" for k, v in means.items())
        + f"; random sets of the same size: {fmt(statistics.mean(rand))}"
    )
    return measured(text, {"per_prompt": per_prompt, "random": statistics.mean(rand), "means": means})


def _jac(per_prompt: list[dict[str, list[float]]], k: str, idx: np.ndarray) -> float:
    vals = [v for i in idx for v in per_prompt[i][k]]
    return float(np.mean(vals)) if vals else float("nan")


def d_cl_persistence(n: dict[str, Any]) -> tuple[str, str]:
    pp = n["per_prompt"]
    ks = sorted(n["means"], key=int)
    lo, hi = ks[0], ks[-1]
    high = stats.bootstrap(lambda i: _jac(pp, lo, i) - n["random"], len(pp))
    fall = stats.bootstrap(lambda i: _jac(pp, lo, i) - _jac(pp, hi, i), len(pp))
    pts = [n["means"][k] for k in ks]
    v, why = ternary(
        {
            f"Jaccard at k={lo} above random sets (CI)": above(high),
            "decreasing in k (points within 0.01, first - last CI above 0)": monotone(pts, False, 0.01)
            and above(fall),
        }
    )
    return v, why + f"; J({lo}) - random {show(high)}; J({lo}) - J({hi}) {show(fall)}"


def c_cl_loi(ctx: Ctx) -> dict[str, Any]:
    m = clasp_m(ctx)
    lois = [1, 4, 16, 64] if ctx.full else ([1, 4, 16] if not ctx.smoke else [1, 16])
    rows = {
        loi: decode(
            ctx,
            f"clasp M={m} LOI={loi}",
            ("clasp_dp", {"num_skip": m} | ({} if loi == 8 else {"interval": loi})),
            CLASP_LENGTH,
        )
        for loi in lois
    }
    share = {
        loi: [r.strategy_summary["selector"].get("dp_share") or 0.0 for r in rows[loi].results]
        for loi in lois
    }
    text = ", ".join(
        f"LOI {loi}: alpha {fmt(rows[loi].alpha)}, DP share {100 * statistics.mean(share[loi]):.1f}%"
        for loi in lois
    )
    return measured(
        text,
        {"loi": {str(loi): {"counts": rows[loi].counts(), "dp_share": share[loi]} for loi in lois}},
        "speedup-vs-LOI unimodality not tested (it needs timed decodes per LOI)",
    )


def d_cl_loi(n: dict[str, Any]) -> tuple[str, str]:
    rows = n["loi"]
    keys = sorted(rows, key=int)
    first, last = keys[0], keys[-1]
    d = stats.diff(alpha, rows[last]["counts"], rows[first]["counts"])
    s1, s2 = np.mean(rows[first]["dp_share"]), np.mean(rows[last]["dp_share"])
    k = int(last) / int(first)
    falls = s2 <= s1 * 2 / k if s1 > 0 else False
    v, why = ternary(
        {
            f"alpha(LOI {last}) >= alpha(LOI {first}) - 0.05 (CI)": d["lo"] >= -0.05,
            "DP share falls ~1/LOI (at least half the 1/LOI factor)": falls,
        }
    )
    return v, why + f"; alpha difference {show(d)}; DP share {100 * s1:.1f}% -> {100 * s2:.1f}%"


def c_cl_m_sweep(ctx: Ctx) -> dict[str, Any]:
    L = ctx.L
    ms = sorted(
        {
            max(1, round(f * L))
            for f in ((0.1, 0.2, 0.3, 0.5) if not ctx.full else (0.1, 0.2, 0.3, 0.4, 0.5, 0.6))
        }
    )
    rows = {m: decode(ctx, f"clasp M={m}", ("clasp_dp", {"num_skip": m}), CLASP_LENGTH) for m in ms}
    text = "; ".join(
        f"M = {m} ({100 * m / L:.0f}%): alpha {fmt(rows[m].alpha)}, M_acc {fmt(rows[m].M, 2)}, modelled {fmt(rows[m].modelled_speedup)}x"
        for m in ms
    )
    return measured(text, {"M": {str(m): rows[m].counts() for m in ms}, "L": L})


def d_cl_m_sweep(n: dict[str, Any]) -> tuple[str, str]:
    rows = n["M"]
    keys = sorted(rows, key=int)
    pts = [alpha(rows[k]) for k in keys]
    d = stats.diff(alpha, rows[keys[-1]], rows[keys[0]])
    falls = monotone(pts, False, 0.01) and stats.below(d)
    spd = [speed(rows[k]) for k in keys]
    b = max(range(len(keys)), key=lambda i: spd[i])
    inner = 0 < b < len(keys) - 1
    peak = (
        inner
        and above(stats.diff(speed, rows[keys[b]], rows[keys[0]]))
        and above(stats.diff(speed, rows[keys[b]], rows[keys[-1]]))
    )
    v, why = ternary(
        {"alpha falls with M": falls, f"the modelled speedup peaks inside (best M = {keys[b]})": peak}
    )
    return v, why + f"; alpha(M={keys[-1]}) - alpha(M={keys[0]}) {show(d)}"


def c_cl_det(ctx: Ctx) -> dict[str, Any]:
    m = clasp_m(ctx)
    dets = [0.5, 0.6, 0.7, 0.8, 0.9] if not ctx.smoke else [0.6, 0.7, 0.9]
    rows = {
        d: decode(
            ctx,
            f"clasp DET={d}",
            ("clasp_dp", {"num_skip": m}),
            ("confidence", {"threshold": d, "max_length": 12}),
        )
        for d in dets
    }
    k_none = 3 if ctx.smoke else 12
    none = decode(ctx, f"clasp no exit (K={k_none})", ("clasp_dp", {"num_skip": m}), ("fixed", {"k": k_none}))
    text = (
        ", ".join(
            f"DET {d}: alpha {fmt(rows[d].alpha)}, modelled {fmt(rows[d].modelled_speedup)}x" for d in dets
        )
        + f"; no exit (K = {k_none}): {fmt(none.modelled_speedup)}x"
    )
    return measured(text, {"det": {str(d): rows[d].counts() for d in dets}, "none": none.counts()})


def d_cl_det(n: dict[str, Any]) -> tuple[str, str]:
    rows = n["det"]
    d = stats.diff(speed, rows["0.7"], n["none"])
    flat_keys = [k for k in rows if 0.6 <= float(k) <= 0.9]
    s = [speed(rows[k]) for k in flat_keys]
    spread = (max(s) - min(s)) / speed(rows["0.7"]) if speed(rows["0.7"]) else float("inf")
    v, why = ternary(
        {"DET 0.7 beats no exit (CI)": above(d), "flat over DET 0.6-0.9 (spread <= 5%)": spread <= 0.05}
    )
    return v, why + f"; DET 0.7 - no exit {show(d)}; spread {100 * spread:.1f}%"


CLAIMS: list[Claim] = [
    Claim(
        "cl_bruteforce",
        CL,
        f"{R2} #1",
        "The DP's final-layer cosine is within ~1% of the brute-force optimum on a sub-range, clearly above random sets",
        c_cl_bruteforce,
        rule="the middle 10 blocks free (14 with --full), M = 3 (5), every set of the sub-range scored at 3 "
        "tokens of each of 4 prompts (7): (a) the CI (bootstrap over tokens) of the mean relative gap (best - DP) "
        "/ best lies at or below 1% (the claim's 'within about 1%'); (b) the CI of DP minus the mean cosine of all "
        "sets (the expected random set) lies above 0. yes if (a) and (b); partly if one; no if neither",
        decide=d_cl_bruteforce,
    ),
    Claim(
        "cl_dp_vs_random",
        CL,
        f"{R2} #2",
        "With the same M, the DP's set gives higher acceptance than random sets and than a set computed once on the prompt (LOI = inf)",
        c_cl_dp_vs_random,
        rule="M = 20% of the blocks, DET 0.7, K = 12: (a) alpha(DP, LOI 8) minus the mean alpha of --random-sets "
        "random sets of M blocks has its CI (prompts and sets resampled) above 0; (b) alpha(DP, LOI 8) minus "
        "alpha(the prompt-time set, LOI = inf) has its paired CI above 0. yes if (a) and (b); partly if one; no if "
        "neither (the paper gives the direction only)",
        decide=d_cl_dp_vs_random,
    ),
    Claim(
        "cl_parallel",
        CL,
        f"{R2} #4",
        "With sequence parallelism the DP's wall time is within ~1.5x of a verify pass (vs ~25-30x for the sequential DP on a deep model)",
        c_cl_parallel,
        rule="M = L/2 on one token: (a) the CI (bootstrap over 7 paired runs) of the median ratio DP time / time of "
        "a full-depth forward of 4 tokens lies at or below 1.5 (paper: 0.14 s vs 0.1 s); (b) every sequential DP "
        "run is more than twice as slow as every parallel run (the paper's 25-30x is for 80 layers). yes if (a) "
        "and (b); partly if one; no if neither",
        decide=d_cl_parallel,
    ),
    Claim(
        "cl_parallel_exact",
        CL,
        f"{R2} #3",
        "The sequence-parallel DP gives the same set as the sequential one, with at most one block call per layer",
        c_cl_parallel_exact,
        rule="pass if the two DPs give the same set and cosine (within 1e-5), with at most L block calls and no "
        "more state evaluations than M(2L-M-1)/2",
        decide=d_cl_parallel_exact,
        kind="check",
        test="tests/strategies/selectors/test_clasp_dp.py::test_sequence_parallel_equals_sequential_and_costs_one_call_per_layer",
    ),
    Claim(
        "cl_persistence",
        CL,
        f"{R2} #5",
        "Jaccard(S_t, S_t+k) is high for small k and decreases with k (sparse persistence)",
        c_cl_persistence,
        rule="the DP (M = 20%) at every generated token of every prompt, k = 1, 2, 4, 8, 16, 32: (a) Jaccard at "
        "k = 1 minus that of random sets of the same size has its CI (bootstrap over prompts) above 0; (b) it "
        "decreases with k: the point estimates never rise by more than 0.01 and J(1) - J(32) has its CI above 0. "
        "yes if (a) and (b); partly if one; no if neither (the paper gives no magnitude)",
        decide=d_cl_persistence,
    ),
    Claim(
        "cl_loi",
        CL,
        f"{R2} #6",
        "Acceptance degrades slowly as LOI grows from 1 to ~64 while the DP overhead falls as 1/LOI",
        c_cl_loi,
        rule="LOI = 1, 4, 16 rounds (64 too with --full; a quick run has ~15 rounds per prompt): (a) alpha at the "
        "largest LOI minus alpha at LOI 1 has its CI's lower end >= -0.05 (slow degradation, established); (b) the "
        "DP's share of wall time at the largest LOI is at most 2/LOI of its share at LOI 1 (at least half the "
        "1/LOI fall). yes if (a) and (b); partly if one; no if neither (speedup-vs-LOI unimodality: not tested)",
        decide=d_cl_loi,
    ),
    Claim(
        "cl_m_sweep",
        CL,
        f"{R2} #7",
        "Acceptance falls monotonically with M; speedup vs M is unimodal with the optimum at 40-60% on large models",
        c_cl_m_sweep,
        rule="M = 10, 20, 30, 50% of the blocks (10-60% with --full): (a) alpha falls: the point estimates never "
        "rise by more than 0.01 and alpha(largest M) - alpha(smallest M) has its CI below 0; (b) the modelled "
        "speedup peaks at an interior M with the CIs of peak minus both ends above 0 (the location is not "
        "required: 'small models probably lower'). yes if (a) and (b); partly if one; no if neither",
        decide=d_cl_m_sweep,
    ),
    Claim(
        "cl_det",
        CL,
        f"{R2} #8",
        "A draft-exit threshold ~0.7 beats no exit; speedup is flat for DET in [0.6, 0.9]",
        c_cl_det,
        rule="(a) modelled speedup(DET 0.7) minus speedup(no exit, K = 12) has its CI above 0; (b) the spread "
        "(max - min) of the modelled speedup over DET 0.6-0.9 is <= 5% of DET 0.7's (the paper: 'flat'). yes if "
        "(a) and (b); partly if one; no if neither",
        decide=d_cl_det,
    ),
]
