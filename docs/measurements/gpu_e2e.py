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

With ``--trace FILE`` (repeatable) the acceptance is not synthetic but *recorded*: every round of
a real run on a real model (`record_traces.py`: SmolLM2-135M and Qwen2.5-Coder-0.5B on the CPU,
in ``traces/``) is replayed on the random model of ``--shape``: the same draft length, a uniform
plan skipping the same share of the sub-layers, and, after the real verification forward, the
recorded number of accepted drafts committed. Each recorded decode is replayed on a random prompt
for as many tokens as it committed, against plain decoding of those tokens, interleaved. The
table gives the measured speedup next to the cost model's prediction for exactly the rounds
replayed, the replayed and recorded alpha and M (equal up to the rounds a smaller budget cuts),
and the graphs recorded inside timed decodes (0: every graph was recorded before timing). The
replay prices drafting and verification; a selector's own work (CLaSp's DP, SWIFT's search) is
not replayed, and a tree's extra verified tokens are not either (trace chain methods).

    python docs/measurements/gpu_e2e.py --shape llama2-7b --skip-ratio 0.45 --scale 0.05 --k 4
    python docs/measurements/gpu_e2e.py --shape llama2-7b --graphs on --reps 1 \
        --trace docs/measurements/traces/smollm2-135m.json
    python docs/measurements/gpu_e2e.py --shape tiny --device cpu --dtype float32 --new-tokens 24 --reps 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_costs import SHAPES, build, timed  # noqa: E402

from framework import (  # noqa: E402
    Draft,
    LayerPlan,
    LayerSelector,
    LengthController,
    LengthHint,
    RoundView,
    Verification,
    VerifyView,
)
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


@dataclass
class Trace:
    """One method's recorded rounds (`record_traces.py`), replayed decode by decode: `start`
    points the cursor at a recorded decode (a turn), the selector of each round calls `advance`
    (which sets ``current``: the round's drafted and committed counts), the length controller and
    the verifier read ``current``. ``plans`` are uniform plans of this model at the trace's skip
    ratios (the trace records how much its drafts skipped, not which layers of another model)."""

    name: str
    drafted: list[int]
    committed: list[int]
    plan: list[int]
    turns: list[int]
    plans: list[LayerPlan]
    full: LayerPlan
    cursor: int = 0
    current: tuple[int, int] = (0, 1)

    @classmethod
    def load(cls, entry: dict, name: str, num_layers: int) -> Trace:
        plans = [uniform_plan(num_layers, r, keep_first_last=False) for r in entry["skip_ratios"]]
        full = LayerPlan.full(num_layers)
        return cls(name, entry["drafted"], entry["committed"], entry["plan"], entry["turns"], plans, full)

    def start(self, turn: int) -> int:
        """Point at the first round of recorded decode ``turn``; returns the tokens it committed."""
        self.cursor = sum(self.turns[:turn])
        return sum(self.committed[self.cursor : self.cursor + self.turns[turn]])

    def advance(self) -> LayerPlan:
        """The next round: sets ``current`` to its (drafted, committed) and returns its plan. Past
        the decode's last round (the replay ran out of budget differently): a plain step."""
        i = self.cursor
        self.cursor += 1
        if i >= len(self.drafted):
            self.current = (0, 1)
            return self.full
        self.current = (self.drafted[i], self.committed[i])
        return self.plans[self.plan[i]] if self.plan[i] >= 0 else self.full


@dataclass(frozen=True)
class TraceConfig:
    trace: Trace


class TraceSelector(LayerSelector):
    """The plan of the trace's next round (a uniform plan at its recorded skip ratio)."""

    Config = TraceConfig

    def plan(self, state: RoundView) -> LayerPlan:
        return self.config.trace.advance()


class TraceLength(LengthController):
    """Exactly the trace's draft length for the round (0: a plain step, as the round declined)."""

    Config = TraceConfig
    exact_length = True

    def max_draft_length(self) -> int | None:
        return max(self.config.trace.drafted)

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        return self.config.trace.current[0]


class ReplayVerifier(GreedyVerifier):
    """Runs the real verification forward (its cost is what is measured), then commits the
    trace's accepted length instead of the argmax match: the drafts the trace accepted and the
    target's token after them. The text is not the model's greedy output (a random model
    accepts nothing on its own); the costs are a real round's."""

    Config = TraceConfig

    def verify(self, state: VerifyView, draft: Draft) -> Verification:
        block = torch.cat([state.pending, draft.tokens], dim=1)
        out = state.forward_verify(block, logits_at="all")
        target = out.logits.argmax(dim=-1)
        k = min(self.config.trace.current[1] - 1, draft.tokens.shape[1])
        new = torch.cat([draft.tokens[:, :k], target[:, k : k + 1]], dim=1)
        return Verification(
            num_accepted=torch.full((block.shape[0],), k, dtype=torch.long, device=block.device),
            new_tokens=new,
            target_tokens=target,
            hidden_states=out.hidden_states,
        )


def replay(adapter, trace: Trace, args, prompts: list[torch.Tensor]) -> dict:
    """Plain decoding against the replay of ``trace``'s first ``--trace-turns`` decodes (each on
    a random prompt, for as many tokens as it committed), interleaved, medians over ``args.reps``;
    the cost model's prediction for exactly the rounds replayed in the timed decodes."""
    dev = adapter.arch.device
    vanilla = VanillaDecoder(adapter)
    cfg = TraceConfig(trace)
    spec = SpeculativeDecoder(
        adapter, TraceSelector(cfg), TraceLength(cfg), LayerSkipDrafter(), ReplayVerifier(cfg)
    )
    turns = range(min(len(trace.turns), args.trace_turns or len(trace.turns)))
    budgets = [trace.start(t) for t in turns]
    capacity = prompts[0].shape[1] + max(budgets) + spec.max_draft + 8
    adapter.executor.prepare_graphs(capacity)  # the pool first
    trace.start(0)  # warm-up: the engine sees the forwards the method runs
    vanilla.generate(prompts[0], StopCondition(budgets[0]))
    spec.generate(prompts[0], StopCondition(budgets[0]))
    sizes = spec.graph_sizes(adapter.executor.seen)
    adapter.executor.prepare_graphs(capacity, chain=sizes.chain, tree=sizes.tree, mlp=sizes.scratch)
    walls: dict[str, list[float]] = {"vanilla": [], "spec": []}
    rounds = []
    captures = 0
    for _ in range(args.reps):
        for t in turns:
            p, stop, box = prompts[t % len(prompts)], StopCondition(budgets[t]), {}

            def plain(p=p, stop=stop, box=box) -> None:
                box["v"] = vanilla.generate(p, stop)

            def speculative(p=p, stop=stop, box=box) -> None:
                box["s"] = spec.generate(p, stop)

            walls["vanilla"].append(timed(dev, plain))
            trace.start(t)
            walls["spec"].append(timed(dev, speculative))
            rounds += box["s"].rounds
            captures += box["v"].graph_captures + box["s"].graph_captures
    per = len(turns)
    sums = {k: [sum(v[r * per : (r + 1) * per]) for r in range(args.reps)] for k, v in walls.items()}
    van, sp = statistics.median(sums["vanilla"]), statistics.median(sums["spec"])
    k_max = max(r.drafted for r in rounds)
    cost = CostModel.measure(
        adapter, max_tokens=k_max + 1, context=prompts[0].shape[1] + max(budgets) // 2, reps=3
    )
    plans = {p.code(): p for p in trace.plans}
    unpriced = sum(1 for r in rounds if r.drafted and r.plan not in plans)
    if unpriced:
        raise RuntimeError(f"{unpriced} replayed rounds drafted with a plan the trace did not set")
    modelled = sum(cost.round_time(r.drafted, plans[r.plan] if r.drafted else trace.full) for r in rounds)
    committed = sum(r.committed for r in rounds)
    drafted = sum(r.drafted for r in rounds)
    n = sum(trace.turns[t] for t in turns)  # the recorded rounds of the replayed decodes
    rec_committed, rec_drafted = sum(trace.committed[:n]), sum(trace.drafted[:n])
    return {
        "vanilla_tok_s": sum(budgets) / van,
        "spec_tok_s": sum(budgets) / sp,
        "speedup": van / sp,
        "predicted": committed * cost.step / modelled,
        "alpha": (committed - len(rounds)) / max(1, drafted),
        "M": committed / max(1, len(rounds)),
        "recorded_alpha": (rec_committed - n) / max(1, rec_drafted),
        "recorded_M": rec_committed / max(1, n),
        "declined": sum(r.drafted == 0 for r in rounds) / max(1, len(rounds)),
        "skip_ratio": statistics.fmean(r.skip_ratio for r in rounds if r.drafted) if drafted else 0.0,
        "decodes": per,
        "tokens": sum(budgets),
        "rounds": len(rounds),
        "timed_captures": captures,
    }


def run(adapter, plan, args, prompts: list[torch.Tensor]) -> dict:
    """Interleaved plain and speculative decoding of ``prompts``; medians over ``args.reps``."""
    dev = adapter.arch.device
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


def replay_traces(adapter, args, prompts: list[torch.Tensor], env: dict, out: dict) -> None:
    """``--trace``: every method of every trace file, replayed eagerly and/or with graphs."""
    print(
        "| trace | mode | plain tok/s | replayed tok/s | speedup | predicted | alpha (recorded) | "
        "M (recorded) | declined | skip ratio | timed captures |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for path in args.trace:
        doc = json.loads(Path(path).read_text())
        src = doc["source"]
        env.setdefault("traces", {})[Path(path).name] = {k: src[k] for k in ("model", "dtype", "command")}
        for name, entry in doc["methods"].items():
            if args.trace_methods and name not in args.trace_methods.split(","):
                continue
            label = f"{src['model']}/{name}"
            trace = Trace.load(entry, label, adapter.arch.num_layers)
            for mode in MODES[args.graphs]:
                adapter.executor.set_cuda_graphs(mode == "graphs")
                r = out.setdefault(label, {})[mode] = replay(adapter, trace, args, prompts)
                print(
                    f"| {label} | {mode} | {r['vanilla_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
                    f"{r['speedup']:.2f}x | {r['predicted']:.2f}x | {r['alpha']:.3f} ({r['recorded_alpha']:.3f}) | "
                    f"{r['M']:.2f} ({r['recorded_M']:.2f}) | {r['declined']:.0%} | {r['skip_ratio']:.2f} | "
                    f"{r['timed_captures']} |",
                    flush=True,
                )
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=1))


MODES = {"off": ["eager"], "on": ["graphs"], "both": ["eager", "graphs"]}


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
    ap.add_argument("--graphs", choices=sorted(MODES), default="both")
    ap.add_argument(
        "--trace",
        action="append",
        default=[],
        help="replay the recorded rounds of this trace file (record_traces.py) instead of --scale "
        "(repeatable); --skip-ratio, --scale and --k are then unused",
    )
    ap.add_argument(
        "--trace-methods", default="", help="comma-separated methods of the traces (default: all)"
    )
    ap.add_argument(
        "--trace-turns", type=int, default=0, help="replay each trace's first N decodes (default: all)"
    )
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build(args.shape, getattr(torch, args.dtype), args.device)
    adapter = adapter_for(model, fast_kernels=False)
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (1, 64), generator=gen).to(args.device) for _ in range(args.prompts)]
    env = {
        "shape": args.shape,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "new_tokens": args.new_tokens,
        "prompts": args.prompts,
        "reps": args.reps,
    }
    out: dict = {"env": env}
    if args.trace:
        print(f"# {json.dumps(env)}\n")
        replay_traces(adapter, args, prompts, env, out)
        return
    plan = uniform_plan(adapter.arch.num_layers, args.skip_ratio)
    scaled = make_redundant(model, plan, args.scale)
    env.update(skip_ratio=plan.skip_ratio, scaled_sub_layers=scaled, scale=args.scale, k=args.k)
    print(f"# {json.dumps(env)}\n")
    print(
        "| mode | plain tok/s | speculative tok/s | speedup | predicted at M | alpha | M | draft cost | "
        "verify k+1 | differ |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for label in MODES[args.graphs]:
        adapter.executor.set_cuda_graphs(label == "graphs")
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
