"""What exact mode costs a bfloat16 model on a CPU (issue 38, item 4: "on by default wherever its
cost is within 5%"): plain greedy decoding with exact mode on and off, interleaved in one process,
after a warm-up, medians of the repeats.

    python docs/measurements/exact_cost.py [--model smollm2-135m-instruct] [--tokens 64] [--repeats 5]

Exact mode on installs the batch-invariant kernels on the bfloat16 model (its linear layers stream
the bfloat16 weights, its KV cache is float32); off runs the stock modules in bfloat16. The two
decode the same prompt; the script prints tokens/s of each, their ratio, and whether the two
outputs are the same tokens (they may differ at near-ties: exact mode's sums run in another order).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from framework.engine.adapter import adapter_for
from framework.engine.decoding import StopCondition, VanillaDecoder
from framework.kernels import cpu as kernels

PROMPT = "Explain in a few sentences why the sky is blue, and what changes at sunset."


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from framework.data.prompts import encode_chat
    from framework.models.loading import load_model

    model, tok = load_model(args.model, "bfloat16", "cpu")
    adapter = adapter_for(model)
    ids = torch.tensor([encode_chat(tok, [{"role": "user", "content": PROMPT}])])
    stop = StopCondition(args.tokens)

    def mode(exact: bool) -> None:
        if exact:
            adapter.set_exact(True)
        else:
            adapter.set_exact(False)
            adapter.set_fast_kernels(False)
        assert adapter.exact is exact and kernels.is_installed(model) is exact

    times: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    for rep in range(args.repeats + 1):  # the first round warms both up
        for exact in (False, True) if rep % 2 else (True, False):
            mode(exact)
            dec = VanillaDecoder(adapter)
            t0 = time.perf_counter()
            res = dec.generate(ids, stop)
            seconds = time.perf_counter() - t0
            if rep:
                times[exact].append(len(res.tokens) / seconds)
            tokens[exact] = res.tokens
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"model {args.model} (bfloat16, CPU, {args.threads} threads), {args.tokens} new tokens, "
          f"{args.repeats} repeats interleaved")  # fmt: skip
    print(
        f"exact off (stock bfloat16): {off:.2f} tokens/s  (runs {', '.join(f'{t:.1f}' for t in times[False])})"
    )
    print(
        f"exact on  (kernels):        {on:.2f} tokens/s  (runs {', '.join(f'{t:.1f}' for t in times[True])})"
    )
    print(f"exact on / off: {on / off:.3f}x; same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
