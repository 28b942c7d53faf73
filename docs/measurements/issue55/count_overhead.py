"""What counting the host work costs (issue 55, item 2): one warm-up decode of 16 tokens with
each speculative method of README command 1, counted (`framework.testing.host_work.counted`) and
plain, interleaved, medians of 5, on the embedded default model; and the share of a whole README
command 1 run that the counting adds (three counted warm-up decodes).

    python docs/measurements/issue55/count_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch

import selfspec
from framework.testing.host_work import counted

METHODS = ("static_confidence", "hybrid")
PROMPT = "Explain how a KV cache makes decoding faster."


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for name in METHODS:
        dec = selfspec.Decoder.from_preset(name, max_new_tokens=16, log=None)
        dec.generate(PROMPT)  # warm
        plain, count = [], []
        for _ in range(5):
            t = time.perf_counter()
            dec.generate(PROMPT)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            counted(lambda d=dec: d.generate(PROMPT))
            count.append(time.perf_counter() - t)
        p, c = statistics.median(plain), statistics.median(count)
        rows.append((name, p, c))
        print(f"{name}: a 16-token decode {p:.3f} s plain, {c:.3f} s counted: +{c - p:.3f} s ({c / p:.2f}x)")
    extra = sum(c - p for _, p, c in rows) / len(rows) * 3  # README command 1 counts three methods
    print(
        f"README command 1 counts 3 warm-up decodes: about +{extra:.2f} s of a run of about 75 s "
        f"({100 * extra / 75:.1f}%); the timed decodes are not counted"
    )


if __name__ == "__main__":
    main()
