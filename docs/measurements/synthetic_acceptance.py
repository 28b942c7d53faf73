"""The cost model checked at forced acceptances (issue 47, item 5): measured speed against the
cost model's prediction for the rounds each method ran, at synthetic acceptance P.

Each method runs with ``--synthetic-acceptance P`` (`framework.engine.synthetic`: every draft
token accepted with probability P from a seeded stream, whatever the target says) and its gate off
(every round drafts), interleaved with vanilla decoding in one benchmark (the pipeline: warm-up,
rotated order, the cost model measured after the warm-up). The prediction is the benchmark's "its
rounds" (`framework.results.metrics.rounds_prediction`): each round the method actually ran, with
its own draft length and its own context, priced by the measured cost model, against as many
plain steps. Its error is ``predicted / measured - 1``.

    python docs/measurements/synthetic_acceptance.py --presets static_confidence,layerskip_static \\
        --p 0.2,0.5,0.8 --limit 1 --max-new-tokens 96 --out runs/synthetic

The output of these runs is not the model's (the records say so); only their speed is used.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from framework.runner.pipeline import run as run_pipeline
from framework.session.run_config import RunConfig


def methods(presets: list[str], ps: list[float]) -> list:
    """The method sections: each preset at each P, its gate off (named ``<preset>@synthetic-P``)."""
    out = []
    for preset in presets:
        for p in ps:
            cfg = RunConfig.from_preset(
                preset, **{"gate.enabled": False, "synthetic_acceptance": p, "name": preset}
            )
            out.append(cfg.method)
    return out


def table(summary: dict, presets: list[str], ps: list[float]) -> tuple[str, list[dict]]:
    """The markdown table and its rows: per method, alpha measured, M, speedup measured and
    predicted, and the error."""
    rows = []
    lines = [
        "| preset | P | alpha (realised) | M | speedup measured | cost model, its rounds | error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for preset in presets:
        for p in ps:
            label = f"{preset}@synthetic-{p:g}"
            e = summary["methods"][label]
            measured = e["speedup"].get("overall")
            cm = e.get("cost_model") or {}
            predicted = cm.get("rounds")
            err = predicted / measured - 1 if measured and predicted else None
            rows.append(
                {
                    "preset": preset,
                    "p": p,
                    "alpha": e["alpha"],
                    "M": e["M"],
                    "measured": measured,
                    "predicted": predicted,
                    "error": err,
                }
            )
            lines.append(
                f"| {preset} | {p:g} | {e['alpha']:.3f} | {e['M']:.2f} | {measured:.3f}x | "
                + (f"{predicted:.3f}x | {err:+.1%} |" if err is not None else "n/a | n/a |")
            )
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--presets", default="static_confidence,layerskip_static")
    ap.add_argument("--p", default="0.2,0.5,0.8")
    ap.add_argument("--limit", type=int, default=1, help="prompts per category of the built-in suite")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/synthetic-acceptance")
    args = ap.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    ps = [float(p) for p in args.p.split(",") if p]
    cfg = RunConfig.of(
        model=args.model,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        logger="none",
        plots=False,
        threads=args.threads,
        methods=("vanilla", *methods(presets, ps)),
        repeats=args.repeats,
        output=args.out,
        cost_model="measure",
    )
    res = run_pipeline(cfg)
    text, rows = table(res["summary"], presets, ps)
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    text += f"\n\nMean absolute error {sum(errors) / max(1, len(errors)):.1%} over {len(errors)} methods."
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "synthetic_acceptance.md").write_text(text + "\n", encoding="utf-8")
    (Path(args.out) / "synthetic_acceptance.json").write_text(
        json.dumps(rows, indent=2) + "\n", encoding="utf-8"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
