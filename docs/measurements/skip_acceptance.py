"""Acceptance of uniform skip sets: alpha and M against the skip ratio.

Greedy, fixed draft length k = 4. Defaults: the default model, the first prompt of the built-in qa,
math_reasoning and code categories, 32 new tokens each. Acceptance does not depend on timing, so a
busy machine does not change these numbers.

    python docs/measurements/skip_acceptance.py
    python docs/measurements/skip_acceptance.py --model qwen2.5-coder-0.5b --draft-vocab 16384 \\
        --data path/to/spec_bench/question.jsonl --categories mt_bench,translation,summarization,qa \\
        --max-new-tokens 64 --ratios 0.2,0.3,0.4,0.5
"""

import argparse

import torch

from framework import get_drafter, get_length, get_selector, get_verifier
from framework.data.prompts import encode_chat, load_prompts
from framework.engine.decoding import SpeculativeDecoder, StopCondition
from framework.session.run_config import RunConfig
from framework.session.session import Session
from strategies.selectors.static import uniform_plan

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default=None, help="model name or directory (default: the embedded model)")
ap.add_argument("--data", default=None, help="Spec-Bench JSONL (default: the built-in suite)")
ap.add_argument("--categories", default="qa,math_reasoning,code", help="comma-separated, one prompt each")
ap.add_argument("--max-new-tokens", type=int, default=32)
ap.add_argument("--ratios", default="0.1,0.2,0.3,0.5", help="skip ratios of the static selector")
ap.add_argument("--draft-vocab", type=int, default=0, help="the drafter's reduced head K (0: full head)")
a = ap.parse_args()

exp = Session(RunConfig.of(model=a.model, device="cpu", logger="none", baseline_only=True))
adapter, tokenizer, ctx = exp.adapter, exp.tokenizer, exp.prepare_ctx  # ctx: the ranking of a reduced head
prompts = load_prompts(a.data, categories=a.categories.split(","), limit=1)
inputs = [torch.tensor([encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])]) for p in prompts]
static = get_selector("static")
layer_skip = get_drafter("layer_skip")
for ratio in (float(r) for r in a.ratios.split(",")):
    decoder = SpeculativeDecoder(
        adapter,
        static(static.Config(skip_ratio=ratio)),
        get_length("fixed")(),
        layer_skip(layer_skip.Config(draft_vocab=a.draft_vocab)),
        get_verifier("greedy")(),
    )
    decoder.prepare(ctx)
    drafted = accepted = rounds = committed = 0
    for x in inputs:
        r = decoder.generate(x, StopCondition(a.max_new_tokens))
        drafted, accepted = drafted + r.drafted, accepted + r.accepted
        rounds, committed = rounds + len(r.accept_lengths), committed + sum(r.accept_lengths)
    skipped = uniform_plan(adapter.arch.num_layers, ratio).skip_ratio
    print(
        f"skip_ratio {ratio}: {skipped:.3f} of sub-layers skipped, alpha {accepted / drafted:.3f}, M {committed / rounds:.2f}"
    )
