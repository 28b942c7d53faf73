"""Acceptance of uniform skip sets on the default model: alpha and M against the skip ratio.

Greedy, fixed draft length k = 4, the first prompt of the built-in qa, math_reasoning and code
categories, 32 new tokens each. Acceptance does not depend on timing, so a busy machine does not
change these numbers.

    python docs/measurements/skip_acceptance.py
"""

import torch

from framework import get_drafter, get_length, get_selector, get_verifier
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition
from framework.experiment.data import encode_chat, load_prompts
from framework.experiment.models import load_model
from framework.experiment.plugins import load_builtin_strategies
from strategies.selectors.static import uniform_plan

load_builtin_strategies()
model, tokenizer = load_model(None, "float32", "cpu")
adapter = adapter_for(model)
prompts = load_prompts(categories=["qa", "math_reasoning", "code"], limit=1)
inputs = [torch.tensor([encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}])]) for p in prompts]
static = get_selector("static")
for ratio in (0.1, 0.2, 0.3, 0.5):
    decoder = SpeculativeDecoder(
        adapter,
        static(static.Config(skip_ratio=ratio)),
        get_length("fixed")(),
        get_drafter("layer_skip")(),
        get_verifier("greedy")(),
    )
    drafted = accepted = rounds = committed = 0
    for x in inputs:
        r = decoder.generate(x, StopCondition(32))
        drafted, accepted = drafted + r.drafted, accepted + r.accepted
        rounds, committed = rounds + len(r.accept_lengths), committed + sum(r.accept_lengths)
    skipped = uniform_plan(adapter.num_layers, ratio).skip_ratio
    print(
        f"skip_ratio {ratio}: {skipped:.3f} of sub-layers skipped, alpha {accepted / drafted:.3f}, M {committed / rounds:.2f}"
    )
