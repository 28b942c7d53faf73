"""Prefill through oneDNN against F.linear's BLAS, in one process (interleaved, medians).

Part 1 multiplies blocks of 65-2,000 rows by Qwen2.5-0.5B-shaped float32 weights with ``F.linear``
and with ``torch.ops.mkldnn._linear_pointwise`` (what `framework.kernels.cpu.linear` uses for more
than ``MAX_ROWS`` rows). Part 2 times a prefill of ``--tokens`` tokens through the adapter of
``--model`` with the oneDNN path on and off (``framework.kernels.cpu._ONEDNN`` set to ``None``),
and checks that both prefills pick the same next token.

    python docs/measurements/prefill_onednn.py [--model qwen2.5-coder-0.5b] [--tokens 2000] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from framework.engine.adapter import adapter_for
from framework.kernels import cpu as kernels
from framework.models.loading import load_model


def _median(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def products(reps: int) -> None:
    op = kernels._onednn_linear()
    if op is None:
        print("oneDNN's linear is not available (or failed its check) in this torch")
        return
    shapes = [(4864, 896), (896, 4864), (896, 896)]
    ws = {s: torch.randn(*s) for s in shapes}
    print("rows | " + " | ".join(f"W {n}x{k}: F.linear / oneDNN ms" for n, k in shapes))
    for rows in (65, 128, 512, 2000):
        cells = []
        for s in shapes:
            x, w = torch.randn(rows, s[1]), ws[s]
            a = _median(lambda x=x, w=w: F.linear(x, w), reps)
            b = _median(lambda x=x, w=w: op(x, w, None, "none", [], ""), reps)
            cells.append(f"{1e3 * a:.2f} / {1e3 * b:.2f} ({a / b:.2f}x)")
        print(f"{rows} | " + " | ".join(cells))


def prefill(model_name: str | None, tokens: int, reps: int) -> None:
    model, _ = load_model(model_name, "float32", "cpu")
    adapter = adapter_for(model)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    op = kernels._onednn_linear()

    def run(use: bool) -> torch.Tensor:  # the logits at the last position
        kernels._ONEDNN = op if use else None
        cache = adapter.new_cache(tokens + 8)
        return adapter.forward(ids, torch.arange(tokens)[None], cache, logits_at="last").logits

    times: dict[bool, list[float]] = {True: [], False: []}
    nxt = {}
    for rep in range(reps + 1):
        for use in (False, True):
            start = time.perf_counter()
            logits = run(use)
            if rep:
                times[use].append(time.perf_counter() - start)
            nxt[use] = int(logits[0, -1].argmax())
    kernels._ONEDNN = op
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"prefill of {tokens} tokens: F.linear {off:.2f} s, oneDNN {on:.2f} s ({off / on:.2f}x); "
        f"next token {'the same' if nxt[True] == nxt[False] else 'DIFFERENT'}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    products(7)
    prefill(args.model, args.tokens, args.reps)


if __name__ == "__main__":
    main()
