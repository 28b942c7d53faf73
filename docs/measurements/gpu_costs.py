"""What self-speculation costs on a GPU, on randomly initialised models of real shapes (issue 17).

Weights do not change the cost of a step, so a random Llama-2-7B or 13B in bfloat16 prices drafts
and verifications as the real one would; nothing is downloaded. The script measures, through the
framework's own adapter and decode loop:

1. tokens/s at batch 1, greedy: our `VanillaDecoder` against Hugging Face ``generate`` (eager,
   dynamic cache; with ``--hf-compile`` also ``cache_implementation="static"`` + ``torch.compile``),
   interleaved, medians; and the engine's overhead per step (a step of our loop minus one forward);
2. the cost model on the device (`CostModel.measure`, synchronised): a draft step against the skip
   ratio and the exit layer, a verification of T = 1..16 tokens and of token trees up to 60 nodes;
3. the speedup the cost model predicts for Self-SD and SWIFT at the acceptance the papers report
   for LLaMA-2-13B (``../shared/reference``), next to the papers' measured speedups;
4. one speculative decode with every phase timed (``phase_timing=True``) and its device reads per
   round (`framework.testing.syncs.count_host_reads`);
5. the issue's targets, each said met or not.

Randomly initialised models emit meaningless tokens; only costs are measured here (acceptance comes
from the papers). It runs unchanged on any CUDA machine; ``--shape tiny --device cpu`` is a smoke
run of every code path.

    python docs/measurements/gpu_costs.py --shape llama2-7b [--dtype bfloat16] [--json out.json]
    python docs/measurements/gpu_costs.py --shape llama2-13b --hf-compile
    python docs/measurements/gpu_costs.py --shape tiny --device cpu --dtype float32 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from framework.engine.adapter import adapter_for
from framework.engine.cost_model import CostModel
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.testing.syncs import count_host_reads
from framework.types import LayerPlan
from framework.utils import device_sync
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig, uniform_plan
from strategies.verifiers.greedy import GreedyVerifier

SHAPES = {
    "llama2-7b": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32
    ),
    "llama2-13b": dict(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40
    ),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4),
}
#: What the papers report on LLaMA-2-13B (../shared/reference/seeds-selfsd-swift.md): Self-SD's BO
#: set skips 24 attention + 10 MLP of 80 sub-layers, AR 0.919 with the adaptive threshold (K <= 12),
#: 1.57x (CNN/DM, greedy, Table 1); SWIFT skips r = 0.45 of the sub-layers on the fly, M 4.34 at
#: its alpha 0.99 (accepted per draft step), 1.37x (Table 2, CNN/DM).
PAPERS = {
    "selfsd": {"attn": 24 / 40, "mlp": 10 / 40, "alpha": 0.919, "max_k": 12, "paper": 1.57},
    "swift": {"ratio": 0.45, "M": 4.34, "alpha": 0.99, "paper": 1.37},
}


def build(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A randomly initialised Llama of ``shape`` built straight on ``device`` in ``dtype`` (no
    float32 copy, no host staging)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **SHAPES[shape],
        num_key_value_heads=SHAPES[shape]["num_attention_heads"],
        vocab_size=128 if shape == "tiny" else 32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    for name, mod in list(model.named_modules()):  # rotary tables are computed at init: rebuild
        if hasattr(mod, "inv_freq"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, type(mod)(mod.config).to(device))
    return model.eval()


def timed(device, fn) -> float:
    device_sync(device)
    t = time.perf_counter()
    fn()
    device_sync(device)
    return time.perf_counter() - t


def speed(model, adapter, new_tokens: int, reps: int, hf_compile: bool) -> dict:
    """tokens/s of our loop and of HF generate (interleaved, medians) and our overhead per step."""
    dev = adapter.device
    prompt = torch.randint(
        0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1)
    ).to(dev)
    stop = StopCondition(new_tokens)
    ours = VanillaDecoder(adapter)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def hf(**kw):
        return lambda: model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw
        )

    cases = {"ours": lambda: ours.generate(prompt, stop), "hf_eager": hf()}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(reps):
        for k, fn in cases.items():
            times[k].append(timed(dev, fn))
    out = {k: new_tokens / statistics.median(v) for k, v in times.items()}
    if hf_compile:
        model.generation_config.cache_implementation = "static"
        eager = model.forward
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        try:
            fn = hf()
            fn()
            fn()  # compile and capture
            out["hf_static_compile"] = new_tokens / statistics.median(timed(dev, fn) for _ in range(reps))
        finally:
            model.forward = eager
            model.generation_config.cache_implementation = None
    res = ours.generate(prompt, stop)
    per_step = (res.wall_time - res.timings["prefill"]) / max(1, len(res.tokens) - 1)
    out["ours_seconds_per_step"] = per_step
    return out


def tree_costs(adapter, sizes: list[int], reps: int) -> dict[int, float]:
    """Seconds of a verification over T tokens (logits at every position) after a 128-token context."""
    info = adapter.info()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, info.vocab_size, (1, 128), generator=gen).to(adapter.device)
    state = DecodeState(adapter, prompt, 128 + max(sizes) + 8)
    state.append(state.prefill().argmax(-1)[:, None])
    out: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in range(reps + 1):
        for t in sizes:
            block = torch.randint(0, info.vocab_size, (1, t), generator=gen).to(adapter.device)

            def verify(block=block):
                state.forward_verify(block, logits_at="all")
                state.discard_draft()

            out[t].append(timed(adapter.device, verify))
    return {t: statistics.median(v[1:]) for t, v in out.items()}


def spread(count: int, n: int) -> list[int]:
    return sorted({min(n - 1, int((i + 0.5) * n / count)) for i in range(count)}) if count else []


def predictions(cost: CostModel) -> dict[str, dict]:
    n = cost.num_layers
    sd = PAPERS["selfsd"]
    plan = LayerPlan.from_indices(
        n, attn=spread(round(sd["attn"] * n), n), mlp=spread(round(sd["mlp"] * n), n)
    )
    sd_pred, sd_k = cost.ceiling(sd["alpha"], plan, max_k=sd["max_k"])
    sw = PAPERS["swift"]
    sw_plan = uniform_plan(n, sw["ratio"])
    k_bar = (sw["M"] - 1) / sw["alpha"]  # draft steps per round behind M at SWIFT's alpha
    sw_time = k_bar * cost.draft_step(sw_plan) + cost.verify_at(k_bar + 1)
    return {
        "selfsd": {
            "skip_ratio": plan.skip_ratio,
            "draft_cost": cost.draft_step(plan) / cost.step,
            "alpha": sd["alpha"],
            "best_k": sd_k,
            "predicted": sd_pred,
            "paper": sd["paper"],
        },
        "swift": {
            "skip_ratio": sw_plan.skip_ratio,
            "draft_cost": cost.draft_step(sw_plan) / cost.step,
            "M": sw["M"],
            "predicted": sw["M"] * cost.step / sw_time,
            "paper": sw["paper"],
        },
    }


def phases(adapter, new_tokens: int) -> dict:
    """One speculative decode (uniform 45% skip set, 4 tokens a round) with every phase timed."""
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.45)),
        FixedLength(FixedLengthConfig(k=4)),
        LayerSkipDrafter(),
        GreedyVerifier(),
        phase_timing=True,
    )
    prompt = torch.randint(0, adapter.info().vocab_size, (1, 64), generator=torch.Generator().manual_seed(3))
    prompt = prompt.to(adapter.device)
    dec.generate(prompt, StopCondition(8))  # warm-up
    only = "cuda" if adapter.device.type == "cuda" else None
    with count_host_reads(only) as reads:
        res = dec.generate(prompt, StopCondition(new_tokens))
    rounds = max(1, len(res.accept_lengths))
    shares = {k: v / res.wall_time for k, v in res.timings.items()}
    return {
        "wall": res.wall_time,
        "shares": shares,
        "reads_per_round": reads.total / rounds,
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--hf-compile", action="store_true", help="also HF generate with a static cache + compile"
    )
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = build(args.shape, dtype, args.device)
    adapter = adapter_for(model)
    n = adapter.num_layers
    env = {
        "shape": args.shape,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else (platform.processor() or "cpu"),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"# {json.dumps(env)}\n")

    sp = speed(model, adapter, args.new_tokens, args.reps, args.hf_compile)
    cost = CostModel.measure(adapter, max_tokens=16, context=128, reps=max(3, args.reps))
    overhead = sp["ours_seconds_per_step"] - cost.step
    print("## Plain decoding, batch 1 (tokens/s, medians)\n")
    print("| decoder | tokens/s | vs HF eager |\n|---|---:|---:|")
    for k in ("hf_eager", "hf_static_compile", "ours"):
        if k in sp:
            print(f"| {k} | {sp[k]:.1f} | {sp[k] / sp['hf_eager']:.2f}x |")
    print(
        f"\nOne step: {1e3 * cost.step:.2f} ms (a forward); our loop's step: {1e3 * sp['ours_seconds_per_step']:.2f} ms; "
        f"engine overhead {1e3 * overhead:.2f} ms = {100 * overhead / cost.step:.1f}% of a step\n"
    )

    print("## Draft cost (in plain steps)\n")
    print("| plan | skipped sub-layers | cost |\n|---|---:|---:|")
    for r in (0.0, 0.1, 0.2, 0.3, 0.45, 0.5, 0.6):
        plan = uniform_plan(n, r)
        print(f"| uniform {r:.2f} | {plan.skip_ratio:.3f} | {cost.draft_step(plan) / cost.step:.3f} |")
    for frac in (0.25, 0.5, 0.75):
        e = max(1, round(frac * n))
        plan = LayerPlan.from_indices(n, exit_layer=e)
        print(f"| exit after block {e} of {n} | {1 - e / n:.3f} | {cost.draft_step(plan) / cost.step:.3f} |")
    trees = tree_costs(adapter, [24, 32, 48, 60], max(3, args.reps))
    print("\n## Verification cost (a forward over T tokens, in plain steps)\n")
    print("| T | cost |\n|---:|---:|")
    for t in range(1, 17):
        print(f"| {t} | {cost.verify(t) / cost.step:.3f} |")
    for t, s in trees.items():
        print(f"| {t} (tree size) | {s / cost.step:.3f} |")

    pred = predictions(cost)
    print("\n## Predicted speedup at the papers' acceptance (LLaMA-2-13B numbers)\n")
    print(
        "| method | skip ratio | draft cost | acceptance | predicted | paper |\n|---|---:|---:|---|---:|---:|"
    )
    sd, sw = pred["selfsd"], pred["swift"]
    print(
        f"| selfsd | {sd['skip_ratio']:.3f} | {sd['draft_cost']:.3f} | alpha {sd['alpha']} (best K {sd['best_k']}) "
        f"| {sd['predicted']:.2f}x | {sd['paper']:.2f}x |"
    )
    print(
        f"| swift | {sw['skip_ratio']:.3f} | {sw['draft_cost']:.3f} | M {sw['M']} | {sw['predicted']:.2f}x "
        f"| {sw['paper']:.2f}x |"
    )

    ph = phases(adapter, args.new_tokens)
    print("\n## One speculative decode, every phase timed (uniform 45%, K = 4)\n")
    print("| phase | share of wall time |\n|---|---:|")
    for k, v in sorted(ph["shares"].items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {100 * v:.1f}% |")
    print(f"\n{ph['reads_per_round']:.2f} device reads per round over {ph['rounds']} rounds\n")

    # 45% of all 2L sub-layers (uniform_plan's ratio counts the 2(L-2) eligible ones)
    p45 = uniform_plan(n, min(0.99, 0.45 * n / max(1, n - 2)))
    d45 = cost.draft_step(p45) / cost.step
    v8 = cost.verify(8) / cost.step
    checks = [
        ("our vanilla >= HF eager generate (tokens/s)", sp["ours"] >= sp["hf_eager"]),
        ("engine overhead <= 10% of a step", overhead <= 0.10 * cost.step),
        (
            f"a draft skipping {100 * p45.skip_ratio:.0f}% of sub-layers <= 0.6 of a step ({d45:.3f})",
            d45 <= 0.6,
        ),
        (f"verifying 8 tokens <= 1.15 steps ({v8:.3f})", v8 <= 1.15),
        (f"predicted selfsd >= 1.3x ({sd['predicted']:.2f}x)", sd["predicted"] >= 1.3),
        (f"predicted swift >= 1.3x ({sw['predicted']:.2f}x)", sw["predicted"] >= 1.3),
    ]
    print("## Targets (issue 17)\n")
    for text, ok in checks:
        print(f"- {text}: {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "env": env,
                    "speed": sp,
                    "cost_model": cost.to_dict(),
                    "trees": trees,
                    "predictions": pred,
                    "phases": ph,
                    "checks": dict(checks),
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
