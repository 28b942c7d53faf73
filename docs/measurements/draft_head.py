"""The reduced draft head (``--drafter.draft_vocab K``): coverage, draft cost and acceptance against K.

For one model:

1. builds the token ranking the drafters use (`framework.engine.draft_head.model_ranking`: counts
   of the model's own tokens on the calibration prompts and its greedy answers), or reads it from
   the cache;
2. decodes the built-in evaluation prompts (``framework/data/assets/prompts.jsonl``, none of
   which is a calibration prompt) greedily and reports the coverage of each K: the share of those
   generated tokens inside the top K, for the built ranking, for token-id order alone (the
   byte-pair merge order, no counts), and for the built ranking plus the tokens of the context so
   far (``vocab_context``: the prompt's and the answer's earlier tokens);
3. times, interleaved with medians, one full decoding step, the final norm + LM head of one token
   (full and each K), and one draft step of the static selector's default plan (skip_ratio 0.2) with
   each head (a generation's head over the first prompt, context rows included), as a share of a
   step;
4. decodes a few held-out prompts with that plan, a fixed draft length and greedy verification, once
   per head with and without the context tokens, and reports acceptance alpha and M (acceptance
   does not depend on timing).

    python docs/measurements/draft_head.py --threads 2
    python docs/measurements/draft_head.py --model qwen2.5-coder-0.5b --threads 2 --ks 4096,8192,16384,32768 \
        --coverage-limit 3 --coverage-tokens 96 --accept-context yes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from framework import get_drafter, get_length, get_selector, get_verifier
from framework.data.prompts import encode_chat, load_prompts
from framework.engine.cost_model import head_seconds
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.draft_head import DraftHead
from framework.engine.state import DecodeState
from framework.engine.token_ranking import TokenRanking, model_ranking
from framework.session.run_config import RunConfig
from framework.session.session import Session
from strategies.selectors.static import uniform_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or directory (default: the embedded model)")
    ap.add_argument("--ks", default="1024,2048,4096,8192,16384,32768", help="head sizes K, comma-separated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--coverage-tokens", type=int, default=128, help="new tokens per held-out prompt")
    ap.add_argument("--coverage-limit", type=int, default=0, help="held-out prompts per category (0: all)")
    ap.add_argument("--accept-limit", type=int, default=1, help="held-out prompts per category for alpha")
    ap.add_argument("--accept-tokens", type=int, default=96, help="new tokens per prompt for alpha")
    ap.add_argument("--k", type=int, default=4, help="fixed draft length for alpha")
    ap.add_argument(
        "--accept-context",
        choices=("both", "yes", "no"),
        default="both",
        help="heads with/without context tokens",
    )
    ap.add_argument("--reps", type=int, default=15, help="timing repetitions (medians)")
    ap.add_argument("--json", default="", help="also write the numbers to this file")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    exp = Session(RunConfig.of(model=a.model, device="cpu", logger="none", baseline_only=True))
    adapter, tok, ctx = exp.adapter, exp.tokenizer, exp.prepare_ctx
    info = adapter.arch.info()
    ks = [k for k in (int(x) for x in a.ks.split(",")) if k <= info.vocab_size]
    print(f"model {info.name}: {info.num_layers} blocks, d {info.hidden_size}, V {info.vocab_size}")

    t0 = time.perf_counter()
    ranking = model_ranking(ctx)
    print(f"ranking: {ranking.source} ({time.perf_counter() - t0:.1f} s incl. cache lookup)")
    prior = TokenRanking.from_counts(
        {}, info.vocab_size, always=sorted(ctx.eos_token_ids), source="token-id order"
    )

    # 2. coverage on held-out greedy outputs
    prompts = load_prompts(limit=a.coverage_limit or None)
    ids = [torch.tensor([encode_chat(tok, [{"role": "user", "content": p.turns[0]}])]) for p in prompts]
    stop = StopCondition(a.coverage_tokens, ctx.eos_token_ids)
    vanilla = VanillaDecoder(adapter)
    t0 = time.perf_counter()
    per_prompt = [vanilla.generate(x, stop).tokens for x in ids]
    generated = [t for gen in per_prompt for t in gen]
    print(
        f"held-out: {len(prompts)} built-in prompts, {len(generated)} greedy tokens ({time.perf_counter() - t0:.0f} s)"
    )
    out: dict = {"model": info.name, "V": info.vocab_size, "held_out_tokens": len(generated), "ks": {}}
    print(
        "\n| K | K / V | coverage: built ranking | token-id order | built ranking + context |\n|---|---|---|---|---|"
    )
    for k in ks:
        cov, cov0 = ranking.coverage(generated, k), prior.coverage(generated, k)
        top, hits = set(ranking.top(k)), 0
        for x, gen in zip(ids, per_prompt, strict=True):
            seen = set(x[0].tolist())
            for t in gen:
                hits += t in top or t in seen
                seen.add(t)
        covc = hits / len(generated)
        out["ks"][k] = {"coverage": cov, "coverage_id_order": cov0, "coverage_context": covc}
        print(f"| {k} | {k / info.vocab_size:.3f} | {cov:.4f} | {cov0:.4f} | {covc:.4f} |")

    # 3. timing: a step, the heads, a static-plan draft step per head
    heads = {k: DraftHead(adapter, ranking.top(k), name=f"top-{k}", context=True) for k in ks}
    plan = uniform_plan(info.num_layers, 0.2)
    x = ids[0]
    sync = torch.cuda.synchronize if adapter.arch.device.type == "cuda" else (lambda: None)
    state = DecodeState(adapter, x, x.shape[1] + 16)
    state.append(state.prefill().argmax(-1)[:, None])
    live = {k: h.start(x) for k, h in heads.items()}

    def draft(head: DraftHead | None) -> None:
        state.draft_head = head
        state.forward_draft(state.pending, plan)
        state.discard_draft()

    def step() -> None:
        state.forward_verify(state.pending, logits_at="last")

    fns = {"step": step, "draft_full": lambda: draft(None)} | {
        f"draft_{k}": (lambda k=k: draft(live[k])) for k in ks
    }
    samples: dict[str, list[float]] = {n: [] for n in fns}
    with torch.inference_mode():
        for rep in range(a.reps + 1):
            for name, fn in fns.items():
                sync()
                t = time.perf_counter()
                fn()
                sync()
                if rep:
                    samples[name].append(time.perf_counter() - t)
    med = {n: statistics.median(v) for n, v in samples.items()}
    step_s = med["step"]
    full_head, _ = head_seconds(adapter, None, reps=4 * a.reps)
    print(
        f"\nstep {step_s * 1e3:.2f} ms; final norm + full LM head {full_head * 1e3:.2f} ms ({full_head / step_s:.1%} of a step); "
        f"static plan skips {plan.skip_ratio:.1%} of sub-layers; draft step with the full head "
        f"{med['draft_full'] / step_s:.3f} steps"
    )
    out.update(
        step_ms=step_s * 1e3, full_head_ms=full_head * 1e3, draft_full_steps=med["draft_full"] / step_s
    )
    print(
        "\n| K | final norm + head (ms) | static-plan draft step (steps), context rows included |\n|---|---|---|"
    )
    print(f"| {info.vocab_size} (full) | {full_head * 1e3:.2f} | {med['draft_full'] / step_s:.3f} |")
    for k in ks:
        _, hs = head_seconds(adapter, heads[k], reps=4 * a.reps)
        out["ks"][k].update(head_ms=hs * 1e3, draft_steps=med[f"draft_{k}"] / step_s, rows=live[k].size)
        print(f"| {k} (+{live[k].size - k}) | {hs * 1e3:.2f} | {med[f'draft_{k}'] / step_s:.3f} |")

    # 4. acceptance with each head
    acc_prompts = load_prompts(limit=a.accept_limit)
    acc_ids = [
        torch.tensor([encode_chat(tok, [{"role": "user", "content": p.turns[0]}])]) for p in acc_prompts
    ]
    static, fixed = get_selector("static"), get_length("fixed")
    print(
        f"\nacceptance: {len(acc_prompts)} prompts x {a.accept_tokens} tokens, static 0.2, fixed k = {a.k}, greedy"
    )
    print("| K | context tokens | alpha | M |\n|---|---|---|---|")
    modes = {"both": (False, True), "yes": (True,), "no": (False,)}[a.accept_context]
    for k, context in [(0, False)] + [(k, c) for k in ks for c in modes]:
        drafter = get_drafter("layer_skip")
        drafter = drafter(drafter.Config(draft_vocab=k, vocab_context=context if k else True))
        dec = SpeculativeDecoder(
            adapter,
            static(static.Config(skip_ratio=0.2)),
            fixed(fixed.Config(k=a.k)),
            drafter,
            get_verifier("greedy")(),
        )
        dec.prepare(ctx)
        drafted = accepted = rounds = committed = 0
        for x in acc_ids:
            r = dec.generate(x, StopCondition(a.accept_tokens, ctx.eos_token_ids))
            drafted, accepted = drafted + r.drafted, accepted + r.accepted
            rounds, committed = rounds + len(r.accept_lengths), committed + sum(r.accept_lengths)
        alpha, m = accepted / drafted, committed / rounds
        label = f"{info.vocab_size} (full)" if k == 0 else str(k)
        print(f"| {label} | {'yes' if context else 'no'} | {alpha:.3f} | {m:.2f} |")
        out["ks"].setdefault(k, {}).update(
            {f"alpha{'_context' if context else ''}": alpha, f"M{'_context' if context else ''}": m}
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
