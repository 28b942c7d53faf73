"""Compressed draft weights (``--drafter.draft_weights``): what a draft step costs and what it accepts.

For one model on this CPU (float32, the CPU kernels on), for each weight format of the drafts
(``float32``: the model's own; ``bfloat16``; ``int8`` with one scale per output row; ``int4`` with
one scale per row and group of 64, int8 activations):

1. times, interleaved with medians, one plain decoding step, a verification of k + 1 tokens and one
   draft step of each skip ratio
   (uniform plans, `strategies.selectors.static.uniform_plan`), with the reduced draft head of
   ``--draft-vocab`` tokens (0: the full head), as a share of a step; and the cost of one attention
   and one MLP sub-layer of a draft (`framework.engine.cost_model.draft_sublayer_seconds`);
2. decodes held-out built-in prompts (``framework/data/assets/prompts.jsonl``) with each plan
   and format, a fixed draft length and greedy verification, and reports acceptance (alpha, M) and
   the speedup those rounds give at the measured costs (``M / (k * draft + verify(k + 1))``, in
   steps); every output is compared with plain greedy decoding.

    python docs/measurements/draft_weights.py --threads 2
    python docs/measurements/draft_weights.py --model qwen2.5-coder-0.5b --threads 2 --ratios 0,0.1,0.2
    python docs/measurements/draft_weights.py --model tiny-random --reps 2 --accept-tokens 12   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from framework import get_drafter, get_length, get_selector, get_verifier
from framework.data.prompts import encode_chat, load_prompts
from framework.engine.cost_model import draft_sublayer_seconds
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.engine.token_ranking import draft_head_for
from framework.session.run_config import RunConfig
from framework.session.session import Session
from strategies.selectors.static import uniform_plan

FORMATS = ("float32", "bfloat16", "int8", "int4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or directory (default: the embedded model)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="draft weight formats, comma-separated")
    ap.add_argument("--ratios", default="0,0.2", help="uniform skip ratios of the draft, comma-separated")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="reduced draft head K (0: the full head)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--reps", type=int, default=15, help="timing repetitions (medians)")
    ap.add_argument("--accept-limit", type=int, default=1, help="held-out prompts per category")
    ap.add_argument("--accept-tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--k", type=int, default=4, help="fixed draft length")
    ap.add_argument("--json", default="", help="also write the numbers to this file")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    if not formats or any(f not in FORMATS for f in formats):
        ap.error(f"--formats must name some of {', '.join(FORMATS)}, got {a.formats!r}")
    ratios = [float(r) for r in a.ratios.split(",")]
    exp = Session(RunConfig.of(model=a.model, device="cpu", logger="none", baseline_only=True))
    adapter, tok, ctx = exp.adapter, exp.tokenizer, exp.prepare_ctx
    info = adapter.arch.info()
    weights = {f: (None if f == "float32" else adapter.draft_branches(f)) for f in formats}
    if any(f != "float32" and w is None for f, w in weights.items()):
        raise SystemExit("compressed draft weights need the CPU kernels (a float32 model on a CPU)")
    head = draft_head_for(ctx, a.draft_vocab) if 0 < a.draft_vocab < info.vocab_size else None
    print(
        f"model {info.name}: {info.num_layers} blocks, d {info.hidden_size}, V {info.vocab_size}; "
        f"draft head {head.size if head is not None else 'full'}; threads {torch.get_num_threads()}"
    )
    out: dict = {"model": info.name, "draft_vocab": head.size if head is not None else 0, "formats": {}}
    for f, w in weights.items():
        mb = (w.nbytes if w is not None else adapter.fused.nbytes if adapter.fused is not None else 0) / 2**20
        out["formats"][f] = {"fused_weight_mib": mb}

    # 1. timing: a plain step, and a draft step of each plan in each format
    prompts = load_prompts(limit=a.accept_limit)
    ids = [torch.tensor([encode_chat(tok, [{"role": "user", "content": p.turns[0]}])]) for p in prompts]
    plans = {r: uniform_plan(info.num_layers, r) for r in ratios}
    x = ids[0]
    state = DecodeState(adapter, x, x.shape[1] + 16)
    state.append(state.prefill().argmax(-1)[:, None])
    state.draft_head = head.start(x) if head is not None else None

    def draft(fmt: str, r: float) -> None:
        state.draft_weights = weights[fmt]
        state.forward_draft(state.pending, plans[r])
        state.discard_draft()

    block = x[:, -(a.k + 1) :]  # any k + 1 tokens: a verification's cost does not depend on them
    fns = {
        "step": lambda: state.forward_verify(state.pending, logits_at="last"),
        "verify": lambda: state.forward_verify(block, logits_at="all"),
    }
    fns |= {f"{f}/{r}": (lambda f=f, r=r: draft(f, r)) for f in formats for r in ratios}
    samples: dict[str, list[float]] = {n: [] for n in fns}
    with torch.inference_mode():
        for rep in range(a.reps + 1):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                if rep:
                    samples[name].append(time.perf_counter() - t)
    med = {n: statistics.median(v) for n, v in samples.items()}
    step = med["step"]
    state.cache.release()
    sub = draft_sublayer_seconds(adapter, [weights[f] for f in formats], reps=a.reps)
    verify = med["verify"] / step
    print(
        f"\none step {step * 1e3:.2f} ms; a verification of k + 1 = {a.k + 1} tokens {verify:.3f} steps (medians of {a.reps})\n"
    )
    print(
        "| draft weights | fused weights (MiB) | attention / MLP sub-layer (ms) | "
        + " | ".join(f"draft step, {r:.0%} skipped (steps)" for r in ratios)
        + " |"
    )
    print("|---|---:|---:|" + "---:|" * len(ratios))
    for f, (sa, sm) in zip(formats, sub, strict=True):
        o = out["formats"][f]
        o.update(attn_ms=sa * 1e3, mlp_ms=sm * 1e3, draft_steps={r: med[f"{f}/{r}"] / step for r in ratios})
        cells = " | ".join(f"{med[f'{f}/{r}'] / step:.3f}" for r in ratios)
        print(f"| {f} | {o['fused_weight_mib']:.0f} | {sa * 1e3:.3f} / {sm * 1e3:.3f} | {cells} |")
    out.update(step_ms=step * 1e3, verify_steps=verify)

    # 2. acceptance of each plan and format, against plain greedy decoding
    stop = StopCondition(a.accept_tokens, ctx.eos_token_ids)
    vanilla = VanillaDecoder(adapter)
    want = [vanilla.generate(p, stop).tokens for p in ids]
    static, fixed = get_selector("static"), get_length("fixed")
    drafter_cls = get_drafter("layer_skip")
    print(
        f"\nacceptance: {len(ids)} built-in prompts x {a.accept_tokens} tokens, uniform plans, fixed k = {a.k}, "
        "greedy verification\n"
    )
    print(
        "| draft weights | skipped | alpha | M | draft (steps) | modelled speedup at k | differ from plain |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for f in formats:
        for r in ratios:
            drafter = drafter_cls(drafter_cls.Config(draft_vocab=a.draft_vocab, draft_weights=f))
            dec = SpeculativeDecoder(
                adapter,
                static(static.Config(skip_ratio=r)),
                fixed(fixed.Config(k=a.k)),
                drafter,
                get_verifier("greedy")(),
            )
            dec.prepare(ctx)
            drafted = accepted = rounds = committed = differ = 0
            for p, w in zip(ids, want, strict=True):
                res = dec.generate(p, stop)
                drafted, accepted = drafted + res.drafted, accepted + res.accepted
                rounds, committed = rounds + len(res.accept_lengths), committed + sum(res.accept_lengths)
                differ += res.tokens != w
            alpha, m = accepted / max(1, drafted), committed / max(1, rounds)
            cost = out["formats"][f]["draft_steps"][r]
            # M tokens per round, for k draft steps and one verification of k + 1 tokens
            modelled = m / (a.k * cost + verify)
            out["formats"][f].setdefault("accept", {})[r] = {
                "alpha": alpha,
                "M": m,
                "modelled_speedup": modelled,
                "differ": differ,
                "prompts": len(ids),
            }
            print(
                f"| {f} | {r:.0%} | {alpha:.3f} | {m:.2f} | {cost:.3f} | {modelled:.2f}x | {differ}/{len(ids)} |"
            )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
