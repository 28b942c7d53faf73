"""Draft & Verify (Self-SD): the claims of seeds-selfsd-swift.md Part E #3-#9 (fixed K,
the exit threshold, the adaptive threshold, searched vs naive skip sets, the skip count, the
skipped pattern, the Bayesian-optimisation budget).

Each claim is a ``c_*`` function (measures, returns `measured`) and a ``d_*`` function (its
`Claim.rule` as code: numbers -> verdict)."""

from __future__ import annotations

import random
import statistics
from typing import Any

from framework import LayerPlan
from strategies.selectors.static import uniform_plan

from . import stats
from .common import (
    ADAPTIVE,
    NO,
    NOT_TESTABLE,
    PARTLY,
    R1,
    SD,
    YES,
    Claim,
    Ctx,
    build,
    decode,
    fmt,
    graded,
    measured,
    monotone,
    static_spec,
    ternary,
)
from .measure import counts_plan, matchness, random_plan, selfsd_set, swift_drive, swift_steps
from .stats import above, alpha, below, diff, diff_vs_sets, show, speed


def _trend(rows: dict[str, dict], keys: list[str], increasing: bool, tol: float = 0.01) -> dict[str, Any]:
    """Whether alpha moves in one direction over ``keys``: the point estimates never step against
    it by more than ``tol``, and the last-minus-first difference's interval excludes 0."""
    pts = [alpha(rows[k]) for k in keys]
    d = diff(alpha, rows[keys[-1]], rows[keys[0]])
    ok = monotone(pts, increasing, tol) and (above(d) if increasing else below(d))
    return {"ok": ok, "points": pts, "end_diff": d}


def _interior_peak(rows: dict[str, dict], keys: list[str], metric=speed) -> dict[str, Any]:
    """Whether ``metric`` peaks inside ``keys``: the best point estimate is neither the first nor
    the last key, and the peak-minus-end differences' intervals are both above 0."""
    pts = [metric(rows[k]) for k in keys]
    best = max(range(len(keys)), key=lambda i: pts[i])
    inner = 0 < best < len(keys) - 1
    d_lo = diff(metric, rows[keys[best]], rows[keys[0]])
    d_hi = diff(metric, rows[keys[best]], rows[keys[-1]])
    return {
        "best": keys[best],
        "inner": inner,
        "ok": inner and above(d_lo) and above(d_hi),
        "d_first": d_lo,
        "d_last": d_hi,
    }


# ---- #3 fixed K ------------------------------------------------------------------------------


def _ks(ctx: Ctx) -> list[int]:
    return [2, 4, 6, 8] if not ctx.smoke else [2, 4]


def c_sd_fixed_k(ctx: Ctx) -> dict[str, Any]:
    plan, _ = selfsd_set(ctx)
    ks = _ks(ctx)
    rows = {k: decode(ctx, f"fixed K={k}", static_spec(plan), ("fixed", {"k": k})) for k in ks}
    text = "searched set, fixed K, no threshold: " + ", ".join(
        f"K={k}: alpha {fmt(rows[k].alpha)}, modelled {fmt(rows[k].modelled_speedup)}x" for k in ks
    )
    return measured(text, {"K": {str(k): rows[k].counts() for k in ks}})


def d_sd_fixed_k(n: dict[str, Any]) -> tuple[str, str]:
    rows = n["K"]
    keys = sorted(rows, key=int)
    ar = _trend(rows, keys, increasing=False)
    pk = _interior_peak(rows, keys)
    v, why = ternary({"AR falls with K": ar["ok"], f"speedup peaks inside (best K = {pk['best']})": pk["ok"]})
    return v, why + f"; AR(K={keys[-1]}) - AR(K={keys[0]}) = {show(ar['end_diff'])}"


# ---- #4 static threshold -------------------------------------------------------------------


def _gammas(ctx: Ctx) -> list[float]:
    return [0.2, 0.4, 0.6, 0.8] if not ctx.smoke else [0.2, 0.6, 0.8]


def c_sd_threshold(ctx: Ctx) -> dict[str, Any]:
    plan, _ = selfsd_set(ctx)
    gs = _gammas(ctx)
    rows = {g: decode(ctx, f"gamma={g}", static_spec(plan), ("confidence", {"threshold": g})) for g in gs}
    text = ", ".join(
        f"gamma {g}: alpha {fmt(rows[g].alpha)}, modelled {fmt(rows[g].modelled_speedup)}x" for g in gs
    )
    return measured(text, {"gamma": {str(g): rows[g].counts() for g in gs}})


def d_sd_threshold(n: dict[str, Any]) -> tuple[str, str]:
    rows = n["gamma"]
    keys = sorted(rows, key=float)
    ar = _trend(rows, keys, increasing=True)
    pts = [speed(rows[k]) for k in keys]
    best = keys[max(range(len(keys)), key=lambda i: pts[i])]
    d_lo = diff(speed, rows[best], rows[keys[0]])
    peak = best not in (keys[0], keys[-1]) and above(d_lo)
    v, why = ternary(
        {"AR rises with gamma": ar["ok"], f"speedup peaks at an intermediate gamma (best {best})": peak}
    )
    return v, why + f"; speedup(best) - speedup({keys[0]}) = {show(d_lo)}"


# ---- #5 adaptive threshold -----------------------------------------------------------------


def c_sd_adaptive(ctx: Ctx) -> dict[str, Any]:
    plan, _ = selfsd_set(ctx)
    ad = decode(ctx, "adaptive", static_spec(plan), ADAPTIVE)
    thr = c_sd_threshold(ctx)["numbers"]["gamma"]
    target = build("length", ADAPTIVE[0], **ADAPTIVE[1]).config.target_accept_rate
    gammas = [r.strategy_summary.get("length", {}).get("gamma") for r in ad.results]
    best = max(thr, key=lambda g: speed(thr[g]))
    text = (
        f"adaptive: alpha {fmt(ad.alpha)}, modelled {fmt(ad.modelled_speedup)}x; best static gamma {best}: "
        f"{fmt(speed(thr[best]))}x; final gamma per prompt {', '.join(fmt(g or 0, 2) for g in gammas)}"
    )
    return measured(
        text,
        {"adaptive": ad.counts(), "static": thr, "target": target, "gamma": gammas},
        "K in {10..18} flatness not swept",
    )


def d_sd_adaptive(n: dict[str, Any]) -> tuple[str, str]:
    thr = n["static"]
    best = max(thr, key=lambda g: speed(thr[g]))
    r = stats.ratio(speed, n["adaptive"], thr[best])
    a = stats.ci_of(n["adaptive"], alpha)
    t = n["target"]
    near = a["lo"] >= t - 0.05 and a["hi"] <= t + 0.05
    v, why = ternary({"within 2% of the best static gamma": r["lo"] >= 0.98, "alpha near its target": near})
    return v, why + f"; adaptive / gamma {best} = {show(r)}; alpha {show(a)} vs target {t}"


# ---- #6 searched vs naive sets ---------------------------------------------------------------


def _naive_sets(ctx: Ctx, plan: LayerPlan) -> dict[str, LayerPlan]:
    L = ctx.L
    d = plan.describe()
    na, nm = len(d["attn_skip"]), len(d["mlp_skip"])
    k = max(na, nm)
    mid = (L - k) // 2
    return {
        "first": counts_plan(L, list(range(na)), list(range(nm))),
        "middle": counts_plan(L, list(range(mid, mid + na)), list(range(mid, mid + nm))),
        "last": counts_plan(L, list(range(L - na, L)), list(range(L - nm, L))),
    }


def _random_sets(ctx: Ctx, plan: LayerPlan) -> list[LayerPlan]:
    d = plan.describe()
    rng = random.Random(0)
    return [random_plan(ctx.L, len(d["attn_skip"]), len(d["mlp_skip"]), rng) for _ in range(ctx.n_random)]


def c_sd_searched(ctx: Ctx) -> dict[str, Any]:
    if "sd_searched" in ctx.memo:
        return ctx.memo["sd_searched"]
    plan, info = selfsd_set(ctx)
    sets = {"searched": plan, **_naive_sets(ctx, plan)}
    d = plan.describe()
    rand = _random_sets(ctx, plan)
    swift = build("selector", "swift", skip_ratio=0.45)
    swift.setup(ctx.adapter.arch.info())
    match = {name: matchness(ctx, p, swift) for name, p in sets.items()}
    rmatch = [matchness(ctx, p, swift) for p in rand]
    rows = {name: decode(ctx, f"{name} set", static_spec(p), ADAPTIVE) for name, p in sets.items()}
    rrows = [decode(ctx, f"random set {j}", static_spec(p), ADAPTIVE) for j, p in enumerate(rand)]
    text = (
        f"{info['source']}{'' if info['improved'] else ' (its best is its first probe)'}: {len(d['attn_skip'])} "
        f"attention + {len(d['mlp_skip'])} MLP. alpha / modelled speedup / matchness: "
        + "; ".join(
            f"{n} {fmt(rows[n].alpha)} / {fmt(rows[n].modelled_speedup)}x / {fmt(match[n] or 0)}"
            for n in sets
        )
        + f"; {len(rrows)} random sets: alpha {', '.join(fmt(r.alpha) for r in rrows)} (mean "
        f"{fmt(statistics.mean(r.alpha for r in rrows))}), matchness mean {fmt(statistics.mean(m or 0 for m in rmatch))}"
    )
    out = measured(
        text,
        {
            "sets": {
                n: {"plan": p.describe(), "counts": rows[n].counts(), "matchness": match[n]}
                for n, p in sets.items()
            },
            "random": [
                {"plan": p.describe(), "counts": r.counts(), "matchness": m}
                for p, r, m in zip(rand, rrows, rmatch, strict=True)
            ],
        },
    )
    ctx.memo["sd_searched"] = out
    return out


def d_sd_searched(n: dict[str, Any]) -> tuple[str, str]:
    s = {k: v["counts"] for k, v in n["sets"].items()}
    rnd = [r["counts"] for r in n["random"]]
    beats, shown = {}, []
    for other in ("first", "middle", "last"):
        da, ds = diff(alpha, s["searched"], s[other]), diff(speed, s["searched"], s[other])
        beats[other] = above(da) and above(ds)
        shown.append(f"vs {other}: alpha {show(da)}, speedup {show(ds)}")
    da, ds = diff_vs_sets(alpha, s["searched"], rnd), diff_vs_sets(speed, s["searched"], rnd)
    beats["random"] = above(da) and above(ds)
    shown.append(f"vs the {len(rnd)} random sets: alpha {show(da)}, speedup {show(ds)}")
    first_worst = all(above(diff(alpha, s[o], s["first"])) for o in ("middle", "last")) and above(
        diff_vs_sets(alpha, s["first"], rnd, sign=-1)
    )
    last_middle = above(diff(alpha, s["last"], s["middle"]))
    won = [k for k, v in beats.items() if v]
    if len(won) == 4 and first_worst and last_middle:
        v = YES
    elif len(won) >= 2:
        v = PARTLY
    else:
        v = NO
    why = (
        f"the searched set beats {len(won)} of 4 ({', '.join(won) or 'none'}); first is the worst: {first_worst}; "
        f"last beats middle: {last_middle}; " + "; ".join(shown)
    )
    return v, why


# ---- #7 skip count ---------------------------------------------------------------------------


def c_sd_skip_count(ctx: Ctx) -> dict[str, Any]:
    if "sd_skip_count" in ctx.memo:
        return ctx.memo["sd_skip_count"]
    ratios = [0.05, 0.1, 0.2, 0.3, 0.45] if not ctx.smoke else [0.1, 0.2, 0.3]
    plans = {r: uniform_plan(ctx.L, r, keep_first_last=True) for r in ratios}
    swift = build("selector", "swift", skip_ratio=0.45)
    swift.setup(ctx.adapter.arch.info())
    rows = {r: decode(ctx, f"uniform r={r}", static_spec(p), ADAPTIVE) for r, p in plans.items()}
    match = {r: matchness(ctx, p, swift) for r, p in plans.items()}
    text = "uniform sets (first and last block kept), adaptive threshold: " + "; ".join(
        f"{plans[r].num_skipped} of {2 * ctx.L} skipped: alpha {fmt(rows[r].alpha)}, matchness "
        f"{fmt(match[r] or 0)}, modelled {fmt(rows[r].modelled_speedup)}x"
        for r in ratios
    )
    out = measured(
        text,
        {
            "r": {
                str(r): {"counts": rows[r].counts(), "matchness": match[r], "skipped": plans[r].num_skipped}
                for r in ratios
            }
        },
    )
    ctx.memo["sd_skip_count"] = out
    return out


def d_sd_skip_count(n: dict[str, Any]) -> tuple[str, str]:
    rows = {k: v["counts"] for k, v in n["r"].items()}
    keys = sorted(rows, key=float)
    pk = _interior_peak(rows, keys)
    v, why = graded(
        pk["ok"], pk["inner"], f"an interior peak of the modelled speedup (best r = {pk['best']})"
    )
    return v, why + f"; peak - r={keys[0]}: {show(pk['d_first'])}, peak - r={keys[-1]}: {show(pk['d_last'])}"


# ---- #8 skip pattern -------------------------------------------------------------------------


def _structure(plan: LayerPlan) -> dict[str, Any]:
    d = plan.describe()
    L = plan.num_layers
    blocks = d["attn_skip"] + d["mlp_skip"]
    return {
        "attn": len(d["attn_skip"]),
        "mlp": len(d["mlp_skip"]),
        "second_half_count": sum(b >= L // 2 for b in blocks),
        "second_half": sum(b >= L // 2 for b in blocks) / len(blocks) if blocks else 0.0,
        "min_block": min(blocks) if blocks else None,
    }


def c_sd_pattern(ctx: Ctx) -> dict[str, Any]:
    plan, info = selfsd_set(ctx)
    sets = {}
    if info["improved"]:
        sets["Self-SD search"] = plan
    sw = swift_drive(ctx, 0.45, swift_steps(ctx))
    sets[f"SWIFT r=0.45 ({sw['steps']} steps)"] = sw["plan"]
    st = {n: _structure(p) for n, p in sets.items()}
    text = "; ".join(
        f"{n}: {s['attn']} attention vs {s['mlp']} MLP, {s['second_half_count']} of {s['attn'] + s['mlp']} "
        f"({100 * s['second_half']:.0f}%) in blocks >= {ctx.L // 2}, first skipped block {s['min_block']}"
        for n, s in st.items()
    )
    note = (
        ""
        if info["improved"]
        else "the Self-SD search never improved on its first probe (a uniform set), so only SWIFT's set is an optimised one"
    )
    return measured(text, {"sets": st, "plans": {n: p.describe() for n, p in sets.items()}}, note)


def d_sd_pattern(n: dict[str, Any]) -> tuple[str, str]:
    st = n["sets"]
    attn, half, shown = True, True, []
    for name, s in st.items():
        k = s["attn"] + s["mlp"]
        second = s.get("second_half_count", round(s["second_half"] * k))
        wa, wh = stats.wilson(s["attn"], k), stats.wilson(second, k)
        attn &= wa[0] > 0.5
        half &= wh[0] > 0.5
        shown.append(
            f"{name}: attention share {s['attn'] / k:.2f} [{wa[0]:.2f}, {wa[1]:.2f}], second-half share "
            f"{second / k:.2f} [{wh[0]:.2f}, {wh[1]:.2f}]"
        )
    v, why = ternary(
        {
            "more attention than MLP (Wilson CI above 1/2) in every optimised set": attn,
            "mostly in the second half (Wilson CI above 1/2) in every set": half,
        }
    )
    return v, why + "; " + "; ".join(shown)


# ---- #9 BO budget ----------------------------------------------------------------------------


def c_sd_bo_budget(ctx: Ctx) -> dict[str, Any]:
    _, info = selfsd_set(ctx)
    trace = info["data"]["trace"]
    key = "tokens_per_s_model" if info["data"]["objective"]["name"] == "cost_model" else "tokens_per_s_wall"
    best, curve = 0.0, []
    for row in trace:
        best = max(best, row[key])
        curve.append(best)
    n = len(curve)
    at = {f: curve[max(0, int(round(f * n)) - 1)] for f in (0.2, 0.6, 1.0)} if n else {}
    van = info["data"].get("vanilla_tokens_per_s_model")
    text = (
        (
            f"{info['source']}: best modelled tokens/s after 20% / 60% / 100% of {n} candidates: "
            + " / ".join(fmt(at[f], 2) for f in (0.2, 0.6, 1.0))
            + (f" (plain decoding {fmt(van, 2)})" if van else "")
            + (f"; first candidate {fmt(curve[0], 2)}" if n else "")
        )
        if n
        else f"{info['source']}: no candidates"
    )
    return measured(text, {"curve": curve, "candidates": n})


#: The fewest candidates on which sd_bo_budget's shape (20% / 60% of the budget) is read.
MIN_BO_CANDIDATES = 50


def d_sd_bo_budget(n: dict[str, Any]) -> tuple[str, str]:
    curve = n["curve"]
    k = len(curve)
    if k < MIN_BO_CANDIDATES:
        return NOT_TESTABLE, f"{k} candidates, fewer than the {MIN_BO_CANDIDATES} the rule needs"
    at20, at60, final, first = (
        curve[max(0, round(0.2 * k) - 1)],
        curve[max(0, round(0.6 * k) - 1)],
        curve[-1],
        curve[0],
    )
    climbs = final >= 1.01 * first
    if not climbs:
        return NO, f"the best objective never rose 1% above the first candidate ({first:.3f} -> {final:.3f})"
    share20 = (at20 - first) / (final - first)
    v, why = ternary(
        {
            "climbs": True,
            "20% of the budget gives >= half the gain": share20 >= 0.5,
            "plateau after 60%": at60 >= 0.99 * final,
        }
    )
    return v, why + f"; gain at 20%: {100 * share20:.0f}%, best at 60% / final = {at60 / final:.3f}"


CLAIMS: list[Claim] = [
    Claim(
        "sd_fixed_k",
        SD,
        f"{R1} #3",
        "Without an exit threshold, speedup rises then falls over K = 2..8 (peak near K = 4) while AR falls monotonically",
        c_sd_fixed_k,
        rule="over K = 2, 4, 6, 8 with the searched set: (a) AR falls: the point estimates never rise by more than "
        "0.01 from one K to the next and the CI of AR(8) - AR(2) is below 0 (paper: 0.924 -> 0.748); (b) the modelled "
        "speedup peaks inside: the best K is 4 or 6 and the CIs of speedup(best) - speedup(2) and speedup(best) - "
        "speedup(8) are both above 0 (paper: 1.44x at K = 4 vs 1.37x and 1.36x). yes if (a) and (b); partly if one; no if neither",
        decide=d_sd_fixed_k,
    ),
    Claim(
        "sd_threshold",
        SD,
        f"{R1} #4",
        "AR rises monotonically with a static threshold gamma in {0.2..0.8}; speedup peaks at an intermediate gamma (~0.6)",
        c_sd_threshold,
        rule="over gamma = 0.2, 0.4, 0.6, 0.8 (K = 12): (a) AR rises: the point estimates never fall by more than 0.01 "
        "and the CI of AR(0.8) - AR(0.2) is above 0 (paper: 0.749 -> 0.935); (b) the modelled speedup peaks at "
        "gamma 0.4 or 0.6 (point estimate) with the CI of speedup(best) - speedup(0.2) above 0 (paper: 1.58x at 0.6 "
        "vs 1.38x at 0.2 and 1.55x at 0.8). yes if (a) and (b); partly if one; no if neither",
        decide=d_sd_threshold,
    ),
    Claim(
        "sd_adaptive",
        SD,
        f"{R1} #5",
        "The adaptive threshold reaches within 1-2% of the best static gamma; its AR settles near the target",
        c_sd_adaptive,
        rule="(a) the CI of modelled speedup(adaptive) / speedup(best static gamma of sd_threshold) lies above 0.98 "
        "(paper: 1.57x vs 1.58x, within 1-2%); (b) the adaptive run's alpha CI lies within its target +- 0.05 "
        "(paper: 0.919 at target 0.90). yes if (a) and (b); partly if one; no if neither. The flatness over "
        "K = 10..18 is not tested",
        decide=d_sd_adaptive,
    ),
    Claim(
        "sd_searched",
        SD,
        f"{R1} #6",
        "At equal counts, a searched set gives much higher AR and speedup than contiguous first/middle/last or random sets; skipping the first blocks is worst; last beats middle",
        c_sd_searched,
        rule="the searched set 'beats' a set when the CIs of both alpha and modelled-speedup differences are above 0 "
        "(paper: AR 0.919 vs 0.091 / 0.393 / 0.508 / 0.592, speedup 1.57x vs <= 1.01x); random = the mean of "
        "--random-sets random sets of the same counts (sets resampled). yes if it beats first, middle, last and "
        "random, first has the lowest alpha (CIs vs middle, last, random above 0) and last beats middle in alpha "
        "(CI above 0); partly if it beats at least two of the four; no otherwise",
        decide=d_sd_searched,
    ),
    Claim(
        "sd_skip_count",
        SD,
        f"{R1} #7",
        "Speedup vs number of skipped sub-layers is unimodal, peaking near half (r ~ 0.4-0.5 at 7B-70B, lower on small models)",
        c_sd_skip_count,
        rule="uniform sets at r = 0.05, 0.1, 0.2, 0.3, 0.45: yes if the best modelled speedup is at an interior r and "
        "the CIs of speedup(best) minus speedup at the smallest and at the largest r are both above 0; partly if the "
        "best is interior but a CI includes 0; no if the best is the smallest or the largest r (the peak's location "
        "is not required: the paper expects it lower on small models)",
        decide=d_sd_skip_count,
    ),
    Claim(
        "sd_pattern",
        SD,
        f"{R1} #8",
        "Optimised sets skip more attention than MLP, mostly in the second half of the stack",
        c_sd_pattern,
        rule="for every optimised set (the Self-SD search's best if it improved on its first probe; SWIFT's after "
        "its optimisation at r = 0.45): (a) the attention share of its skipped sub-layers has its Wilson 95% CI "
        "above 1/2 (paper: 24 attention + 10 MLP, 0.71 [0.54, 0.83]); (b) the share of its skipped sub-layers in "
        "blocks >= L/2 has its Wilson CI above 1/2 (a set chosen at random gives about 1/2 for both). yes if (a) "
        "and (b); partly if one; no if neither",
        decide=d_sd_pattern,
    ),
    Claim(
        "sd_bo_budget",
        SD,
        f"{R1} #9",
        "Speedup climbs with BO iterations and plateaus after ~600 of 1000; ~20% of the budget gives most of the gain",
        c_sd_bo_budget,
        rule=f"on the search's best-so-far curve of n candidates (not testable if n < {MIN_BO_CANDIDATES}): (a) it "
        "climbs: the final best is >= 1% above the first candidate; (b) the best after 20% of n holds >= 50% of the "
        "final gain over the first candidate (paper: 1.35x at 200 of 1000 vs 1.57x, 61% of the gain over 1.0x); (c) "
        "it plateaus: the best after 60% is within 1% of the final (paper: 1.58x at 600, 1.57x at 1000). yes if all "
        "three; no if (a) fails; partly otherwise (the objective is deterministic given the cost model; one search, "
        "no interval)",
        decide=d_sd_bo_budget,
    ),
]
