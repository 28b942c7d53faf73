"""A local sweep: every trial of a sweep file validated up front, then run one after the other
through `framework.sweep.trial.train` (W&B offline by default), with ``trials.jsonl`` and a
``results.md`` table sorted by the metric.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.models.loading import TINY_BLOCKS
from framework.session.errors import USER_ERRORS
from framework.sweep.bayes import DEFAULT_INIT, BayesProposer
from framework.sweep.spec import Sweep, SweepError, expand_trials, load_sweep
from framework.sweep.trial import (
    command_line,
    describe_params,
    format_value,
    smoke_setup,
    train,
    validate_trials,
    wandb_mode,
)

TABLE_METRICS = (
    ("speedup", "speedup", "{:.3f}x"),
    ("M", "mean_accepted_tokens", "{:.2f}"),
    ("alpha", "alpha", "{:.3f}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("vanilla tok/s", "vanilla_tokens_per_s", "{:.1f}"),
)


def _cell(v: Any, fmt: str = "{:.4g}") -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if v != v else fmt.format(v)
    return format_value(v)


def _sort_key(sweep: Sweep, row: dict[str, Any]) -> tuple[int, float]:
    v = row.get("metrics", {}).get(sweep.metric)
    if row["status"] != "ok" or not isinstance(v, (int, float)) or v != v:
        return (1, 0.0)
    return (0, -v if sweep.goal == "maximize" else v)


def results_table(sweep: Sweep, rows: list[dict[str, Any]], *, sort: bool = True) -> str:
    """Markdown: one row per trial (its swept parameters, then the metrics), best first when ``sort``;
    a ``bayes`` sweep says which proposer chose each trial (``random`` or ``gp``)."""
    if sort:
        rows = sorted(rows, key=lambda r: _sort_key(sweep, r))
    cols = list(TABLE_METRICS)
    if sweep.metric not in [key for _, key, _ in cols]:
        cols.insert(0, (sweep.metric, sweep.metric, "{:.4g}"))
    by = sweep.method == "bayes"
    head = [
        "trial",
        *(["proposed by"] if by else []),
        *sweep.swept,
        *(h for h, _, _ in cols),
        "lossless",
        "status",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    for r in rows:
        m = r.get("metrics") or {}
        cells = [str(r["trial"]), *([str(r.get("proposed_by") or "")] if by else [])]
        cells += [_cell(r["params"].get(p)) for p in sweep.swept]
        cells += [_cell(m.get(key), fmt) for _, key, fmt in cols]
        cells.append(
            f"{m['lossless']}/{m['lossless_checked']}" if m.get("lossless_checked") else "n/a" if m else ""
        )
        cells.append("ok" if r["status"] == "ok" else f"failed: {r.get('error', '')}".replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _header(
    sweep: Sweep,
    n: int,
    seed: int,
    overrides: dict[str, Any] | None = None,
    user: dict[str, Any] | None = None,
) -> str:
    how = sweep.method if sweep.method == "grid" else f"{sweep.method} (seed {seed})"
    if sweep.method == "bayes":
        how = (
            f"bayes (a BoTorch GP proposes each trial by log expected improvement after {DEFAULT_INIT} "
            f"random ones; seed {seed})"
        )
    return (
        f"# Sweep {sweep.name}: {n} trials, {how}, metric {sweep.metric} ({sweep.goal})\n\n"
        f"File: {sweep.path}. Fixed: {describe_params(sweep.constants) or 'none'}."
        + (
            f" Smoke mode (tiny random model): {describe_params(overrides)}; its drafts rarely pay, so a"
            " gated preset's gate declines most rounds and such trials measure the gate, not the drafting"
            " (each trial's report says how many rounds its gate declined)."
            if overrides
            else ""
        )
        + (f" Set on the command line: {describe_params(user)}." if user else "")
        + "\n"
    )


@dataclass
class SweepResult:
    """What `run_sweep` did: the trials' rows (as in ``trials.jsonl``) and the sorted table."""

    sweep: Sweep
    out_dir: Path
    trials: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    table: str = ""
    interrupted: bool = False

    @property
    def failed(self) -> int:
        return sum(r["status"] != "ok" for r in self.rows)


def run_sweep(
    sweep: Sweep | str | Path,
    *,
    out_dir: str | Path | None = None,
    count: int | None = None,
    seed: int = 0,
    mode: str = "offline",
    dry_run: bool = False,
    smoke: bool = False,
    model: Any = None,
    tokenizer: Any = None,
    log: Callable[[str], None] = print,
    overrides: dict[str, Any] | None = None,
) -> SweepResult:
    """Run a sweep file locally, trial after trial, through `train`.

    Every trial is validated first (`validate_trials`); the model is loaded once (or ``model`` is
    used) and shared by the trials. Each finished trial appends a row to ``trials.jsonl`` and
    ``results.md`` at once; at the end (or on Ctrl-C) ``results.md`` is rewritten sorted by the
    metric, and the table is logged.

    Args:
        sweep: a sweep file or a `load_sweep` result.
        out_dir: where ``trials.jsonl``, ``results.md``, each trial's run folder (``trial-NNN/``) and,
            unless ``WANDB_DIR`` is set, the W&B runs (``wandb/``) go; default
            ``runs/sweeps/<name>-<time>``. Must not hold an earlier sweep.
        count: trials to run (grid: the first N points; random / bayes: N draws, default run_cap).
        seed: the random search's seed.
        mode: W&B mode of the trials: ``offline`` (default), ``online`` or ``disabled``.
        dry_run: validate and list the trials; run nothing, write nothing.
        smoke: a tiny random model and prompt file instead of the configured model and data.
        model: an already loaded model for every trial (tests pass a tiny one).
        tokenizer: its tokenizer.
        log: progress lines.
        overrides: run options every trial takes instead of the file's (``sweep.py --set
            max_new_tokens=16 --limit 1``: shrink a sweep without copying its file); a swept
            parameter cannot be overridden.

    Raises:
        SweepError: bad sweep file or parameters, or an override of a swept parameter (before any
            trial runs).
    """
    if not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    _notices(sweep, log)
    trials = expand_trials(sweep, count, seed)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(out_dir) if out_dir else Path("runs") / "sweeps" / f"{sweep.name}-{stamp}"
    if not dry_run and (out / "trials.jsonl").exists():
        raise SweepError(f"--out {out} already holds a sweep (trials.jsonl): choose another directory")
    user = _user_overrides(sweep, overrides)
    smoke_dir = Path(tempfile.mkdtemp(prefix="selfspec-smoke-")) if smoke else None
    try:
        return _sweep(sweep, trials, out, stamp, user, smoke_dir, seed, mode, dry_run, model, tokenizer, log)
    finally:
        if smoke_dir is not None:  # nothing of smoke mode stays behind in the temporary folder
            shutil.rmtree(smoke_dir, ignore_errors=True)


def _sweep(
    sweep: Sweep,
    trials: list[dict[str, Any]],
    out: Path,
    stamp: str,
    user: dict[str, Any],
    smoke_dir: Path | None,
    seed: int,
    mode: str | None,
    dry_run: bool,
    model: Any,
    tokenizer: Any,
    log: Callable[[str], None],
) -> SweepResult:
    """`run_sweep` once its trials are listed (``smoke_dir``: smoke mode's temporary folder)."""
    overrides: dict[str, Any] = {}
    if smoke_dir is not None:
        model, tokenizer, overrides = _smoke(smoke_dir, log)
    validate_trials(sweep, trials, overrides={**overrides, **user})
    mode, notice = wandb_mode(mode)
    result = SweepResult(sweep, out, trials=trials)
    if dry_run:
        _list_trials(result, _header(sweep, len(trials), seed, overrides, user), user, log)
        return result
    if notice:
        log(notice)
    out.mkdir(parents=True, exist_ok=True)
    if smoke_dir is not None:  # the prompts the trials ran stay with the sweep (their configs name them)
        kept = out / "smoke-prompts.jsonl"
        shutil.move(overrides["data"], kept)
        overrides["data"] = str(kept)
    header = _header(sweep, len(trials), seed, overrides, user)
    overrides = {**overrides, **user}
    (out / "results.md").write_text(header + "\n" + results_table(sweep, []) + "\n", encoding="utf-8")
    init = _wandb_init(sweep, out, mode, stamp)
    log(
        f"sweep {sweep.name}: {len(trials)} trials -> {out}"
        + (f" (W&B {mode})" if mode != "disabled" else "")
    )
    trial_args = {"model": model, "tokenizer": tokenizer, "mode": mode, "overrides": overrides}
    try:
        _run_trials(
            result, BayesProposer(sweep, seed) if sweep.method == "bayes" else None, init, trial_args, log
        )
    except KeyboardInterrupt:
        result.interrupted = True
    _finish(result, header, mode, log)
    return result


def _smoke(directory: Path, log: Callable[[str], None]) -> tuple[Any, Any, dict[str, Any]]:
    """Smoke mode's tiny model, tokenizer and overrides (the prompt file in ``directory``, a
    temporary one: nothing is written where the sweep goes before validation)."""
    model, tokenizer, overrides = smoke_setup(directory)
    log(
        f"smoke mode: a tiny random {TINY_BLOCKS}-block model, prompts {overrides['data']}, max_new_tokens "
        f"{overrides['max_new_tokens']}: this checks the machinery, the numbers mean nothing"
    )
    return model, tokenizer, overrides


def _list_trials(result: SweepResult, header: str, user: dict[str, Any], log: Callable[[str], None]) -> None:
    """``--dry-run``: every validated trial as a ``run.py`` command line."""
    trials = result.trials
    log(header + "".join(f"\ntrial {i}: {command_line({**p, **user})}" for i, p in enumerate(trials, 1)))
    log(f"\n{len(trials)} trials validated; nothing was run (--dry-run)")


def _user_overrides(sweep: Sweep, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``--set`` / ``--limit``: refused for a parameter the file sweeps."""
    user = dict(overrides or {})
    swept = sorted(set(user) & set(sweep.swept))
    if swept:
        raise SweepError(
            f"--set {', '.join(swept)}: swept by {sweep.path}; --set fixes the other run options"
        )
    return user


def _run_trials(
    result: SweepResult,
    proposer: BayesProposer | None,
    init: dict[str, Any],
    trial_args: dict[str, Any],
    log: Callable[[str], None],
) -> None:
    """Every trial in turn; with a ``bayes`` proposer, those after its random start proposed from
    the finished ones (each row says ``proposed_by``)."""
    for i, params in enumerate(result.trials, 1):
        if proposer is not None and i > proposer.n_init:
            params = _propose(result, proposer, trial_args["overrides"])
            result.trials[i - 1] = params
        by = None if proposer is None else "random" if i <= proposer.n_init else proposer.last_source
        _run_trial(result, i, params, init, trial_args, log, proposed_by=by)


def _notices(sweep: Sweep, log: Callable[[str], None]) -> None:
    """What the sweep file left to defaults."""
    for notice in sweep.notices:
        log(f"note: {notice}")


def _propose(result: SweepResult, proposer: BayesProposer, overrides: dict[str, Any]) -> dict[str, Any]:
    """The next ``bayes`` trial from the finished ones (`BayesProposer`), validated like the others."""
    metric = result.sweep.metric
    history = [
        (row["params"], row["metrics"].get(metric) if row["status"] == "ok" else None) for row in result.rows
    ]
    params = proposer.propose(history)
    validate_trials(result.sweep, [params], overrides=overrides)
    return params


def _wandb_init(sweep: Sweep, out: Path, mode: str, stamp: str) -> dict[str, Any]:
    """The ``wandb.init`` arguments every trial shares (project, group, tags, directory)."""
    init: dict[str, Any] = {"project": sweep.project, "group": f"{sweep.name}-{stamp}", "tags": [sweep.name]}
    if sweep.entity:
        init["entity"] = sweep.entity
    if mode != "disabled":
        import wandb as wb

        if not os.environ.get("WANDB_DIR"):
            init["dir"] = str(out)
        init["settings"] = wb.Settings(console="off", silent=True)
    return init


def _run_trial(
    result: SweepResult,
    i: int,
    params: dict[str, Any],
    init: dict[str, Any],
    trial_args: dict[str, Any],
    log: Callable[[str], None],
    *,
    proposed_by: str | None = None,
) -> None:
    """Trial ``i`` through `train`; its row appended to the result, ``trials.jsonl`` and
    ``results.md`` at once (a value only the model can reject fails the trial, not the sweep).
    The row's ``params`` are what ran: the trial's parameters with the run options that replaced
    the file's (``--set``, smoke mode); a ``bayes`` sweep's row says who proposed it
    (``proposed_by``: ``random``, ``gp``)."""
    sweep, out, n = result.sweep, result.out_dir, len(result.trials)
    tag = f"[trial {i}/{n}]"
    log(f"{tag} {describe_params(params, sweep.swept or list(params))}")
    ran = {**params, **trial_args["overrides"]}
    row: dict[str, Any] = {"trial": i, "params": ran, "status": "ok", "metrics": {}}
    if proposed_by is not None:
        row["proposed_by"] = proposed_by
    t0 = time.perf_counter()
    try:
        res = train(
            params,
            output=str(out / f"trial-{i:03d}"),
            init={**init, "name": f"{sweep.name}-{i:03d}"},
            log=lambda s: log(f"{tag} {s}"),
            **trial_args,
        )
        row.update(metrics=res["metrics"], output=res["output"], wandb=res["wandb_dir"])
    except (SweepError, *USER_ERRORS) as err:  # what only the model can reject (a skip set)
        row.update(status="failed", error=str(err))
        log(f"{tag} failed: {err}")
    row["seconds"] = round(time.perf_counter() - t0, 2)
    result.rows.append(row)
    with (out / "trials.jsonl").open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, default=str) + "\n")
    with (out / "results.md").open("a", encoding="utf-8") as fh:
        fh.write(results_table(sweep, [row]).splitlines()[-1] + "\n")
    if row["status"] == "ok":
        log(f"{tag} {sweep.metric} {_cell(row['metrics'].get(sweep.metric))} ({row['seconds']:.0f} s)")


def _finish(result: SweepResult, header: str, mode: str, log: Callable[[str], None]) -> None:
    """``results.md`` rewritten sorted by the metric, the table logged, where the W&B runs are."""
    sweep, out = result.sweep, result.out_dir
    result.table = results_table(sweep, result.rows)
    done = f"{len(result.rows)} of {len(result.trials)} trials" + (
        " (interrupted)" if result.interrupted else ""
    )
    md = out / "results.md"
    md.write_text(header + f"\n{done}, best first:\n\n{result.table}\n", encoding="utf-8")
    log(f"\n## Sweep {sweep.name}: {done}, best {sweep.metric} first\n\n{result.table}\n")
    log(f"results: {md} and {out / 'trials.jsonl'}")
    if mode == "offline":
        runs = Path(os.environ.get("WANDB_DIR") or out) / "wandb"
        log(f"W&B offline runs: {runs}/offline-run-*; upload them with `wandb sync {runs}/offline-run-*`")


__all__ = ["SweepResult", "results_table", "run_sweep"]
