"""The host-work table of issue 56: operations and host reads a round outside the forwards, by
preset, on the real default model (SmolLM2-135M-Instruct, float32, CPU; two chat prompts of 32 new
tokens; the gate off; the presets' own reduced draft heads), counted as
`tests/framework/engine/test_host_work.py` counts them (its `_per_round` with ``drafting=True``).

    python docs/measurements/issue56/host_work_table.py [--presets a,b,...]

Run it from the checkout to measure (``PYTHONPATH=<checkout>`` for another one). It counts, it does
not time: other processes do not change its numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch


def _test_module():
    """The host-work tests of the checkout on ``sys.path`` (their budgets and their counting)."""
    import framework

    path = Path(framework.__file__).resolve().parents[1] / "tests/framework/engine/test_host_work.py"
    spec = importlib.util.spec_from_file_location("host_work_tests", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["host_work_tests"] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="", help="comma-separated (default: every budgeted preset)")
    args = ap.parse_args()
    from framework.data.prompts import encode_chat
    from framework.models.loading import load_model

    tests = _test_module()
    model, tok = load_model(None, "float32", "cpu")
    texts = ["Write a short poem about the sea.", "Explain what a hash table is in two sentences."]
    prompts = [torch.tensor([encode_chat(tok, [{"role": "user", "content": t}])]) for t in texts]
    names = [n for n in args.presets.split(",") if n] or sorted(tests.BUDGETS)
    print(
        "| preset | rounds | operations a round | host reads a round | of them, a stop rule's a round | reads outside the steps a round |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        work = tests._per_round(
            name, drafting=True, model=model, prompts=prompts, prepared=tests._REAL_PREPARED
        )
        ops, reads = work.per_round()
        steps = work.step_reads / work.rounds
        print(
            f"| {name} | {work.rounds} | {ops:.2f} | {reads:.2f} | {steps:.2f} | {reads - steps:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
