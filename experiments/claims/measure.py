"""Measurements several papers' claims share: the searched Self-SD set, SWIFT's matchness and its
optimisation phase driven directly, CLaSp's DP scoring, DEL's shadow tokens and a LayerSkip
replay, and the timed interleaved comparison against vanilla decoding."""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from typing import Any

import numpy as np
import torch

from framework import REGISTRIES, Draft, LayerPlan
from framework.config_fields import build_config
from framework.engine.decoding import SpeculativeDecoder, VanillaDecoder
from framework.engine.state import DecodeState
from framework.results.compare import Method, compare_methods, first_mismatch, warm_up
from strategies.selectors.selfsd_bo import cached_search, load_skip_set, search
from strategies.selectors.static import uniform_plan

from . import stats
from .common import ADAPTIVE, Ctx, build, committed, static_spec


def selfsd_set(ctx: Ctx) -> tuple[LayerPlan, dict[str, Any]]:
    """The searched Self-SD set: ``--skip-set`` or a short `selfsd_bo` search."""
    if "selfsd" in ctx.memo:
        return ctx.memo["selfsd"]
    if ctx.skip_set:
        res = load_skip_set(ctx.skip_set, ctx.L)
        fp = res.data.get("fingerprint")
        if fp and fp != ctx.fingerprint():
            raise SystemExit(f"error: --skip-set {ctx.skip_set} was searched on another model")
        source = f"{ctx.skip_set} ({len(res.data['trace'])} candidates)"
    else:
        entry = REGISTRIES["selector"].entry("selfsd_bo")
        n_it = 3 if ctx.smoke else (10 if ctx.mode == "quick" else 40)
        cfg = build_config(
            entry.config,
            {
                "iterations": n_it,
                "calib_limit": 2,
                "calib_max_new_tokens": 8 if ctx.smoke else 24,
                "cache": not ctx.smoke,  # a re-run of some claims reuses the set (`cache_path`)
            },
        )
        res = cached_search(ctx.prepare_ctx, cfg) or search(ctx.prepare_ctx, cfg)
        cached = " (cached from an earlier run)" if res.data.get("from_cache") else ""
        source = f"a {n_it}-candidate selfsd_bo search run by this script{cached}"
    trace = res.data.get("trace") or []
    key = (
        "tokens_per_s_model"
        if res.data.get("objective", {}).get("name") == "cost_model"
        else "tokens_per_s_wall"
    )
    vals = [row.get(key, 0.0) for row in trace]
    improved = bool(vals) and max(vals) > vals[0]
    ctx.memo["selfsd"] = (res.plan, {"source": source, "data": res.data, "improved": improved})
    return ctx.memo["selfsd"]


def matchness(ctx: Ctx, plan: LayerPlan, swift: Any = None) -> float | None:
    """SWIFT's matchness of ``plan`` (its own `SwiftSelector.matchness`, context window 32, the
    generation's first window) averaged over the prompts whose continuation is long enough."""
    if swift is None:
        swift = build("selector", "swift", skip_ratio=0.45)
        swift.setup(ctx.adapter.arch.info())
    vals = []
    for i in range(len(ctx.ids)):
        state, _ = committed(ctx, i)
        if state.num_new > swift.config.context_window + 1:
            vals.append(swift.matchness(state, plan))
    return statistics.mean(vals) if vals else None


def counts_plan(L: int, attn: list[int], mlp: list[int]) -> LayerPlan:
    return LayerPlan.from_indices(L, attn=attn, mlp=mlp)


def random_plan(L: int, n_attn: int, n_mlp: int, rng: random.Random) -> LayerPlan:
    return counts_plan(L, rng.sample(range(L), n_attn), rng.sample(range(L), n_mlp))


def dp_cosine(state: DecodeState, x: torch.Tensor, pos: int, skip: list[int] | tuple[int, ...]) -> float:
    """cos(full model's last state, the draft's last state) of one token with blocks ``skip`` skipped
    (a teacher-forced forward on the committed cache), as CLaSp's DP scores a set."""
    n = state.info.num_layers
    plan = LayerPlan.from_indices(n, attn=skip, mlp=skip)
    out = state.forward_scratch(pos, plan, end=pos + 1, logits_at=None)
    a, b = out.last_hidden[0, 0].double(), x[n].double()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def dp_positions(ctx: Ctx, per_prompt: int, prompts: int) -> list[tuple[int, DecodeState, torch.Tensor, int]]:
    """(prompt, state, x (L+1, d), position) for evenly spaced generated positions."""
    out = []
    for i in range(min(prompts, len(ctx.ids))):
        state, hs = committed(ctx, i, capture_hidden=True)
        if hs is None:
            continue
        n = hs.shape[1]
        for j in sorted({int(k * (n - 1) / max(1, per_prompt - 1)) for k in range(per_prompt)}):
            out.append((i, state, hs[:, j], state.prompt_len + j))
    return out


def shadow(ctx: Ctx) -> list[dict[str, torch.Tensor]]:
    """DEL's shadow tokens of every layer at every generated position of every prompt: what an
    exit after layer l would predict (`ModelAdapter.top1_from_hidden`), and the full model's token."""
    if "shadow" in ctx.memo:
        return ctx.memo["shadow"]
    out = []
    for i in range(len(ctx.ids)):
        _, hs = committed(ctx, i, capture_hidden=True)
        if hs is None or hs.shape[1] < 2:
            continue
        toks, conf = ctx.adapter.top1_from_hidden(hs[1:])  # (L, n-1): layer l = row l-1
        out.append({"tokens": toks, "conf": conf, "ref": toks[-1], "category": ctx.prompts[i].category})
    ctx.memo["shadow"] = out
    return out


def simulate_ls(match: torch.Tensor, E: int, gamma: int, L: int) -> tuple[int, int, int]:
    """Greedy LayerSkip LS(E, gamma) replayed on shadow-token matches of layer E: a round drafts
    gamma tokens, keeps the run of matches (an accepted draft token's first E blocks equal the full
    model's, so the next shadow token is the draft's), commits run + 1. (tokens, layer loads, rounds)."""
    m = match.tolist()
    n = len(m)
    t = tokens = loads = rounds = 0
    while t < n:
        run = 0
        while run < gamma and t + run < n and m[t + run]:
            run += 1
        step = min(run + 1, n - t)
        tokens += step
        loads += gamma * E + L
        rounds += 1
        t += step
    return tokens, loads, rounds


def _generate(decoders: dict[str, Any], ids: torch.Tensor, stop: Any, name: str) -> Any:
    return decoders[name].generate(ids, stop)


def _decode_pair(ctx: Ctx, decoders: dict[str, Any], name: str, i: int, turn: int) -> dict[str, Any]:
    """Prompt ``i`` by vanilla and by ``name``, back to back in `rotated` order (the driver of
    `framework.results.compare`); ``{label: GenerationResult}``."""
    methods = [Method("vanilla", decoders["vanilla"]), Method(name, decoders[name])]

    def decode(m: Method, i: int) -> list[tuple[Any, str]]:
        return [(m.decoder.generate(ctx.ids[i], ctx.stop()), "")]

    cmp = next(compare_methods(methods, [i], decode, start_turn=turn))
    return {label: turns[0][0] for label, turns in cmp.results.items()}


def timed_compare(ctx: Ctx, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each configuration against vanilla with the `framework.results.compare` protocol (its
    driver, `compare_methods`, decodes each pair): one
    warm-up generation of each, then ``ctx.repeats`` passes over the prompts, each (vanilla,
    configuration) pair decoded back to back in `rotated` order (which one goes first alternates).
    Returns per configuration the ratio of mean tokens/s, the per-prompt tokens/s of both sides
    summed over the repeats (what the verdicts' bootstrap resamples) and every generation's phase
    seconds. A configuration is ``{"selector", "length"}`` and optionally ``"verifier"``."""
    key = "timed:" + json.dumps(configs, sort_keys=True, default=str) + f":{ctx.repeats}"
    if key in ctx.memo:
        return ctx.memo[key]
    decoders: dict[str, Any] = {"vanilla": VanillaDecoder(ctx.adapter)}
    for name, c in configs.items():
        verifier = c.get("verifier", ("greedy", {}))
        d = SpeculativeDecoder(
            ctx.adapter,
            build("selector", c["selector"][0], **c["selector"][1]),
            build("length", c["length"][0], **c["length"][1]),
            build("drafter", "layer_skip"),
            build("verifier", verifier[0], **verifier[1]),
        )
        d.prepare(ctx.prepare_ctx)
        decoders[name] = d
    names = list(configs)
    warm_up(list(decoders), functools.partial(_generate, decoders, ctx.ids[0], ctx.stop(8)))
    n = len(ctx.ids)
    tps = {name: {"vanilla": [0.0] * n, "method": [0.0] * n} for name in names}
    res_all: dict[str, list[tuple[int, Any]]] = {name: [] for name in names}
    turn = 0
    for _ in range(ctx.repeats):
        for i in range(n):
            for name in names:
                turn += 1
                got = _decode_pair(ctx, decoders, name, i, turn)
                tps[name]["vanilla"][i] += got["vanilla"].tokens_per_second
                tps[name]["method"][i] += got[name].tokens_per_second
                res_all[name].append((i, got[name]))
    out = {}
    cost = ctx.cost_model()
    for name, pairs in res_all.items():
        rs = [r for _, r in pairs]
        drafted, accepted = sum(r.drafted for r in rs), sum(r.accepted for r in rs)
        rounds = sum(len(r.accept_lengths) for r in rs)
        plan = LayerPlan.from_code(rs[0].plans[0]) if rs[0].plans else None
        phases = [
            {"prompt": i, "wall": r.wall_time}
            | {k: r.timings.get(k, 0.0) for k in ("prefill", "draft", "verify", "select")}
            for i, r in pairs
        ]
        out[name] = {
            "speedup": sum(tps[name]["method"]) / sum(tps[name]["vanilla"]),
            "tps": tps[name],
            "phases": phases,
            "alpha": accepted / drafted if drafted else 0.0,
            "M": sum(sum(r.accept_lengths) for r in rs) / rounds if rounds else 1.0,
            "skip_ratio": plan.skip_ratio if plan else 0.0,
            "c_measured": cost.draft_step(plan) / cost.step if plan else None,
            "repeats": ctx.repeats,
            "lossless": sum(first_mismatch([r.tokens], [ctx.vanilla(i).tokens]) is None for i, r in pairs),
            "generations": len(pairs),
        }
    ctx.memo[key] = out
    return out


def timed_speedup(r: dict[str, Any]) -> dict[str, float]:
    """A `timed_compare` configuration's speed ratio (mean tokens/s over vanilla's) with its
    bootstrap interval over prompts (each prompt's repeats resampled together)."""
    m, v = np.asarray(r["tps"]["method"]), np.asarray(r["tps"]["vanilla"])
    return stats.bootstrap(lambda i: float(m[i].sum() / v[i].sum()), len(m))


def timed_configs(ctx: Ctx) -> dict[str, dict[str, Any]]:
    """The two configurations `timed_compare` times for the speed claims (sw_expected, both_draft_share)."""
    plan, _ = selfsd_set(ctx)
    return {
        "Self-SD set + adaptive": {"selector": static_spec(plan), "length": ADAPTIVE},
        "uniform 0.2 + confidence 0.6": {
            "selector": static_spec(uniform_plan(ctx.L, 0.2)),
            "length": ("confidence", {"threshold": 0.6}),
        },
    }


def swift_drive(ctx: Ctx, skip_ratio: float, max_steps: int) -> dict[str, Any]:
    """SWIFT's optimisation phase driven directly: `SwiftSelector.observe` after each "round" on a
    state holding a prompt and its vanilla continuation (one optimisation step per call, on the
    generation's first 32-token window, as while decoding), prompt after prompt with the state
    persisting across prompts, until it stops (matchness > 0.95, patience) or ``max_steps``."""
    key = f"swift:{skip_ratio}:{max_steps}"
    if key in ctx.memo:
        return ctx.memo[key]
    sel = build("selector", "swift", skip_ratio=skip_ratio, max_opt_steps=max_steps)
    sel.setup(ctx.adapter.arch.info())
    per_prompt = max(4, max_steps // max(1, len(ctx.ids)))
    best_curve, seconds, prompts_used, first_instance = [], [], 0, 0
    empty = None
    while sel.optimising and sel.steps < max_steps:
        progressed = False
        for i in range(len(ctx.ids)):
            state, _ = committed(ctx, i)
            if state.num_new <= sel.config.context_window + 1:
                continue
            sel.reset()
            prompts_used += 1
            empty = Draft.empty(1, sel.plan(state), state.device)
            for _ in range(per_prompt):
                if not sel.optimising:
                    break
                t0 = time.perf_counter()
                sel.observe(state, empty, None)  # retrigger is off: draft/result are not read
                seconds.append(time.perf_counter() - t0)
                best_curve.append(sel.best)
                progressed = True
                if prompts_used == 1:
                    first_instance += 1
            if not sel.optimising or sel.steps >= max_steps:
                break
        if not progressed:
            break
    s = sel.summary()
    out = {
        "skip_ratio": skip_ratio,
        "steps": sel.steps,
        "stop_reason": sel.stop_reason or "step cap of this run",
        "best_matchness": sel.best,
        "best_curve": [round(b, 4) for b in best_curve],
        "prompts_used": prompts_used,
        "first_instance_steps": first_instance,
        "patience": sel.config.patience,
        "matchness_stop": sel.config.matchness_stop,
        "sec_per_step": statistics.median(seconds) if seconds else None,
        "gp_fits": s["gp_fits_total"],
        "plan": sel.current,
    }
    ctx.memo[key] = out
    return out


def swift_steps(ctx: Ctx) -> int:
    """Optimisation steps SWIFT may take here: 600 in quick mode (the claim's horizon: it stops
    "within about 550 steps"), the paper's 1000 in full mode."""
    return 12 if ctx.smoke else (600 if ctx.mode == "quick" else 1000)
