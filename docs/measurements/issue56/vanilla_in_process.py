"""Plain greedy decoding (`VanillaDecoder`) of the default model in one process of whichever
checkout is on ``PYTHONPATH``: ms per new token, the median of 5 repetitions over four chat prompts
of 64 tokens, by the decoder's own ``wall_time`` and by a clock around the calls.

    PYTHONPATH=<checkout> python docs/measurements/issue56/vanilla_in_process.py
"""

from __future__ import annotations

import statistics
import time

import torch

from framework.data.prompts import encode_chat
from framework.engine.adapter import adapter_for
from framework.engine.decoding import StopCondition, VanillaDecoder
from framework.models.loading import load_model

PROMPTS = (
    "Explain what a KV cache is in two sentences.",
    "Write a Python function that reverses a list.",
    "Translate to French: The weather is nice today.",
    "What is 17 times 23? Show your steps.",
)


def main() -> None:
    torch.set_num_threads(2)
    model, tok = load_model(None, "float32", "cpu")
    dec = VanillaDecoder(adapter_for(model))
    prompts = [torch.tensor([encode_chat(tok, [{"role": "user", "content": t}])]) for t in PROMPTS]
    stop = StopCondition(64)  # no EOS: every generation decodes 64 tokens
    dec.generate(prompts[0], stop)  # warm-up
    wall, outer = [], []
    for _ in range(5):
        t = time.perf_counter()
        results = [dec.generate(p, stop) for p in prompts]
        seconds = time.perf_counter() - t
        n = sum(r.new_tokens for r in results)
        wall.append(1e3 * sum(r.wall_time for r in results) / n)
        outer.append(1e3 * seconds / n)
    print(f"wall_time ms/token {statistics.median(wall):.2f}, clock ms/token {statistics.median(outer):.2f}")


if __name__ == "__main__":
    main()
