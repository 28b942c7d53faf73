"""Issue 57's batch table: self-speculation against vanilla batched decoding at B = 1, 2, 4, 8.

For each model, one process: the method's decoder and the vanilla decoder on the same adapter, each
batch size's B prompts (held-out Spec-Bench first turns), run interleaved (vanilla, method, vanilla,
method, ... for every B in turn, ``--reps`` times) after one warm-up of each. Reported per B:
tokens per second over the batch (median over the repetitions), the speedup against vanilla at the
same B (median of the per-repetition ratios), the same after the prefills (each row's prefill
runs alone, before the rows decode together: the decode phase's tokens per second), per-row M and
alpha, rows per forward, acceptance by
draft position (the share of rounds that drafted an i-th token whose i-th token was accepted), the
time per output token of the rows (P50 / P95 / mean over rows and repetitions), and the batch cost
model's prediction (`framework.engine.batch.costs.BatchCosts`, measured at the prompts' mean
context, priced with the run's own M and longest draft per round). Every row's tokens are checked
against the vanilla batch's (mismatches are counted, not hidden).

    python docs/measurements/issue57/batch_table.py --model smollm2-135m-instruct --out smollm2.json
    python docs/measurements/issue57/batch_table.py --model qwen2.5-coder-0.5b --out qwen.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import selfspec
from framework.engine.batch.costs import BatchCosts
from framework.engine.batch.decoding import BatchDecoder

QUESTIONS = Path(__file__).resolve().parents[4] / "shared" / "data" / "spec_bench" / "question.jsonl"


def prompts(n: int, offset: int) -> list[str]:
    """``n`` first turns from Spec-Bench, every 37th question from ``offset`` (spread over categories)."""
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return [rows[(offset + 37 * i) % len(rows)]["turns"][0] for i in range(n)]


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def by_position(results: list, depth: int = 8) -> list[float]:
    """Share of rounds that drafted an i-th token whose i-th token was accepted (i = 1..depth)."""
    drafted, accepted = [0] * depth, [0] * depth
    for res in results:
        for r in res.rounds:
            for i in range(min(r.drafted, depth)):
                drafted[i] += 1
                accepted[i] += i < r.accepted
    return [a / d if d else float("nan") for a, d in zip(accepted, drafted, strict=False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="static_confidence")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--offset", type=int, default=200, help="first Spec-Bench question (held out: no tuning used them)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batches.split(",")]
    dec = selfspec.Decoder.from_preset(
        args.method, model=args.model, max_new_tokens=args.max_new_tokens, log=None
    )
    exp = dec.experiment
    texts = prompts(max(sizes), args.offset)
    ids = [dec.encode(t) for t in texts]
    dec.generate(texts[0], max_new_tokens=8)  # the method's one-time preparation (search, gate, costs)
    method, vanilla = BatchDecoder(exp.decoder, max(sizes)), BatchDecoder(exp.vanilla, max(sizes))

    def run(batch: BatchDecoder, b: int):
        return batch.generate(ids[:b], [exp.stop(args.max_new_tokens, None) for _ in range(b)])

    for b in (1, max(sizes)):  # warm-up
        run(vanilla, b), run(method, b)
    runs: dict[int, dict[str, list]] = {b: {"vanilla": [], "method": []} for b in sizes}
    for _ in range(args.reps):
        for b in sizes:
            runs[b]["vanilla"].append(run(vanilla, b))
            runs[b]["method"].append(run(method, b))
            print(f"B={b}: vanilla {runs[b]['vanilla'][-1].tokens_per_second:.1f} tok/s, "
                  f"method {runs[b]['method'][-1].tokens_per_second:.1f} tok/s", file=sys.stderr, flush=True)  # fmt: skip
    plan = exp.decoder.selector.plan(None)
    weights = exp.decoder.drafter.draft_weights()
    context = round(sum(i.shape[1] for i in ids[: max(sizes)]) / max(sizes)) + args.max_new_tokens // 2
    table = []
    for b in sizes:
        v, m = runs[b]["vanilla"], runs[b]["method"]
        rows = [r for batch in m for r in batch.rows]
        mismatches = sum(
            mr.tokens != vr.tokens
            for mb, vb in zip(m, v, strict=False)
            for mr, vr in zip(mb.rows, vb.rows, strict=False)
        )
        rounds = [r for res in rows for r in res.rounds]
        M = sum(r.committed for r in rounds) / len(rounds)
        drafted = sum(r.drafted for r in rounds)
        alpha = sum(r.accepted for r in rounds) / drafted if drafted else 0.0
        # the longest draft of a batch round: each round's rows, by round index
        longest = []
        for batch in m:
            for i in range(max(len(r.rounds) for r in batch.rows)):
                longest.append(max((r.rounds[i].drafted for r in batch.rows if i < len(r.rounds)), default=0))
        k_max = sum(longest) / len(longest)
        costs = BatchCosts.measure(exp.adapter, b, plan, context=context, weights=weights, reps=5)
        tpot = [res.wall_time / res.new_tokens for res in rows]

        def decode_rate(x) -> float:  # after the prefills (each row's runs alone, first)
            return (x.new_tokens - len(x.rows)) / (x.wall_time - x.prefill_seconds)

        table.append({
            "batch": b,
            "vanilla_tokens_per_s": statistics.median(x.tokens_per_second for x in v),
            "method_tokens_per_s": statistics.median(x.tokens_per_second for x in m),
            "speedup": statistics.median(mm.tokens_per_second / vv.tokens_per_second for mm, vv in zip(m, v, strict=False)),
            "vanilla_decode_tokens_per_s": statistics.median(decode_rate(x) for x in v),
            "method_decode_tokens_per_s": statistics.median(decode_rate(x) for x in m),
            "decode_speedup": statistics.median(decode_rate(mm) / decode_rate(vv) for mm, vv in zip(m, v, strict=False)),
            "prompt_tokens": [int(i.shape[1]) for i in ids[:b]],
            "predicted_speedup": costs.predicted_speedup(M, k_max),
            "M": M,
            "alpha": alpha,
            "per_row_M": [sum(r.committed for r in res.rounds) / len(res.rounds) for res in m[0].rows],
            "per_row_alpha": [res.acceptance_rate for res in m[0].rows],
            "mean_longest_draft": k_max,
            "rows_per_forward": statistics.mean(x.row_forwards / x.forwards for x in m),
            "vanilla_rows_per_forward": statistics.mean(x.row_forwards / x.forwards for x in v),
            "finished_rows": m[0].finished_rows,
            "acceptance_by_position": by_position(rows),
            "tpot_ms": {"p50": 1e3 * quantile(tpot, 0.5), "p95": 1e3 * quantile(tpot, 0.95), "mean": 1e3 * statistics.mean(tpot)},
            "vanilla_tpot_ms": {
                "p50": 1e3 * quantile([r.wall_time / r.new_tokens for x in v for r in x.rows], 0.5),
                "p95": 1e3 * quantile([r.wall_time / r.new_tokens for x in v for r in x.rows], 0.95),
            },
            "mismatched_rows": mismatches,
            "rows_compared": len(rows),
            "costs_ms": {"step": 1e3 * costs.step, "draft": 1e3 * costs.draft, "verify": [1e3 * c for c in costs.verify_costs]},
        })  # fmt: skip
    out = {
        "command": " ".join(sys.argv),
        "model": args.model,
        "method": args.method,
        "max_new_tokens": args.max_new_tokens,
        "reps": args.reps,
        "threads": args.threads,
        "torch": torch.__version__,
        "table": table,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        "| B | vanilla tok/s | method tok/s | speedup | decode-phase vanilla / method tok/s | decode speedup | predicted | M | alpha | rows/forward | TPOT P50/P95 ms | mismatches |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in table:
        print(
            f"| {t['batch']} | {t['vanilla_tokens_per_s']:.1f} | {t['method_tokens_per_s']:.1f} | {t['speedup']:.3f}x | "
            f"{t['vanilla_decode_tokens_per_s']:.1f} / {t['method_decode_tokens_per_s']:.1f} | {t['decode_speedup']:.3f}x | "
            f"{t['predicted_speedup']:.3f}x | {t['M']:.2f} | {t['alpha']:.3f} | {t['rows_per_forward']:.2f} | "
            f"{t['tpot_ms']['p50']:.1f} / {t['tpot_ms']['p95']:.1f} | {t['mismatched_rows']}/{t['rows_compared']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
