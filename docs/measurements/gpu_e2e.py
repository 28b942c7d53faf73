"""End-to-end self-speculative decoding at a controlled acceptance, on a random model of real shape.

`gpu_costs.py` prices drafts and verifications and *predicts* speedups at the papers' acceptance,
because a randomly initialised model accepts nothing: its skipped sub-layers matter as much as any
other. This script makes a random model *redundant where the draft skips*: the output projections
of the sub-layers a uniform skip plan leaves out are scaled by ``--scale`` (attention ``o_proj``,
MLP ``down_proj``), so those sub-layers add little to the residual stream and a draft that skips
them usually predicts the full model's token. The acceptance then follows from ``--scale``, and
the whole decode loop can be timed against plain decoding of the *same* model.

This is a synthetic testbed, not a language model. It measures the engine (drafting, verification,
commits, the cost model's accuracy) end to end, at an acceptance one can set. It says nothing about
which layers of a trained model are redundant. Every speculative output is compared with plain
greedy decoding of the same model, and the decodes that differ are counted (in bfloat16 a
verification and a plain step may round differently, so near-tie flips can occur:
docs/performance.md).

For each of eager and CUDA graphs (``--graphs both``), interleaved, medians:

- plain decoding (`VanillaDecoder`) and speculative decoding with the static plan and a fixed draft
  length ``--k`` (greedy verification), tokens/s;
- the measured speedup, alpha (accepted / drafted) and M (tokens per round);
- the speedup the cost model predicts at the measured M (``M x step / round_time(k)``), so that
  model and measurement can be compared.

    python docs/measurements/gpu_e2e.py --shape llama2-7b --skip-ratio 0.45 --scale 0.05 --k 4
    python docs/measurements/gpu_e2e.py --shape tiny --device cpu --dtype float32 --new-tokens 24 --reps 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_costs import SHAPES, build, timed  # noqa: E402

from framework.engine.adapter import adapter_for  # noqa: E402
from framework.engine.cost_model import CostModel  # noqa: E402
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder  # noqa: E402
from framework.results.compare import first_mismatch  # noqa: E402
from strategies.drafters.layer_skip import LayerSkipDrafter  # noqa: E402
from strategies.length.fixed import FixedLength, FixedLengthConfig  # noqa: E402
from strategies.selectors.static import StaticSelector, StaticSelectorConfig, uniform_plan  # noqa: E402
from strategies.verifiers.greedy import GreedyVerifier  # noqa: E402


def make_redundant(model: torch.nn.Module, plan, scale: float) -> int:
    """Scale the output projection of every sub-layer ``plan`` skips by ``scale``; returns how many
    sub-layers were scaled. Llama-family layout (``self_attn.o_proj``, ``mlp.down_proj``)."""
    scaled = 0
    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            if not plan.runs_attn(i):
                block.self_attn.o_proj.weight.mul_(scale)
                scaled += 1
            if not plan.runs_mlp(i):
                block.mlp.down_proj.weight.mul_(scale)
                scaled += 1
    return scaled


def run(adapter, plan, args, prompts: list[torch.Tensor]) -> dict:
    """Interleaved plain and speculative decoding of ``prompts``; medians over ``args.reps``."""
    dev = adapter.device
    stop = StopCondition(args.new_tokens)
    vanilla = VanillaDecoder(adapter)
    spec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=args.skip_ratio)),
        FixedLength(FixedLengthConfig(k=args.k)),
        LayerSkipDrafter(),
        GreedyVerifier(),
    )
    for p in prompts[:1]:  # warm-up (and the graphs' captures)
        vanilla.generate(p, stop)
        spec.generate(p, stop)
    walls = {"vanilla": [], "spec": []}
    drafted = accepted = rounds = tokens = 0
    differ = 0
    for _ in range(args.reps):
        for p in prompts:
            box: dict = {}
            walls["vanilla"].append(timed(dev, lambda p=p, box=box: box.update(v=vanilla.generate(p, stop))))
            walls["spec"].append(timed(dev, lambda p=p, box=box: box.update(s=spec.generate(p, stop))))
            v, s = box["v"], box["s"]
            drafted += s.drafted
            accepted += s.accepted
            rounds += len(s.accept_lengths)
            tokens += len(s.tokens)
            differ += first_mismatch([s.tokens], [v.tokens]) is not None
    per = len(prompts)
    # tokens/s of each prompt set: the sum of one repetition's walls, median over repetitions
    sums = {k: [sum(v[r * per : (r + 1) * per]) for r in range(args.reps)] for k, v in walls.items()}
    van, sp = statistics.median(sums["vanilla"]), statistics.median(sums["spec"])
    m = tokens / max(1, rounds)
    cost = CostModel.measure(adapter, max_tokens=max(2, args.k + 1), context=128, reps=3)
    return {
        "vanilla_tok_s": per * args.new_tokens / van,
        "spec_tok_s": per * args.new_tokens / sp,
        "speedup": van / sp,
        "alpha": accepted / max(1, drafted),
        "M": m,
        "predicted_at_M": m * cost.step / cost.round_time(args.k, plan),
        "draft_cost": cost.draft_step(plan) / cost.step,
        "verify_cost": cost.verify(args.k + 1) / cost.step,
        "differ": differ,
        "decodes": args.reps * per,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-ratio", type=float, default=0.45, help="uniform plan of the draft")
    ap.add_argument(
        "--scale", type=float, default=0.05, help="factor on the skipped sub-layers' output projections"
    )
    ap.add_argument("--k", type=int, default=4, help="tokens drafted every round")
    ap.add_argument("--prompts", type=int, default=4, help="random 64-token prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--graphs", choices=["off", "on", "both"], default="both")
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build(args.shape, getattr(torch, args.dtype), args.device)
    adapter = adapter_for(model, fast_kernels=False)
    plan = uniform_plan(adapter.num_layers, args.skip_ratio)
    scaled = make_redundant(model, plan, args.scale)
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (1, 64), generator=gen).to(args.device) for _ in range(args.prompts)]
    env = {
        "shape": args.shape,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "skip_ratio": plan.skip_ratio,
        "scaled_sub_layers": scaled,
        "scale": args.scale,
        "k": args.k,
    }
    print(f"# {json.dumps(env)}\n")
    out: dict = {"env": env}
    print(
        "| mode | plain tok/s | speculative tok/s | speedup | predicted at M | alpha | M | draft cost | "
        "verify k+1 | differ |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for label in {"off": ["eager"], "on": ["graphs"], "both": ["eager", "graphs"]}[args.graphs]:
        adapter.set_cuda_graphs(label == "graphs")
        r = out[label] = run(adapter, plan, args, prompts)
        print(
            f"| {label} | {r['vanilla_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | "
            f"{r['predicted_at_M']:.2f}x | {r['alpha']:.3f} | {r['M']:.2f} | {r['draft_cost']:.3f} | "
            f"{r['verify_cost']:.3f} | {r['differ']}/{r['decodes']} |"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
