"""Cost of one forward of the default model on this machine's CPU, relative to one decoding step.

Times the adapter's forward over T new tokens after a 64-token prefix: full model at T = 1, 4, 8
(LM head at every position, as in a verification), and one-token draft steps with uniform skip
sets. Cases are interleaved, 30 repetitions each, medians reported.

    python docs/measurements/forward_cost.py [THREADS]
"""

import statistics
import sys
import time

import torch

from framework.engine.adapter import adapter_for
from framework.models.loading import load_model
from strategies.selectors.static import uniform_plan

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
model, _ = load_model(None, "float32", "cpu")
adapter = adapter_for(model)
L, P = adapter.arch.num_layers, 64
ids = torch.randint(0, model.config.vocab_size, (1, P + 8), generator=torch.Generator().manual_seed(0))
cache = adapter.new_cache(256)
adapter.forward(ids[:, :P], torch.arange(P)[None], cache, logits_at="last")
cache.commit(P)

plans = {"full": None, "skip 0.2": uniform_plan(L, 0.2), "skip 0.5": uniform_plan(L, 0.5)}
cases = [
    (1, "full", "last"),
    (4, "full", "all"),
    (8, "full", "all"),
    (1, "skip 0.2", "last"),
    (1, "skip 0.5", "last"),
]


def run(t: int, plan: str, logits_at: str) -> float:
    start = time.perf_counter()
    # base=P: every call writes the same slots after the prefix, so all cases see the same context.
    adapter.forward(
        ids[:, P : P + t], torch.arange(P, P + t)[None], cache, plans[plan], logits_at=logits_at, base=P
    )
    return time.perf_counter() - start


times: dict[tuple, list[float]] = {c: [] for c in cases}
for c in cases:
    run(*c)  # warm-up
for _ in range(30):
    for c in cases:
        times[c].append(run(*c))
base = statistics.median(times[cases[0]])
print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
for c in cases:
    m = statistics.median(times[c])
    skipped = "" if plans[c[1]] is None else f", {plans[c[1]].skip_ratio:.3f} of sub-layers skipped"
    print(f"T={c[0]} {c[1]:<8}{skipped}: median {1000 * m:.1f} ms = {m / base:.2f} x one full step")
