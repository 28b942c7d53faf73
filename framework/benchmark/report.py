"""The benchmark's numbers and report: per-method summaries from the JSONL records, the markdown
tables, ``bench.md`` and the PNG plots."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from framework.benchmark.load import load_line
from framework.benchmark.story import what_happened
from framework.engine.cost_model import LOADED
from framework.results import plots
from framework.results.compare import mismatch_note
from framework.results.metrics import (
    aggregate,
    cost_model_prediction,
    gate_counts,
    rounds_prediction,
    speedup,
    synthetic_note,
)
from framework.session.methods import BASELINE
from framework.session.run_config import RunConfig
from framework.utils import align_markdown

#: At most this many rounds (of the first repeat) are drawn per method in the skip / exit-layer plots.
MAX_TRACE_ROUNDS = 5000


def _speedups(records: list[dict[str, Any]], method: str) -> dict[str, float]:
    """``{category: tok/s of method / tok/s of vanilla}`` (ratio of means) over ``records``."""
    out = {}
    for cat, by_method in aggregate(records).items():
        b, m = by_method.get(BASELINE), by_method.get(method)
        if b is None or m is None:
            continue
        out[cat] = speedup(m.tokens_per_s, b.tokens_per_s)
    return out


def _forced(records: Sequence[dict[str, Any]]) -> tuple[int, int] | None:
    """``(tokens the grammar forced, new tokens)`` of a method with a ``grammar_forced`` drafter
    (its turns' drafter summaries), or ``None``."""
    summaries = [
        (t.get("strategy_summary") or {}).get("drafter") or {} for r in records for t in r.get("turns", [])
    ]
    if not any("forced" in s for s in summaries):
        return None
    return sum(int(s.get("forced", 0)) for s in summaries), sum(int(r.get("new_tokens", 0)) for r in records)


def _alpha_cell(e: dict[str, Any]) -> str:
    """alpha, or why there is none: a gate that declined every round is not an acceptance of 0."""
    if e["alpha"] is not None:
        return f"{e['alpha']:.3f}"
    gate = e.get("gate")
    if gate and gate["rounds"] and gate["declined"] == gate["rounds"]:
        return "n/a (gate declined every round)"
    return "n/a"


def _gate_cell(e: dict[str, Any]) -> str:
    gate = e.get("gate")
    if not gate:
        return "off"
    return f"{gate['declined'] / gate['rounds']:.1%}" if gate["rounds"] else "n/a"


def summarize(records: list[dict[str, Any]], methods: Sequence[str], cost: Any = None) -> dict[str, Any]:
    """The numbers of the report, per method, from the JSONL records.

    ``cost``: a `CostModel`, or ``{method: CostModel}`` (each method priced with its own draft
    head, `CostModel.with_head`); ``None``: no prediction.

    Returns:
        ``{"categories": [...], "methods": {label: {...}}}`` where a method's entry has
        ``speedup`` ({category: mean over repeats of the ratio of means}), ``overall_by_repeat``,
        ``std`` / ``min`` / ``max`` of the overall speedup over repeats (None with one repeat),
        ``tokens_per_s`` ({category: mean tok/s over all repeats}), ``M``, ``alpha``,
        ``skip_ratio``, ``drafted``, ``prompts``, ``mismatches`` (distinct prompts that differ from
        vanilla in any repeat), ``mismatched`` (their ids), ``mismatch_at`` ({id: its first
        mismatch, with the target's top-1/top-2 margin there: `mismatch_note`}), ``error``, ``gate`` (`gate_counts`:
        rounds and declined rounds of the draft gate, ``None`` without one), ``graph_captures`` and
        ``capture_seconds`` (CUDA graphs recorded inside its timed decodes) and ``cost_model`` (the
        prediction at the measured alpha, for methods that drafted with our decoders).
    """
    ok = [r for r in records if not r.get("error")]
    errors = {r["method"]: r["error"] for r in records if r.get("error")}
    repeats = sorted({r["repeat"] for r in ok})
    agg = aggregate(ok)
    cats = list(agg)
    out: dict[str, Any] = {}
    for method in methods:
        per_rep = [_speedups([r for r in ok if r["repeat"] == rep], method) for rep in repeats]
        speed = {}
        for cat in cats:
            vals = [s[cat] for s in per_rep if cat in s]
            if vals:
                speed[cat] = sum(vals) / len(vals)
        overall = [s["overall"] for s in per_rep if "overall" in s]
        stats = agg.get("overall", {}).get(method)
        mine = [r for r in ok if r["method"] == method]
        # lossless None: not checked (a synthetic acceptance's output), never a mismatch
        bad = sorted({str(r["question_id"]) for r in mine if r.get("lossless") is False})
        where: dict[str, Any] = {}  # question id -> its first mismatch (first repeat that has one)
        for r in mine:
            if r.get("lossless") is False and r.get("first_mismatch"):
                where.setdefault(str(r["question_id"]), r["first_mismatch"])
        entry: dict[str, Any] = {
            "speedup": speed,
            "overall_by_repeat": overall,
            "std": statistics.stdev(overall) if len(overall) > 1 else None,
            "min": min(overall) if overall else None,
            "max": max(overall) if overall else None,
            "tokens_per_s": {c: agg[c][method].mean_tokens_per_s for c in cats if method in agg[c]},
            "M": stats.mean_accepted_length if stats else None,
            "alpha": stats.acceptance_rate if stats and stats.drafted else None,
            "skip_ratio": stats.skip_ratio if stats and stats.skip_rounds else None,
            "forwards_per_draft_token": stats.forwards_per_draft_token if stats else None,
            "drafted": stats.drafted if stats else 0,
            "prompts": len({str(r["question_id"]) for r in mine}),
            "mismatches": len(bad),
            "mismatched": bad,
            "mismatch_at": where,
            "error": errors.get(method),
            "gate": gate_counts(mine),
            "graph_captures": sum(t.get("graph_captures", 0) for r in mine for t in r.get("turns", [])),
            "capture_seconds": sum(t.get("capture_seconds", 0.0) for r in mine for t in r.get("turns", [])),
            "cost_model": None,
            "forced": _forced(mine),
            "synthetic": next(
                (r["synthetic_acceptance"] for r in mine if r.get("synthetic_acceptance") is not None), None
            ),
        }
        kind = mine[0].get("kind") if mine else None
        mcost = cost.get(method) if isinstance(cost, Mapping) else cost
        if getattr(mcost, "inconsistent", ""):  # no prediction from a loaded machine's costs
            entry["cost_model_unavailable"] = LOADED
        elif mcost is not None and stats and stats.drafted and kind == "preset":
            entry["cost_model"] = cost_model_prediction(
                mcost, stats.acceptance_rate, stats.skip_ratio, stats.forwards_per_draft_token
            )
            entry["cost_model"]["rounds"] = rounds_prediction(mcost, mine)
        out[method] = entry
    return {"categories": cats, "methods": out, "repeats": len(repeats)}


def _x(v: float | None) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}x"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def results_markdown(summary: dict[str, Any]) -> str:
    """The main table: per-category speedups, overall ± spread, tok/s, M, alpha, mismatches and the
    cost model's prediction."""
    cats = [c for c in summary["categories"] if c != "overall"]
    head = ["method", *cats, "**overall**", "spread (std; min-max)", "tok/s", "M", "alpha", "gate declined"]
    head += ["mismatches", "cost model: best fixed k / best fixed k >= 1 / its rounds"]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for method, e in summary["methods"].items():
        if e["error"] and not e["prompts"]:
            cells = ["error"] * (len(cats) + 1) + [_cell(f"ERROR: {e['error'][:160]}")] + ["n/a"] * 6
            rows.append(f"| {method} | " + " | ".join(cells) + " |")
            continue
        cells = [_x(e["speedup"].get(c)) for c in cats] + [f"**{_x(e['speedup'].get('overall'))}**"]
        if method == BASELINE:
            cells.append("n/a (baseline)")
        elif e["std"] is not None:
            cells.append(f"± {e['std']:.3f} ({e['min']:.3f}-{e['max']:.3f})")
        else:
            cells.append("n/a (1 run)")
        if e["error"]:
            cells[-1] += _cell(f"; ERROR after {e['prompts']} prompts: {e['error'][:120]}")
        tps = e["tokens_per_s"].get("overall")
        cells.append(f"{tps:.2f}" if tps is not None else "n/a")
        cells.append(f"{e['M']:.2f}" if e["M"] is not None else "n/a")
        cells.append(_alpha_cell(e))
        cells.append("n/a" if method == BASELINE else _gate_cell(e))
        checked = "n/a (synthetic)" if e.get("synthetic") is not None else f"{e['mismatches']}/{e['prompts']}"
        cells.append("baseline" if method == BASELINE else checked)
        cm = e["cost_model"]
        if cm:
            rounds = cm.get("rounds")
            cells.append(
                f"{cm['ceiling']:.3f}x (k={cm['ceiling_k']}) / {cm['drafting']:.3f}x (k={cm['drafting_k']})"
                + (f" / {rounds:.3f}x" if rounds is not None else "")
            )
        else:
            cells.append(e.get("cost_model_unavailable") or "n/a")
        rows.append(f"| {method} | " + " | ".join(cells) + " |")
    return align_markdown("\n".join(rows))


def tokens_per_s_markdown(summary: dict[str, Any]) -> str:
    cats = summary["categories"]
    rows = ["| method | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for method, e in summary["methods"].items():
        vals = [e["tokens_per_s"].get(c) for c in cats]
        rows.append(f"| {method} | " + " | ".join("n/a" if v is None else f"{v:.2f}" for v in vals) + " |")
    return align_markdown("\n".join(rows))


def _notes(summary: dict[str, Any]) -> list[str]:
    """The notes under the tables: failed methods, and where a method differs from vanilla."""
    notes = []
    for method, e in summary["methods"].items():
        if e["error"]:
            notes.append(f"- **{method} failed**: `{_cell(e['error'])}`")
        if e.get("forced") is not None:
            forced, total = e["forced"]
            notes.append(
                f"- {method}: {forced} of {total} tokens ({forced / max(1, total):.0%}) drafted as grammar-forced "
                "runs (no draft forward; verified)"
            )
        if e.get("synthetic") is not None:
            notes.append(f"- **{method}: {synthetic_note(e['synthetic'])}**")
        if e["mismatches"] and method != BASELINE:
            at = e.get("mismatch_at") or {}
            ids = ", ".join(mismatch_note(q, at.get(q)) for q in e["mismatched"][:20])
            n = max(1, e["prompts"])
            ties = sum(bool((at.get(q) or {}).get("near_tie")) for q in e["mismatched"])
            other = e["mismatches"] - ties
            notes.append(
                f"- {method}: {e['mismatches']} prompt(s) differ from vanilla ({e['mismatches']}/{e['prompts']}, "
                f"mismatch rate {e['mismatches'] / n:.0%}; near-ties {ties}/{e['prompts']} ({ties / n:.0%}), "
                f"other differences {other}/{e['prompts']} ({other / n:.0%})): {ids}"
            )
    return notes


def graphs_line(graphs: tuple[int, float], summary: dict[str, Any]) -> str:
    """The report's line on CUDA graphs: recorded before timing, and recorded inside timed decodes
    per method (0 everywhere when the run recorded every graph it needed beforehand)."""
    n, seconds = graphs
    methods = summary.get("methods", {})
    timed = ", ".join(
        f"{m} {s.get('graph_captures', 0)} ({s.get('capture_seconds', 0.0):.2f} s)"
        for m, s in methods.items()
    )
    return f"- CUDA graphs: {n} recorded before timing ({seconds:.1f} s); recorded while timed: {timed or 'none'}"


#: The report's explanation of its table.
LEGEND = (
    "Speedup = mean tokens/s of the method / mean tokens/s of our vanilla baseline (ratio of means), "
    "interleaved on the same prompts; with several repeats, the mean over repeats of each repeat's "
    "ratio. M = tokens per verification round, bonus included. Gate declined = share of rounds the "
    "draft gate turned into plain steps ('off': no gate; a ':raw' row is its method with the gate off, "
    "`--raw`). Mismatches = prompts whose tokens "
    "differ from vanilla greedy decoding. The cost model column: the best speedup the measured cost "
    "model predicts for a fixed draft length k at the method's measured alpha and skip ratio (over "
    "k = 0..16, and over k >= 1), assuming i.i.d. acceptance; not a ceiling: a length controller "
    "that stops where the draft is unsure can beat it. Then what the cost model predicts for the "
    "rounds the method actually ran (its draft lengths, plans and verified blocks; measured / this "
    "= the engine's efficiency)."
)


#: What the reports put before each method's `HostWorkReport.line`.
HOST_WORK_HEAD = "host work (counted in the first warm-up decode, not timed):"


def head_line(method: str, cost: Any) -> str:
    """What a method's own cost model (`framework.runner.pipeline.head_costs`) prices: its draft
    head (reduced, or the full LM head) and weights, and what a draft step costs before any layer."""
    head = f"a {cost.draft_vocab}-token head" if cost.draft_vocab else "the full LM head"
    weights = "" if cost.draft_weights == "float32" else f" and {cost.draft_weights} weights"
    return (
        f"- {method} drafts with {head}{weights}: its draft step costs {cost.base * 1e3:.2f} ms before any "
        f"sub-layer (final norm + head {cost.head * 1e3:.2f} ms, the full head {cost.full_head * 1e3:.2f} ms)"
    )


def cost_lines(cost: Any, heads: Mapping[str, Any] | None) -> list[str]:
    """The report header's lines on the cost model and each method's own draft head
    (`head_line`); one line saying why there is no prediction when the costs were measured on a
    loaded machine (`CostModel.inconsistent`)."""
    if cost is None:
        return []
    if getattr(cost, "inconsistent", ""):
        return [f"- cost model ({cost.device}): {LOADED} ({cost.inconsistent}); no prediction is reported"]
    lines = [f"- cost model ({cost.device}, context {cost.context}): {cost.describe()}"]
    return lines + [head_line(m, c) for m, c in (heads or {}).items() if not getattr(c, "inconsistent", "")]


def data_line(cfg: RunConfig, n_prompts: int, elapsed: float, resumed: int = 0) -> str:
    """The report's header line on what was decoded, how, and for how long."""
    d = cfg.data
    return (
        f"- data: {d.path or 'built-in suite'}; {n_prompts} prompts"
        + (f" (at most {d.limit} per category)" if d.limit else "")
        + (f" (after the first {d.offset} of each)" if d.offset else "")
        + f"; max_new_tokens {cfg.generation.max_new_tokens}; dtype {cfg.model.dtype}; greedy, batch 1; "
        f"warm-up {cfg.runner.warmup} generation(s) per method; {cfg.compare.repeats} repeat(s); "
        f"{elapsed:.0f} s timed"
        + (f" ({resumed} prompt(s) decoded before, by the run --resume continued)" if resumed else "")
    )


def render_report(
    cfg: RunConfig,
    summary: dict[str, Any],
    env: dict[str, Any],
    n_prompts: int,
    elapsed: float,
    plots: dict[str, str],
    hf: dict[str, str],
    cost: Any,
    heads: Mapping[str, Any] | None = None,
    method_costs: Mapping[str, Any] | None = None,
    graphs: tuple[int, float] | None = None,
    run_notes: Mapping[str, list[str]] | None = None,
    load: Mapping[str, Any] | None = None,
    warnings: Sequence[str] = (),
    host_work: Sequence[str] = (),
    resumed: int = 0,
    breakdown: str = "",
) -> str:
    """The run's markdown report (``run.py``'s one method and ``bench.py``'s several alike). ``heads``: the cost models of methods that draft with a
    reduced head (`CostModel.with_head`), described under the full one. ``method_costs``: the cost
    model each method was priced with, for the plain-language reading under the table
    (`framework.benchmark.story.what_happened`). ``graphs``: with ``--cuda-graphs``, the graphs
    recorded before timing and their seconds (the records say how many were recorded while timed).
    ``run_notes``: what each method cannot do as configured (`framework.session.notes`), listed
    under the story. ``load``: the machine's load while timed (`framework.benchmark.load`), a
    header line; ``warnings``: why the timings may not be trusted, in the header and the story.
    ``host_work``: each speculative method's host work a round (`HostWorkReport.line`), header
    lines. ``resumed``: prompts an earlier, interrupted run decoded (``--resume``). ``breakdown``:
    where each method's time went (`framework.results.metrics.time_breakdown`)."""
    gpu = f", GPU {env['cuda']}" if env.get("cuda") else ""
    lines = [
        "# Benchmark",
        "",
        f"- command: `{cfg.compare.command or '(called from Python)'}`",
        f"- machine: {env['cpu']}, {env['cpu_count']} cores, torch threads {env['torch_threads']}{gpu}",
        f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
        data_line(cfg, n_prompts, elapsed, resumed),
    ]
    lines.append(load_line(load))
    lines += [f"- **warning**: {w}" for w in warnings]
    if hf:
        lines.append("- HF methods: " + "; ".join(f"{k}: {v}" for k, v in hf.items()))
    if graphs is not None:
        lines.append(graphs_line(graphs, summary))
    lines += cost_lines(cost, heads)
    lines += [f"- {HOST_WORK_HEAD} {line}" for line in host_work]
    lines += [
        "",
        LEGEND,
        "",
        results_markdown(summary),
        "",
        "What happened:",
        "",
        *(f"- **These timings may not be trustworthy**: {w}." for w in warnings),
        what_happened(summary, method_costs),
        *(
            f"- **{label}**, as configured: {note}"
            for label, notes in (run_notes or {}).items()
            for note in notes
        ),
        "",
        "Tokens/s by category (mean over prompts and repeats):",
        "",
        tokens_per_s_markdown(summary),
    ]
    if breakdown:
        lines += ["", "Where the time goes (share of wall time):", "", breakdown]
    notes = _notes(summary)
    if notes:
        lines += ["", *notes]
    if plots:
        lines += ["", "Plots:", ""] + [f"![{name}]({Path(p).name})" for name, p in plots.items()]
    return "\n".join(lines) + "\n"


def make_plots(
    out_dir: Path,
    summary: dict[str, Any],
    records: list[dict[str, Any]],
    num_layers: int,
) -> dict[str, str]:
    """The benchmark's PNGs: speedup by category, accepted tokens per round, and for our methods
    the draft's plan over the rounds of the first repeat (`GenerationResult.plans` /
    ``exit_layers``): the exit layer per round for early-exit drafting, else the skip set per round
    (for a static selector the same set on every row): ``exit_layer_<method>.png`` or
    ``skip_<method>.png``."""
    out: dict[str, str] = {}
    rows = {m: e["speedup"] for m, e in summary["methods"].items() if m != BASELINE and e["speedup"]}
    out["speedup by category"] = str(plots.speedup_by_category(rows, out_dir / "speedup_by_category.png"))
    lengths: dict[str, list[int]] = {}
    codes: dict[str, list[str]] = {}
    exits: dict[str, list[int | None]] = {}
    for r in records:
        if r.get("error"):
            continue
        if r.get("drafted"):
            lengths.setdefault(r["method"], []).extend(r["accept_lengths"])
        if r.get("kind") == "preset" and r["repeat"] == 0:
            for t in r["turns"]:
                codes.setdefault(r["method"], []).extend(t.get("plans") or [])
                exits.setdefault(r["method"], []).extend(t.get("exit_layers") or [])
    out["accepted tokens per round"] = str(
        plots.accept_length_histogram(lengths, out_dir / "accept_lengths.png")
    )
    for method, plan_codes in codes.items():
        if not plan_codes:
            continue
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in method)
        exit_layers = exits.get(method, [])[:MAX_TRACE_ROUNDS]
        if any(e is not None for e in exit_layers):
            name = f"exit_layer_{safe}.png"
            p = plots.exit_layer_over_time(exit_layers, num_layers, out_dir / name)
            out[f"{method}: exit layer per round"] = str(p)
        elif len(set(plan_codes)) > 1 or len(codes) == 1:  # one method: its skip set even when constant
            rows_bits = [[int(c) for c in code] for code in plan_codes[:MAX_TRACE_ROUNDS]]
            name = f"skip_{safe}.png"
            p = plots.skip_heatmap(rows_bits, num_layers, out_dir / name, title=method)
            out[f"{method}: skip set per round"] = str(p)
    return out


__all__ = [
    "head_line",
    "make_plots",
    "render_report",
    "results_markdown",
    "summarize",
    "tokens_per_s_markdown",
]
