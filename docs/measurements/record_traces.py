"""Acceptance traces from a real run: what every round drafted and accepted, for replay elsewhere.

A benchmark (or run) on a real model records, for every round of every decode, how many tokens
were drafted, how many tokens the verification committed and the skip ratio of the plan that
drafted them (`framework.results.records.turn_record`). This script keeps exactly those three
numbers per round, per method, in a small JSON file, so that `gpu_e2e.py --trace FILE` can
replay them on a random model of a larger shape: the draft lengths, the accepted lengths and the
skipped share of the sub-layers are the real model's, the costs are the larger shape's.

    python experiments/bench.py --methods vanilla,clasp,del,swift,static_confidence --raw \\
        --preset-args 'swift=--verifier greedy' \\
        --preset-args 'static_confidence=--drafter.draft_weights float32' \\
        --limit 1 --max-new-tokens 128 --repeats 1 --no-plots --out runs/traces-smollm2
    python docs/measurements/record_traces.py runs/traces-smollm2 \\
        --out docs/measurements/traces/smollm2-135m.json

Only the first repeat of each method is kept; the baseline rows (``vanilla``, ``hf_*``) have no
rounds and are left out. A file holds one model's traces; its ``source`` says which model, dtype,
device and command recorded them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: Rows of a benchmark that are not speculative (no rounds to trace).
BASELINES = ("vanilla",)


def turn_rounds(turn: dict[str, Any]) -> list[list[float]]:
    """``[drafted, committed, skip_ratio]`` for every round of one turn record.

    ``draft_lengths`` lists every round (0: a declined round, a plain step), ``accept_lengths``
    every round's committed tokens, ``skip_ratios`` only the rounds that drafted.

    Raises:
        ValueError: the three lists do not describe the same rounds.
    """
    drafted, committed, ratios = turn["draft_lengths"], turn["accept_lengths"], turn["skip_ratios"]
    drafting = sum(1 for d in drafted if d > 0)
    if len(drafted) != len(committed) or drafting != len(ratios):
        raise ValueError(
            f"a turn has {len(drafted)} draft lengths, {len(committed)} committed lengths and "
            f"{len(ratios)} skip ratios for {drafting} drafting rounds; they must describe the same rounds"
        )
    it = iter(ratios)
    rounds = []
    for d, c in zip(drafted, committed, strict=True):
        if not 1 <= c <= d + 1:
            raise ValueError(f"a round drafted {d} tokens and committed {c}; allowed: 1..{d + 1}")
        rounds.append([d, c, round(next(it), 3) if d > 0 else 0.0])
    return rounds


def traces(records: list[dict[str, Any]], methods: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per method label: its summary, ``turns`` (the rounds of each decode, in order) and its
    rounds (every prompt and turn, in order) as three parallel lists: ``drafted``, ``committed``
    and ``plan`` (an index into ``skip_ratios``; a declined round's is -1)."""
    rounds_of: dict[str, list[list[float]]] = {}
    turns_of: dict[str, list[int]] = {}
    for rec in records:
        name = rec["method"]
        if name in BASELINES or name.startswith("hf_") or rec.get("repeat", 0) != 0:
            continue
        if methods is not None and name not in methods:
            continue
        for turn in rec["turns"]:
            rounds = turn_rounds(turn)
            rounds_of.setdefault(name, []).extend(rounds)
            turns_of.setdefault(name, []).append(len(rounds))
    if methods is not None and (missing := sorted(set(methods) - set(rounds_of))):
        raise ValueError(f"no rounds of {missing} in the records; methods there: {sorted(rounds_of)}")
    out: dict[str, dict[str, Any]] = {}
    for name, rounds in rounds_of.items():
        drafted = [int(r[0]) for r in rounds]
        committed = [int(r[1]) for r in rounds]
        ratios = sorted({r[2] for r in rounds if r[0] > 0})
        out[name] = {
            "rounds": len(rounds),
            "alpha": round(sum(c - 1 for c in committed) / max(1, sum(drafted)), 4),
            "M": round(sum(committed) / max(1, len(rounds)), 4),
            "declined": round(drafted.count(0) / max(1, len(rounds)), 4),
            "turns": turns_of[name],
            "skip_ratios": ratios,
            "drafted": drafted,
            "committed": committed,
            "plan": [ratios.index(r[2]) if r[0] > 0 else -1 for r in rounds],
        }
    return out


def dumps(doc: dict[str, Any]) -> str:
    """``doc`` as JSON with every list on one line (a trace file stays a few KB and diffable)."""
    lines = ["{", f' "source": {json.dumps(doc["source"], indent=None)},', ' "methods": {']
    names = list(doc["methods"])
    for i, name in enumerate(names):
        fields = [
            f'   "{k}": {json.dumps(v, separators=(",", ":"))}' for k, v in doc["methods"][name].items()
        ]
        lines += [f'  "{name}": {{', ",\n".join(fields), "  }" + ("," if i < len(names) - 1 else "")]
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a benchmark's output directory (records.jsonl, meta.json)")
    ap.add_argument("--out", type=Path, required=True, help="the trace file to write (JSON)")
    ap.add_argument("--methods", default=None, help="comma-separated method labels (default: all)")
    args = ap.parse_args()
    records = [json.loads(line) for line in (args.run / "records.jsonl").read_text().splitlines() if line]
    meta = json.loads((args.run / "meta.json").read_text())
    env, cfg = meta.get("environment", {}), meta["config"]
    dtype = cfg.get("dtype", "auto")
    if dtype == "auto":  # what --dtype auto resolves to
        dtype = "bfloat16" if env.get("cuda") else "float32"
    methods = args.methods.split(",") if args.methods else None
    doc = {
        "source": {
            "command": cfg["command"],
            "model": cfg.get("model") or "smollm2-135m-instruct",
            "dtype": dtype,
            "device": env.get("cuda") or env.get("cpu"),
            "torch": env.get("torch"),
            "prompts": len({(r["category"], r["question_id"]) for r in records}),
            "max_new_tokens": cfg["max_new_tokens"],
            "fields": "turns: rounds of each decode; per round: drafted (0: declined, a plain step), "
            "committed (accepted + 1), plan (index into skip_ratios, the skipped share of the "
            "draft's sub-layers; -1: none)",
        },
        "methods": traces(records, methods),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(doc))
    assert json.loads(args.out.read_text()) == doc
    for name, entry in doc["methods"].items():
        print(
            f"{name}: {entry['rounds']} rounds, alpha {entry['alpha']}, M {entry['M']}, declined {entry['declined']}"
        )


if __name__ == "__main__":
    main()
