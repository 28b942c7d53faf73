"""Speed of the decoding engine on this machine's CPU: plain greedy decoding and forward costs.

Two tables, for each thread count asked for:

1. **Greedy decoding**, tokens per second over ``--new-tokens`` new tokens from the same prompt
   (no EOS stop, so every run produces the same number of tokens): Hugging Face
   ``model.generate`` with the stock model, our `VanillaDecoder` with stock PyTorch, both with
   the kernels of `framework.kernels.cpu` installed, and `VanillaDecoder` with the kernels and the
   fused branches of `framework.kernels.fused` (the default engine). The cases are interleaved (the order rotates
   every repetition) after one warm-up run each; medians are reported, and whether each case
   produced the same tokens as HF ``generate``.
2. **Forward cost**: a full-model forward over T = 1 .. ``--max-t`` new tokens after a
   ``--prefix``-token context, logits at every position (as in a verification), on stock PyTorch,
   with the kernels, and with the kernels and fused branches, interleaved, ``--reps`` repetitions, medians; relative to the one-token step of the
   same engine and of stock PyTorch.

    python docs/measurements/engine_speed.py --threads 1 2

Both tables give wall-clock numbers and the same ratios in process CPU time. On a machine shared
with other jobs, wall time also counts the time the process waited for a core; with one thread, CPU
time is the better estimate of what an idle machine would show (memory-bandwidth contention
still shows in both). Compare ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from framework.engine.adapter import adapter_for  # noqa: E402
from framework.engine.decoding import StopCondition, VanillaDecoder  # noqa: E402
from framework.kernels import cpu as kernels  # noqa: E402
from framework.models.loading import load_model  # noqa: E402

PROMPT = "Explain, step by step, how a bicycle's gears make it easier to ride up a steep hill."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="torch thread counts to measure")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per greedy generation")
    p.add_argument("--decode-reps", type=int, default=3, help="timed generations per case")
    p.add_argument("--max-t", type=int, default=8, help="largest forward block measured")
    p.add_argument("--prefix", type=int, default=64, help="context tokens before the measured forwards")
    p.add_argument("--reps", type=int, default=30, help="timed forwards per case")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--skip-decode", action="store_true", help="only the forward-cost table")
    return p.parse_args()


#: engine name -> (kernels installed, fused branches)
ENGINES = {"stock": (False, False), "kernels": (True, False), "fused": (True, True)}


def set_engine(adapter, engine: str) -> None:
    """Switch the model to ``engine`` (the fused branches are built once and reused)."""
    on, fuse = ENGINES[engine]
    if adapter.fast_kernels != on and adapter.set_fast_kernels(on) != on:
        raise SystemExit(f"could not install the kernels: {kernels.unavailable_reason}")
    if on and not hasattr(adapter, "_bench_fused"):
        adapter._bench_fused = adapter.fused or adapter.arch.build_fused()
    adapter.fused = adapter._bench_fused if fuse else None
    if fuse and adapter.fused is None:
        raise SystemExit("this model has no fused branches")


def decode_table(model, tok, adapter, args) -> str:
    chat = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    n = args.new_tokens
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def hf() -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                top_p=None,
                top_k=None,
                temperature=None,
                pad_token_id=pad,
            )
        return out[0, ids.shape[1] :].tolist()

    def ours() -> list[int]:
        return VanillaDecoder(adapter).generate(ids, StopCondition(n)).tokens

    cases = {
        "HF `generate`, stock": ("stock", hf),
        "HF `generate`, kernels": ("kernels", hf),
        "`VanillaDecoder`, stock": ("stock", ours),
        "`VanillaDecoder`, kernels": ("kernels", ours),
        "`VanillaDecoder`, kernels + fused": ("fused", ours),
    }
    names = list(cases)
    tokens: dict[str, list[int]] = {}
    rates: dict[str, list[tuple[float, float]]] = {c: [] for c in names}  # (wall, CPU) tok/s
    for c in names:  # warm-up
        set_engine(adapter, cases[c][0])
        tokens[c] = cases[c][1]()
    for rep in range(args.decode_reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for c in order:
            set_engine(adapter, cases[c][0])
            wall, cpu = time.perf_counter(), time.process_time()
            toks = cases[c][1]()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rates[c].append((len(toks) / wall, len(toks) / cpu))
    med = {c: tuple(statistics.median(r[i] for r in rates[c]) for i in (0, 1)) for c in names}
    base = med[names[0]]
    lines = [
        f"Greedy decoding, {ids.shape[1]}-token prompt, {n} new tokens (prefill included), "
        f"{torch.get_num_threads()} thread(s), median of {args.decode_reps}:",
        "",
        "| engine | tok/s (wall) | vs HF (wall) | tok/s (CPU time) | vs HF (CPU time) | same tokens as HF |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    for c in names:
        w, u = med[c]
        same = "yes" if tokens[c] == tokens[names[0]] else "no"
        lines.append(f"| {c} | {w:.1f} | {w / base[0]:.2f}x | {u:.1f} | {u / base[1]:.2f}x | {same} |")
    return "\n".join(lines)


def forward_table(model, adapter, args) -> str:
    P, max_t = args.prefix, args.max_t
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, P + max_t), generator=g)
    caches = {}
    for engine in ENGINES:
        set_engine(adapter, engine)
        cache = adapter.new_cache(P + max_t + 8)
        adapter.forward(ids[:, :P], torch.arange(P)[None], cache, logits_at="last")
        cache.commit(P)
        caches[engine] = cache

    def run(engine: str, t: int) -> tuple[float, float]:
        set_engine(adapter, engine)
        wall, cpu = time.perf_counter(), time.process_time()
        # base=P: every call writes the same slots after the prefix, so every case sees the same context
        adapter.forward(
            ids[:, P : P + t], torch.arange(P, P + t)[None], caches[engine], logits_at="all", base=P
        )
        return time.perf_counter() - wall, time.process_time() - cpu

    cases = [(e, t) for t in range(1, max_t + 1) for e in ENGINES]
    times: dict[tuple[str, int], list[tuple[float, float]]] = {c: [] for c in cases}
    for c in cases:
        run(*c)
    for _ in range(args.reps):
        for c in cases:
            times[c].append(run(*c))
    lines = [
        f"Full forward over T new tokens after {P} tokens of context, logits at every position, "
        f"{torch.get_num_threads()} thread(s), median of {args.reps}; ms, and the cost relative to the "
        "one-token step of the same engine (wall time; CPU time in brackets):",
        "",
        "| T | " + " | ".join(f"{e} ms | {e}" for e in ENGINES) + " |",
        "|---:|" + "---:|---:|" * len(ENGINES),
    ]
    med = {c: [statistics.median(r[i] for r in v) for i in (0, 1)] for c, v in times.items()}
    for t in range(1, max_t + 1):
        cells = []
        for e in ENGINES:
            (w, c), (w1, c1) = med[(e, t)], med[(e, 1)]
            cells.append(f"{1e3 * w:.1f} | {w / w1:.2f} ({c / c1:.2f})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    model, tok = load_model(args.model, "float32", "cpu")
    adapter = adapter_for(model, fast_kernels=False)
    set_engine(adapter, "fused")
    print(
        f"torch {torch.__version__}, kernels: {kernels.isa()}, model: {model.config._name_or_path}, "
        f"CPU threads available: {torch.get_num_threads()}\n"
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"## {threads} thread(s)\n")
        if not args.skip_decode:
            print(decode_table(model, tok, adapter, args), end="\n\n", flush=True)
        print(forward_table(model, adapter, args), end="\n\n", flush=True)
    set_engine(adapter, "stock")


if __name__ == "__main__":
    main()
