"""Engine speed of two checkouts of this repository, interleaved: did a change make decoding slower?

A refactor must not cost speed, but two versions of the same packages cannot share one process.
This script alternates processes instead: for each of ``--pairs`` pairs it runs the measurement
once with checkout A on ``PYTHONPATH`` and once with checkout B (which one goes first alternates),
and reports each pair's ratio B / A and the median of the ratios, so that slow drift on a shared
machine hits both alike. One measurement (``--child``) loads the model, warms up, then times
``--reps`` interleaved repetitions of plain greedy decoding (`VanillaDecoder`) and of one
self-speculative method (``static`` selector at skip ratio 0.2, ``confidence`` length,
``layer_skip``, ``greedy``) over four chat prompts of ``--tokens`` new tokens each, and prints
the medians in ms per new token. It uses only interfaces both layouts of the engine have (before
and after the architecture step of issue 30).

    git worktree add /tmp/base <commit>
    python docs/measurements/checkout_ab.py /tmp/base . --pairs 4

Run it on an otherwise idle machine: another process on one of two cores can make a step several
times slower, and then only the paired ratios mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPTS = (
    "Explain what a KV cache is in two sentences.",
    "Write a Python function that reverses a list.",
    "Translate to French: The weather is nice today.",
    "What is 17 times 23? Show your steps.",
)


def child(args: argparse.Namespace) -> dict[str, float]:
    """One measurement with whatever ``framework`` is importable; ms per new token, medians."""
    import torch

    torch.set_num_threads(args.threads)
    try:  # the layout after the architecture step, then the one before it
        from framework.data.prompts import encode_chat
        from framework.models.loading import load_model
    except ImportError:
        from framework.experiment.data import encode_chat  # type: ignore[no-redef]
        from framework.experiment.models import load_model  # type: ignore[no-redef]
    try:
        from framework.experiment.plugins import load_builtin_strategies  # before: an explicit loader

        load_builtin_strategies()
    except ImportError:
        pass  # after: the registries load the built-ins on first lookup
    from framework import (
        REGISTRIES,
        build_config,  # every layout exports it (framework.config_fields, was .config)
    )
    from framework.engine.adapter import adapter_for
    from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder

    model, tok = load_model(args.model, "float32", "cpu")
    adapter = adapter_for(model)

    def make(kind: str, name: str, **fields):
        entry = REGISTRIES[kind].entry(name)
        return entry.cls(build_config(entry.config, fields))

    decoders = {
        "vanilla": VanillaDecoder(adapter),
        "static": SpeculativeDecoder(
            adapter,
            make("selector", "static", skip_ratio=0.2),
            make("length", "confidence"),
            make("drafter", "layer_skip"),
            make("verifier", "greedy"),
        ),
    }
    for name in args.preset or ():  # a preset as run.py builds it (its draft head, weights), gate off
        from framework.session.run_config import RunConfig
        from framework.session.session import Session

        cfg = RunConfig.from_preset(name, **{"gate.enabled": False, "logger": "none"})
        decoders[name] = Session(cfg, model, tok, log=lambda m: None).spec
    prompts = [torch.tensor([encode_chat(tok, [{"role": "user", "content": t}])]) for t in PROMPTS]
    stop = StopCondition(args.tokens)  # no EOS: every run decodes the same number of tokens
    for dec in decoders.values():
        dec.generate(prompts[0], stop)
    ms: dict[str, list[float]] = {name: [] for name in decoders}
    for rep in range(args.reps):
        names = list(decoders) if rep % 2 == 0 else list(reversed(decoders))
        for name in names:
            results = [decoders[name].generate(p, stop) for p in prompts]
            ms[name].append(1e3 * sum(r.wall_time for r in results) / sum(r.new_tokens for r in results))
    return {name: statistics.median(v) for name, v in ms.items()}


def run(checkout: Path, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve()))
    cmd = [sys.executable, __file__, "--child", "--model", args.model or "", "--tokens", str(args.tokens)]
    cmd += ["--reps", str(args.reps), "--threads", str(args.threads)]
    cmd += [x for name in args.preset or () for x in ("--preset", name)]
    out = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkouts", nargs="*", type=Path, help="checkout A (before), checkout B (after)")
    ap.add_argument("--pairs", type=int, default=4, help="A/B pairs (default 4)")
    ap.add_argument("--model", default=None, help="a named model or path (default: the default model)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per process (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--preset", action="append", help="also time this preset, gate off (repeatable)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or None
    if args.child:
        print(json.dumps(child(args)))
        return
    if len(args.checkouts) != 2:
        ap.error("give two checkouts: A (before) and B (after)")
    a, b = args.checkouts
    ratios: dict[str, list[float]] = {}
    print("| pair | method | A ms/token | B ms/token | B / A |\n|---:|---|---:|---:|---:|")
    for i in range(args.pairs):
        order = [(a, "A"), (b, "B")] if i % 2 == 0 else [(b, "B"), (a, "A")]
        got = {tag: run(path, args) for path, tag in order}
        for name in got["A"]:
            r = got["B"][name] / got["A"][name]
            ratios.setdefault(name, []).append(r)
            print(f"| {i + 1} | {name} | {got['A'][name]:.2f} | {got['B'][name]:.2f} | {r:.3f} |", flush=True)
    for name, rs in ratios.items():
        print(
            f"\n{name}: median B / A {statistics.median(rs):.3f} over {len(rs)} pairs ({', '.join(f'{r:.3f}' for r in rs)})"
        )


if __name__ == "__main__":
    main()
