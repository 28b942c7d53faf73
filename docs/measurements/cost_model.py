"""The measured cost model of a model on this machine, as markdown tables (docs/performance.md).

Measures, through the framework's own adapter and KV cache (the engine every strategy runs on):

1. a full forward over T = 1..16 new tokens, relative to one decoding step, at several cache
   lengths (the price of a verification of T - 1 draft tokens);
2. the parts of a step: embedding + final norm + LM head (``base``), one attention sub-layer, one
   MLP sub-layer (the `framework.engine.cost_model.CostModel` fit), and the LM head alone;
3. a draft step for uniform skip sets of increasing size, measured and as the fit predicts it;
4. the ceiling: the best speedup any drafter could reach (best draft length, chain model of
   Leviathan et al.) for a given acceptance rate alpha and draft cost, from the measured costs.

Every case is interleaved with the others and repeated; medians are reported, so slow drift on a
shared machine hits all cases alike.

    python docs/measurements/cost_model.py [--threads 2] [--reps 9] [--contexts 64,512,1024] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from framework import LayerPlan
from framework.engine.adapter import adapter_for
from framework.engine.cost_model import CostModel
from framework.models.loading import load_model
from strategies.selectors.static import uniform_plan


def forward_costs(adapter, contexts: list[int], max_t: int, reps: int) -> dict[int, list[float]]:
    """``{context: [median seconds of a full forward over T new tokens, T = 1..max_t]}``."""
    vocab = adapter.arch.info().vocab_size
    gen = torch.Generator().manual_seed(0)
    top = max(contexts)
    ids = torch.randint(0, vocab, (1, top + max_t), generator=gen)
    cache = adapter.new_cache(top + max_t + 8)
    adapter.forward(ids[:, :top], torch.arange(top)[None], cache, logits_at="last")
    cache.commit(top)
    samples: dict[tuple[int, int], list[float]] = {(c, t): [] for c in contexts for t in range(1, max_t + 1)}
    for rep in range(reps + 1):
        for c in contexts:
            for t in range(1, max_t + 1):
                # base=c, visible=c: the new tokens attend to the first c cached positions only.
                start = time.perf_counter()
                adapter.forward(
                    ids[:, c : c + t],
                    torch.arange(c, c + t)[None],
                    cache,
                    logits_at="all",
                    base=c,
                    visible=c,
                    persist=False,
                )
                if rep:
                    samples[(c, t)].append(time.perf_counter() - start)
    return {c: [statistics.median(samples[(c, t)]) for t in range(1, max_t + 1)] for c in contexts}


def lm_head_cost(adapter, reps: int) -> float:
    h = torch.randn(1, 1, adapter.arch.info().hidden_size, dtype=adapter.arch.dtype)
    times = []
    with torch.inference_mode():
        for rep in range(reps * 5 + 1):
            start = time.perf_counter()
            adapter.arch.lm_head(adapter.arch.final_norm(h))
            if rep:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def draft_costs(adapter, ratios: list[float], context: int, reps: int) -> dict[float, float]:
    """Median seconds of one draft token through a uniform skip set of each ratio."""
    n = adapter.arch.num_layers
    plans = {r: (LayerPlan.full(n) if r == 0 else uniform_plan(n, r)) for r in ratios}
    vocab = adapter.arch.info().vocab_size
    ids = torch.randint(0, vocab, (1, context + 1), generator=torch.Generator().manual_seed(1))
    cache = adapter.new_cache(context + 8)
    adapter.forward(ids[:, :context], torch.arange(context)[None], cache, logits_at="last")
    cache.commit(context)
    samples: dict[float, list[float]] = {r: [] for r in ratios}
    for rep in range(reps * 3 + 1):
        for r, plan in plans.items():
            start = time.perf_counter()
            adapter.forward(
                ids[:, context:],
                torch.tensor([[context]]),
                cache,
                plan,
                logits_at="last",
                base=context,
                persist=False,
            )
            if rep:
                samples[r].append(time.perf_counter() - start)
    return {r: statistics.median(v) for r, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="HF directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--contexts", default="64,512,1024", help="cache lengths for the forward-cost table")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", default=None, help="also write the raw numbers and the CostModel here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, "float32", "cpu")
    adapter = adapter_for(model)
    contexts = [int(c) for c in args.contexts.split(",")]

    cm = CostModel.measure(adapter, max_tokens=args.max_tokens, context=128, reps=args.reps)
    fwd = forward_costs(adapter, contexts, args.max_tokens, args.reps)
    head = lm_head_cost(adapter, args.reps)
    ratios = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    drafts = draft_costs(adapter, ratios, 128, args.reps)
    step = cm.step
    ms = 1e3

    print(
        f"Model {adapter.arch.info().name or 'default'} ({adapter.arch.num_layers} blocks), fp32, {args.threads} thread(s), "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}; medians of {args.reps} "
        "interleaved repetitions.\n"
    )
    print("**Parts of one decoding step** (cache of 128 tokens):\n")
    print("| part | ms | share of a step |\n|---|---:|---:|")
    print(f"| full step (T = 1) | {step * ms:.2f} | 100% |")
    print(f"| base: embedding + final norm + LM head | {cm.base * ms:.2f} | {100 * cm.base / step:.1f}% |")
    print(f"| LM head + final norm alone | {head * ms:.2f} | {100 * head / step:.1f}% |")
    print(f"| one attention sub-layer | {cm.attn * ms:.3f} | {100 * cm.attn / step:.2f}% |")
    print(f"| one MLP sub-layer | {cm.mlp * ms:.3f} | {100 * cm.mlp / step:.2f}% |")
    print(
        f"| all {adapter.arch.num_layers} blocks | {(cm.attn + cm.mlp) * adapter.arch.num_layers * ms:.2f} | "
        f"{100 * (cm.attn + cm.mlp) * adapter.arch.num_layers / step:.1f}% |\n"
    )

    print(
        "**A full forward over T new tokens**, in single steps at the same cache length (a "
        "verification of T - 1 draft tokens):\n"
    )
    head_row = "| T | " + " | ".join(f"cache {c}" for c in contexts) + " |"
    print(head_row + "\n|---:|" + "---:|" * len(contexts))
    for t in range(1, args.max_tokens + 1):
        print(f"| {t} | " + " | ".join(f"{fwd[c][t - 1] / fwd[c][0]:.2f}" for c in contexts) + " |")
    print("\n(one step: " + ", ".join(f"{fwd[c][0] * ms:.1f} ms at cache {c}" for c in contexts) + ")\n")

    n = adapter.arch.num_layers
    print("**A draft step vs its skip set** (uniform sets over blocks 1..L-2, cache 128):\n")
    print(
        "| skip ratio | sub-layers skipped | measured, steps | CostModel fit, steps |\n|---:|---:|---:|---:|"
    )
    for r in ratios:
        plan = LayerPlan.full(n) if r == 0 else uniform_plan(n, r)
        skipped = sum(plan.attn_skip) + sum(plan.mlp_skip)
        print(f"| {r:.1f} | {skipped} | {drafts[r] / step:.3f} | {cm.draft_step(plan) / step:.3f} |")

    print(
        "\n**The ceiling**: the best speedup over plain decoding that drafting k tokens per round "
        "can reach (best k in 0..16, chain model) for acceptance rate alpha and a draft step costing c "
        "steps, with this machine's measured verification costs. 1.00 = drafting never pays.\n"
    )
    costs = [0.1, 0.3, 0.5, 0.7, 0.85]
    alphas = [0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
    print("| alpha | " + " | ".join(f"c = {c}" for c in costs) + " |\n|---:|" + "---:|" * len(costs))
    for a in alphas:
        cells = []
        for c in costs:
            synth = CostModel(n, base=c * step, attn=0.0, mlp=0.0, verify_costs=cm.verify_costs)
            best, k = synth.ceiling(a, LayerPlan.full(n))
            cells.append(f"{best:.2f} (k={k})")
        print(f"| {a:.2f} | " + " | ".join(cells) + " |")
    print(f"\nCostModel: {cm.describe()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "cost_model": cm.to_dict(),
                    "forward": fwd,
                    "lm_head": head,
                    "draft": drafts,
                    "threads": args.threads,
                },
                fh,
                indent=2,
            )


if __name__ == "__main__":
    main()
