"""Experiment tracking: what the runner logs, and the run's plots (the loggers themselves, W&B and
CSV, are made by `framework.session.loggers.make_logger`).

``--logger wandb`` uses Lightning's `WandbLogger`. Without an API key (``WANDB_API_KEY``, or a
``api.wandb.ai`` entry in ``~/.netrc`` as ``wandb login`` writes it) the run is offline: it is
written under ``<run dir>/wandb/offline-run-*`` and uploaded later with ``wandb sync DIR``; a fresh
machine never gets a login prompt and never waits on the network. ``WANDB_MODE`` (``online``,
``offline``, ``disabled``) overrides the choice. When a W&B run is already active (a sweep agent
calling the training function), the logger attaches to it instead of starting another.

Logged: the configuration; per prompt, tokens/s of both methods, speedup, M, alpha, the lossless
check and the selector's scalar statistics; at the end, the per-category and overall summary, a
table of prompts with both outputs, a per-round trace (draft length, accepted length, the skip set
as a 2L-bit string, exit layer), each prompt's selector summary (chosen sets, matchness, DP cosine,
exit layers), and the plots, which are also saved as PNG in ``<run dir>/plots``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from framework.results import plots
from framework.results.metrics import aggregate


def summary_metrics(records: list[dict[str, Any]], method: str) -> dict[str, dict[str, float]]:
    """``{category or "overall": {metric: value}}`` of ``method`` against vanilla."""
    out: dict[str, dict[str, float]] = {}
    for cat, by_method in aggregate(records).items():
        b, m = by_method.get("vanilla"), by_method.get(method)
        if b is None:
            continue
        row = {"prompts": b.prompts, "vanilla_tokens_per_s": b.mean_tokens_per_s}
        if m is not None and method != "vanilla":
            row.update(
                tokens_per_s=m.mean_tokens_per_s,
                speedup=m.mean_tokens_per_s / b.mean_tokens_per_s if b.mean_tokens_per_s else float("nan"),
                mean_accepted_length=m.mean_accepted_length,
                acceptance_rate=m.acceptance_rate,
                skip_ratio=m.skip_ratio,
            )
            if m.lossless_checked:
                row["lossless_share"] = m.lossless / m.lossless_checked
            # the target's top-1/top-2 margin at each first mismatch: near-ties (rounding flips,
            # expected on a GPU or in bfloat16) apart from the rest (bugs)
            bad = [
                r.get("first_mismatch") or {}
                for r in records
                if r["method"] == method and r.get("lossless") is False and cat in ("overall", r["category"])
            ]
            if bad:
                margins = [w["margin"] for w in bad if w.get("margin") is not None]
                row["mismatches"] = len(bad)
                row["near_tie_mismatches"] = sum(bool(w.get("near_tie")) for w in bad)
                if margins:
                    row["min_mismatch_margin"] = min(margins)
                    row["max_mismatch_margin"] = max(margins)
        out[cat] = row
    return out


def prompt_metrics(recs: list[dict[str, Any]]) -> dict[str, float | str]:
    """Per-prompt metrics of one predict step's records (vanilla first or second), with the
    prompt's question id and category (so that a CSV row or a W&B step says which prompt it is);
    no acceptance rate for a prompt where nothing was drafted."""
    by = {r["method"]: r for r in recs}
    van = by.get("vanilla")
    out: dict[str, float | str] = {}
    if recs:
        out["prompt/question_id"] = str(recs[0]["question_id"])
        out["prompt/category"] = str(recs[0]["category"])
    for name, r in by.items():
        tag = "vanilla" if name == "vanilla" else "method"
        out[f"prompt/{tag}_tokens_per_s"] = r["new_tokens"] / max(r["wall_time"], 1e-9)
    spec = next((r for n, r in by.items() if n != "vanilla"), None)
    if spec is not None and van is not None:
        out["prompt/speedup"] = float(out["prompt/method_tokens_per_s"]) / max(
            float(out["prompt/vanilla_tokens_per_s"]), 1e-9
        )
        rounds = spec["accept_lengths"]
        out["prompt/mean_accepted_length"] = sum(rounds) / len(rounds) if rounds else 0.0
        if spec["drafted"]:  # nothing drafted: no acceptance rate (not 0)
            out["prompt/acceptance_rate"] = spec["accepted"] / spec["drafted"]
        if spec["lossless"] is not None:
            out["prompt/lossless"] = float(spec["lossless"])
        summaries = spec["turns"][-1].get("strategy_summary") or {}
        for kind, summary in summaries.items():  # scalars, and one level of nested dicts (the gate)
            for k, v in (summary or {}).items():
                items = v.items() if isinstance(v, dict) else [(None, v)]
                for sub, x in items:
                    if isinstance(x, (int, float)) and not isinstance(x, bool):
                        out[f"{kind}/{k}" + (f"/{sub}" if sub else "")] = float(x)
    return out


def round_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """Per-round trace rows: question, category, turn, round, drafted, committed, skip set, exit."""
    rows = []
    for rec in records:
        if rec["method"] == "vanilla":
            continue
        for t_i, turn in enumerate(rec["turns"]):
            plans = iter(zip(turn.get("plans", []), turn.get("exit_layers", []), strict=False))
            drafts = turn.get("draft_lengths") or [None] * len(turn["accept_lengths"])
            for r_i, (k, acc) in enumerate(zip(drafts, turn["accept_lengths"], strict=False)):
                plan, exit_layer = next(plans, (None, None)) if k else (None, None)
                rows.append([rec["question_id"], rec["category"], t_i, r_i, k, acc, plan, exit_layer])
    return rows


def save_plots(records: list[dict[str, Any]], method: str, plot_dir: Path) -> list[Path]:
    """The run's plots as PNG files in ``plot_dir`` (the ones its data supports)."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    summary = summary_metrics(records, method)
    if method != "vanilla" and any("speedup" in row for row in summary.values()):
        rows = {method: {cat: row["speedup"] for cat, row in summary.items() if "speedup" in row}}
        paths.append(Path(plots.speedup_by_category(rows, plot_dir / "speedup_by_category.png")))
    merged: dict[str, list[int]] = {}
    for r in records:
        if r["method"] != "vanilla":
            merged.setdefault(r["method"], []).extend(r["accept_lengths"])
    if any(merged.values()):
        paths.append(Path(plots.accept_length_histogram(merged, plot_dir / "accept_lengths.png")))
    plans = [
        list(map(int, p))
        for r in records
        if r["method"] != "vanilla"
        for t in r["turns"]
        for p in t.get("plans", [])
    ]
    if plans:
        n = len(plans[0]) // 2
        paths.append(Path(plots.skip_heatmap(plans, n, plot_dir / "skip_sets.png", title=method)))
        exits = [
            e
            for r in records
            if r["method"] != "vanilla"
            for t in r["turns"]
            for e in t.get("exit_layers", [])
        ]
        if any(e is not None for e in exits):
            paths.append(Path(plots.exit_layer_over_time(exits, n, plot_dir / "exit_layers.png")))
    return paths


class TrackingCallback(pl.Callback):
    """Logs per-prompt metrics as prompts finish and the run's summary, tables and plots at the end."""

    def __init__(self, out_path: Path, method: str, plot_dir: Path | None, read_records) -> None:
        self.out_path = out_path
        self.method = method
        self.plot_dir = plot_dir
        self.read_records = read_records
        self.step = 0
        self.plot_paths: list[Path] = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.logger is not None:
            metrics = prompt_metrics(outputs)
            if metrics:
                trainer.logger.log_metrics(metrics, step=self.step)
        self.step += 1

    def on_predict_end(self, trainer, pl_module) -> None:
        trainer.strategy.barrier()  # every rank's records are in the file
        if trainer.global_rank != 0:
            return
        records = self.read_records(self.out_path)
        if self.plot_dir is not None and records:
            self.plot_paths = save_plots(records, self.method, self.plot_dir)
        logger = trainer.logger
        if logger is None or not records:
            return
        summary = summary_metrics(records, self.method)
        flat = {f"summary/{cat}/{k}": v for cat, row in summary.items() for k, v in row.items()}
        logger.log_metrics(flat, step=self.step)
        from pytorch_lightning.loggers import WandbLogger

        if isinstance(logger, WandbLogger):
            self._wandb_extras(logger, records, flat)

    def _wandb_extras(self, logger: Any, records: list[dict[str, Any]], flat: dict[str, float]) -> None:
        run = logger.experiment
        run.summary.update(flat)
        by_prompt: dict[tuple, dict[str, dict]] = {}
        for r in records:
            by_prompt.setdefault((r["category"], r["question_id"]), {})[r["method"]] = r
        rows = []
        for (cat, qid), by in by_prompt.items():
            van, spec = by.get("vanilla"), by.get(self.method)
            rows.append(
                [
                    qid,
                    cat,
                    "\n---\n".join(t["text"] for t in van["turns"]) if van else None,
                    "\n---\n".join(t["text"] for t in spec["turns"]) if spec else None,
                    spec.get("lossless") if spec else None,
                    (spec["new_tokens"] / spec["wall_time"]) / (van["new_tokens"] / van["wall_time"])
                    if spec and van and spec["wall_time"] and van["wall_time"]
                    else None,
                ]
            )
        logger.log_table(
            "prompts",
            columns=["question_id", "category", "vanilla", self.method, "lossless", "speedup"],
            data=rows,
        )
        trace = round_rows(records)
        if trace:
            logger.log_table(
                "rounds",
                columns=[
                    "question_id",
                    "category",
                    "turn",
                    "round",
                    "drafted",
                    "committed",
                    "skip_set",
                    "exit_layer",
                ],
                data=trace,
            )
        sel = [
            [
                r["question_id"],
                r["category"],
                t_i,
                json.dumps((t.get("strategy_summary") or {}).get("selector")),
            ]
            for r in records
            if r["method"] != "vanilla"
            for t_i, t in enumerate(r["turns"])
            if (t.get("strategy_summary") or {}).get("selector")
        ]
        if sel:
            logger.log_table(
                "selector_summary", columns=["question_id", "category", "turn", "summary"], data=sel
            )
        if self.plot_paths:
            for p in self.plot_paths:
                logger.log_image(key=f"plots/{p.stem}", images=[str(p)])
