"""Experiment tracking: what a run logs (the loggers themselves, W&B offline without credentials,
CSV, or none, are made by `framework.session.loggers.make_logger`).

Logged, whatever the number of methods (``run.py``'s one, ``bench.py``'s several): the
configuration; per prompt as it finishes (`prompt_metrics`), each method's tokens/s and, against
vanilla, its speedup, M, alpha, the lossless check and its strategies' scalar statistics; at the
end (`log_summary`), each method's ``<method>/speedup/<category>``, ``<method>/M``, ... and with
W&B the results table, the prompts with every method's output, a per-round trace (draft length,
accepted length, the skip set as a 2L-bit string, exit layer), each prompt's selector summary, the
report and the plots.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from framework.results.metrics import speedup


def prompt_metrics(recs: list[dict[str, Any]]) -> dict[str, float | str]:
    """Per-prompt metrics of one predict step's records, with the prompt's question id and
    category (so that a CSV row or a W&B step says which prompt it is): each method's
    ``prompt/<method>_tokens_per_s``; each speculative method's ``prompt/<method>_speedup`` (against
    vanilla), ``_M``, ``_alpha`` (none where nothing was drafted), ``_lossless`` (greedy checks
    only) and its strategies' scalar statistics, ``<method>/<strategy kind>/<name>``."""
    by = {r["method"]: r for r in recs if not r.get("error")}
    out: dict[str, float | str] = {}
    if recs:
        out["prompt/question_id"] = str(recs[0]["question_id"])
        out["prompt/category"] = str(recs[0]["category"])
    rate = {name: r["new_tokens"] / max(r["wall_time"], 1e-9) for name, r in by.items()}
    for name, r in by.items():
        out[f"prompt/{name}_tokens_per_s"] = rate[name]
        if name == "vanilla" or "vanilla" not in by:
            continue
        out[f"prompt/{name}_speedup"] = speedup([rate[name]], [rate["vanilla"]])
        rounds = r["accept_lengths"]
        out[f"prompt/{name}_M"] = sum(rounds) / len(rounds) if rounds else 0.0
        if r["drafted"]:  # nothing drafted: no acceptance rate (not 0)
            out[f"prompt/{name}_alpha"] = r["accepted"] / r["drafted"]
        if r.get("lossless") is not None:
            out[f"prompt/{name}_lossless"] = float(r["lossless"])
        summaries = (r.get("turns") or [{}])[-1].get("strategy_summary") or {}
        for kind, summary in summaries.items():  # scalars, and one level of nested dicts (the gate)
            for k, v in (summary or {}).items():
                items = v.items() if isinstance(v, dict) else [(None, v)]
                for sub, x in items:
                    if isinstance(x, (int, float)) and not isinstance(x, bool):
                        out[f"{name}/{kind}/{k}" + (f"/{sub}" if sub else "")] = float(x)
    return out


def round_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """Per-round trace rows: question, category, turn, round, drafted, committed, skip set, exit."""
    rows = []
    for rec in records:
        if rec["method"] == "vanilla" or rec.get("error") or rec.get("kind") == "hf":
            continue
        for t_i, turn in enumerate(rec["turns"]):
            plans = iter(zip(turn.get("plans", []), turn.get("exit_layers", []), strict=False))
            drafts = turn.get("draft_lengths") or [None] * len(turn["accept_lengths"])
            for r_i, (k, acc) in enumerate(zip(drafts, turn["accept_lengths"], strict=False)):
                plan, exit_layer = next(plans, (None, None)) if k else (None, None)
                rows.append([str(rec["question_id"]), rec["category"], t_i, r_i, k, acc, plan, exit_layer])
    return rows


def method_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """``{"<method>/speedup/<category>", "<method>/tokens_per_s", "<method>/M", ...}`` of a
    summary (`framework.benchmark.report.summarize`); ``<method>/gate_declined``: the share of
    rounds a draft gate declined (gated methods only)."""
    out: dict[str, float] = {}
    for label, e in summary["methods"].items():
        for cat, v in (e.get("speedup") or {}).items():
            out[f"{label}/speedup/{cat}"] = v
        for key in ("M", "alpha", "skip_ratio", "mismatches"):
            if isinstance(e.get(key), (int, float)):
                out[f"{label}/{key}"] = e[key]
        tps = (e.get("tokens_per_s") or {}).get("overall")
        if tps is not None:
            out[f"{label}/tokens_per_s"] = tps
        gate = e.get("gate")
        if gate and gate.get("rounds"):
            out[f"{label}/gate_declined"] = gate["declined"] / gate["rounds"]
    return out


class TrackingCallback(pl.Callback):
    """Logs each prompt's metrics (`prompt_metrics`) as it finishes; at the end every rank waits
    until all records are in the file."""

    def __init__(self) -> None:
        self.step = 0

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.logger is not None:
            metrics = prompt_metrics(outputs)
            if metrics:
                trainer.logger.log_metrics(metrics, step=self.step)
        self.step += 1

    def on_predict_end(self, trainer, pl_module) -> None:
        trainer.strategy.barrier()  # every rank's records are in the file


def log_summary(
    logger: Any,
    records: list[dict[str, Any]],
    summary: Mapping[str, Any],
    report: str,
    plots: Mapping[str, str],
    labels: list[str],
) -> None:
    """The run's end in the tracker: each method's ``<method>/...`` (`method_metrics`); with W&B
    also the results and prompts tables, the round trace, the selectors' summaries, the report and
    the plots."""
    if not records:
        return
    flat = method_metrics(summary)
    step = sum(1 for r in records if r["method"] == "vanilla")
    logger.log_metrics(flat, step=step)
    from pytorch_lightning.loggers import WandbLogger

    if isinstance(logger, WandbLogger):
        _wandb_extras(logger, records, summary, report, plots, labels, flat)


def _wandb_extras(
    logger: Any,
    records: list[dict[str, Any]],
    summary: Mapping[str, Any],
    report: str,
    plots: Mapping[str, str],
    labels: list[str],
    flat: dict[str, float],
) -> None:
    import wandb

    run = logger.experiment
    run.summary.update(flat)
    columns = ["method", "speedup", "tokens_per_s", "M", "alpha", "mismatches"]
    results = [
        [label, (e.get("speedup") or {}).get("overall"), (e.get("tokens_per_s") or {}).get("overall")]
        + [e.get("M"), e.get("alpha"), e.get("mismatches")]
        for label, e in summary["methods"].items()
    ]
    logger.log_table("results", columns=columns, data=results)
    by_prompt: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if not r.get("error") and r.get("repeat", 0) == 0:
            by_prompt.setdefault((r["category"], r["question_id"]), {})[r["method"]] = r
    texts = [
        [
            str(qid),
            cat,
            *("\n---\n".join(t["text"] for t in by[m]["turns"]) if m in by else None for m in labels),
        ]
        + [by[m].get("lossless") if m in by else None for m in labels[1:]]
        for (cat, qid), by in by_prompt.items()
    ]
    logger.log_table(
        "prompts",
        columns=["question_id", "category", *labels, *(f"{m} lossless" for m in labels[1:])],
        data=texts,
    )
    trace = round_rows(records)
    if trace:
        cols = ["question_id", "category", "turn", "round", "drafted", "committed", "skip_set", "exit_layer"]
        logger.log_table("rounds", columns=cols, data=trace)
    sel = [
        [
            str(r["question_id"]),
            r["category"],
            r["method"],
            t_i,
            json.dumps(t["strategy_summary"]["selector"]),
        ]
        for r in records
        if r["method"] != "vanilla" and not r.get("error")
        for t_i, t in enumerate(r["turns"])
        if (t.get("strategy_summary") or {}).get("selector")
    ]
    if sel:
        cols = ["question_id", "category", "method", "turn", "summary"]
        logger.log_table("selector_summary", columns=cols, data=sel)
    escaped = report.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    run.log({"report": wandb.Html(f"<pre>{escaped}</pre>")})
    for name, path in plots.items():
        logger.log_image(key=f"plots/{Path(path).stem}", images=[str(path)], caption=[name])
