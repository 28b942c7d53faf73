"""The benchmark's results in the experiment tracker, as the runner's are (``--logger``: W&B by
default, offline without credentials; ``csv``; ``none``): the configuration, environment and
provenance as the run's config, per-method metrics (overall and per category), and with W&B the
results table, the report (table and "what happened") and the plots."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from framework.session.loggers import close_logger, make_logger


def flat_config(meta: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``meta`` flattened into ``a/b/c`` keys (a tracker's config is shallow)."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_config(value, name + "/"))
        else:
            out[name] = value
    return out


def method_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """``{"<method>/speedup/<category>", "<method>/tokens_per_s", "<method>/M", ...}`` of a
    benchmark summary (`framework.benchmark.report.summarize`); ``<method>/gate_declined``: the
    share of rounds a draft gate declined (gated methods only)."""
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


def log_benchmark(
    run: Any,
    out_dir: Path,
    meta: Mapping[str, Any],
    summary: Mapping[str, Any],
    report: str,
    plots: Mapping[str, str],
    log: Callable[[str], None] = print,
) -> None:
    """Log one benchmark to ``run.runner.logger`` (a `RunConfig`'s runner section) under
    ``out_dir/tracking``; a no-op for ``none``. A W&B run this call started is finished here."""

    logger = make_logger(
        run.runner.logger, out_dir / "tracking", out_dir.name, run.runner.wandb_project, flat_config(meta)
    )
    if logger is None:
        return
    from pytorch_lightning.loggers import WandbLogger

    metrics = method_metrics(summary)
    if isinstance(logger, WandbLogger):
        _wandb_extras(logger, metrics, summary, report, plots)
    else:
        logger.log_metrics(metrics, step=0)
    close_logger(logger, log, "[bench]")


def _wandb_extras(
    logger: Any, metrics: dict[str, float], summary: Mapping[str, Any], report: str, plots: Mapping[str, str]
) -> None:
    """The metrics, the results table, the report and the plots in one W&B log call."""
    import wandb

    columns = ["method", "speedup", "tokens_per_s", "M", "alpha", "mismatches"]
    rows = [
        [label, (e.get("speedup") or {}).get("overall"), (e.get("tokens_per_s") or {}).get("overall")]
        + [e.get("M"), e.get("alpha"), e.get("mismatches")]
        for label, e in summary["methods"].items()
    ]
    exp = logger.experiment
    exp.log(
        {
            **metrics,
            "results": wandb.Table(columns=columns, data=rows),
            "report": wandb.Html(f"<pre>{_escape(report)}</pre>"),
            **{f"plots/{name}": wandb.Image(str(path)) for name, path in plots.items()},
        }
    )
    exp.summary.update(metrics)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
