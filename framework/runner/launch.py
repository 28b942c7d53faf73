"""The experiment runner: decode every prompt with vanilla and speculative decoding, interleaved.

``run(cfg)`` validates everything it can before writing anything (strategy configs, skip sets
against the model, the data, prompt lengths), warms both decoders up, then for each prompt decodes
all turns with both methods (alternating which goes first, so slow drift on a shared machine hits
both equally), checks the speculative tokens against vanilla, and appends one JSON line per prompt
and method to the output file, flushed at once: an interrupted run keeps every finished prompt,
and ``--resume`` continues it.

The loop is a PyTorch Lightning predict loop (``framework.runner.lightning``): Lightning places
the model, splits the prompts over processes (``--devices``, ``--num-nodes``), seeds, shows the
progress bar and drives the logger (``--logger wandb|csv|none``, ``framework.runner.tracking``).
The configuration is ``framework.session.run_config.RunConfig``; the loaded model with both
decoders is ``framework.session.session.Session`` (usable without Lightning); records and
the ``--resume`` state are ``framework.results.records``. Beside the results ``<stem>.jsonl``
a run writes ``<stem>.meta.json``, ``<stem>.config.yaml`` (``run.py --config`` reproduces the run)
and ``<stem>.md``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from framework.config_fields import ConfigError
from framework.driver import AnswerFiles, metadata, stamped, start, tracker
from framework.results.metrics import (
    gate_lines,
    mismatch_lines,
    results_table,
    synthetic_lines,
    time_breakdown,
)
from framework.results.records import prompt_key, read_records, resume_state
from framework.runner.lightning import DecodeModule, PlainProgress, ResultsWriter, SpeedupProgressBar
from framework.runner.tracking import TrackingCallback, summary_metrics
from framework.session.loggers import close_logger
from framework.session.run_config import RunConfig
from framework.session.session import Session


def run(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    model: Any = None,
    tokenizer: Any = None,
    *,
    output: Path | None = None,
) -> dict[str, Any]:
    """Run one experiment as a Lightning predict loop; returns ``{"output", "table", "breakdown",
    "records", "summary", "plots", "run_dir", "specbench_answers"}`` (on rank 0; other ranks get
    ``{}``). With ``cfg.runner.specbench_answers`` the Spec-Bench answer files are written from the
    results at the end, and when the run is interrupted (`framework.data.specbench`).

    Every prompt's records are appended to ``output`` (default: `resolve_output`, i.e.
    ``cfg.runner.output`` or a fresh time-stamped file) as soon as the prompt is done. With
    ``cfg.runner.resume`` the prompts already in the file are skipped (the file must come from the same
    configuration). Ctrl-C stops after the current prompt's records are written and raises
    KeyboardInterrupt.

    Raises:
        ConfigError, DataError, ModelLoadError, UnknownNameError: bad input, before anything is
            written.
    """
    prompts = start(cfg)
    out_path = output if output is not None else resolve_output(cfg)
    method = cfg.method.label
    names = ["vanilla"] + ([] if cfg.method.baseline_only else [method])
    rank0 = launch_rank(cfg) == 0
    answers = AnswerFiles(cfg.runner.specbench_answers, names, [out_path], cfg.model.name_or_path, log)

    def write_answers() -> dict[str, Path]:
        return answers.write(read_records(out_path), net=model)

    done = resume_state(cfg, out_path, names, log if rank0 else _silent) if cfg.runner.resume else set()
    todo = [p for p in prompts if prompt_key(p) not in done]
    if done and rank0:
        log(
            f"[selfspec] --resume: {len(prompts) - len(todo)} of {len(prompts)} prompts already in {out_path}"
        )
    run_dir = out_path.with_suffix("")
    exp, meta = _prepare(cfg, model, tokenizer, run_dir, log, todo)
    module = DecodeModule(cfg, todo, out_path, meta, model, tokenizer, log, experiment=exp)
    tty = sys.stderr.isatty() and rank0
    tracking = TrackingCallback(
        out_path, method, run_dir / "plots" if cfg.runner.plots else None, read_records
    )
    callbacks: list[Any] = [
        ResultsWriter(out_path),
        tracking,
        SpeedupProgressBar() if tty else PlainProgress(),
    ]
    tracked = {
        **cfg.describe(),
        "provenance": meta.get("provenance"),
        "notes": meta.get("notes", []),
        "resolved": meta.get("resolved", {}),  # draft_weights: auto as it resolved
    }
    logger = tracker(cfg, run_dir, run_dir.name, tracked) if rank0 else None
    t_start = time.perf_counter()
    trainer = _predict(cfg, module, _trainer_args(cfg, run_dir, callbacks, logger, tty), write_answers)
    if trainer.global_rank != 0:
        return {}
    records = read_records(out_path)
    progress = (len(todo), len(prompts) - len(todo), bool(done), t_start)
    table, breakdown = _report(cfg, records, names, out_path, tracking.plot_paths, log, progress)
    written = write_answers()
    if logger is not None:
        close_logger(logger, log)
    return {
        "output": str(out_path),
        "table": table,
        "breakdown": breakdown,
        "records": records,
        "summary": summary_metrics(records, method),
        "plots": [str(p) for p in tracking.plot_paths],
        "run_dir": str(run_dir),
        "specbench_answers": [str(p) for p in written.values()],
    }


def _prepare(
    cfg: RunConfig, model: Any, tokenizer: Any, run_dir: Path, log: Callable[[str], None], todo: list
) -> tuple[Session | None, dict[str, Any]]:
    """The run's metadata, and its `Session` when one process decodes (validated and prepared
    before any logger or file exists; with several processes each rank builds its own)."""
    if cfg.runner.devices * cfg.runner.num_nodes != 1:
        return None, metadata(cfg.describe(), method=cfg.method.label)
    exp = Session(cfg, model, tokenizer, artifact_stem=run_dir, log=log, prompts=todo)
    return exp, metadata(cfg.describe(), exp, method=cfg.method.label)


def _silent(_msg: str) -> None:
    """A log that drops its messages (ranks other than 0)."""


def _trainer_args(
    cfg: RunConfig, run_dir: Path, callbacks: list[Any], logger: Any, tty: bool
) -> dict[str, Any]:
    """The `pl.Trainer` of a run: its devices and processes, our callbacks and logger, no
    checkpoints, no distributed sampler (the module shards the prompts itself)."""
    return {
        "accelerator": _accelerator(cfg.model.device),
        "devices": _devices(cfg),
        "num_nodes": cfg.runner.num_nodes,
        "strategy": "ddp" if cfg.runner.devices * cfg.runner.num_nodes > 1 else "auto",
        "logger": logger if logger is not None else False,
        "callbacks": callbacks,
        "enable_progress_bar": tty,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
        "inference_mode": True,
        "default_root_dir": str(run_dir),
    }


def _predict(
    cfg: RunConfig, module: DecodeModule, trainer_args: dict[str, Any], on_interrupt: Callable[[], Any]
) -> pl.Trainer:
    """Run the predict loop; Ctrl-C writes ``on_interrupt`` (rank 0) and raises KeyboardInterrupt."""
    sigint = signal.getsignal(signal.SIGINT)
    with _quiet_lightning():
        trainer = pl.Trainer(**trainer_args)
        try:
            trainer.predict(module, return_predictions=False)
        except SystemExit:
            # Lightning turns Ctrl-C into SystemExit(1) after a graceful shutdown (and ignores
            # further SIGINTs); give the caller the interruption back, with the usual handler.
            signal.signal(signal.SIGINT, sigint)
            if trainer.interrupted:
                if trainer.global_rank == 0:
                    on_interrupt()
                raise KeyboardInterrupt from None
            raise
    return trainer


def _report(
    cfg: RunConfig,
    records: list[dict[str, Any]],
    names: list[str],
    out_path: Path,
    plot_paths: list[Path],
    log: Callable[[str], None],
    progress: tuple[int, int, bool, float],
) -> tuple[str, str]:
    """The run's report (``<output>.md``, and logged): the results table with its mismatch notes,
    where the time goes, what was decoded (``progress``: prompts decoded now, prompts resumed from
    the file, whether the run resumed, its start time); returns ``(table, breakdown)``."""
    decoded, resumed, did_resume, t_start = progress
    method = cfg.method.label
    table = results_table(records, method)
    for lines in (synthetic_lines(records), gate_lines(records, method), mismatch_lines(records)):
        if lines:
            table += "\n\n" + lines
    breakdown = time_breakdown(records, names)
    title = "vanilla (baseline only)" if cfg.method.baseline_only else f"{method} vs vanilla"
    run_dir = out_path.with_suffix("")
    report = (
        f"## {title}\n\n{table}\n\nWhere the time goes (share of wall time):\n\n{breakdown}\n\n"
        f"{decoded} prompts decoded in {time.perf_counter() - t_start:.0f} s"
        + (f" ({resumed} resumed from the file)" if did_resume else "")
        + f"; results: {out_path}\n"
        + (f"plots: {run_dir / 'plots'}\n" if plot_paths else "")
    )
    out_path.with_suffix(".md").write_text(report)
    log("\n" + report)
    return table, breakdown


def launch_rank(cfg: RunConfig) -> int:
    """This process's global rank as the launcher set it before Lightning starts: ``RANK``
    (torchrun), ``SLURM_PROCID`` (srun), else Lightning's own ``NODE_RANK`` and ``LOCAL_RANK``."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return int(env.get("NODE_RANK", "0")) * cfg.runner.devices + int(env.get("LOCAL_RANK", "0"))


def _external_launcher() -> bool:
    """Processes started by torchrun or srun (not by Lightning's launcher from rank 0)."""
    env = os.environ
    return (
        "TORCHELASTIC_RUN_ID" in env
        or ("RANK" in env and "WORLD_SIZE" in env)
        or int(env.get("SLURM_NTASKS", "1")) > 1
    )


def resolve_output(cfg: RunConfig) -> Path:
    """``cfg.runner.output``, or a fresh ``runs/<method>-<time>.jsonl``; DDP ranks started by Lightning's
    launcher inherit rank 0's choice through the environment.

    Raises:
        ConfigError: several processes started by an external launcher (torchrun, srun) and no
            ``--output``: each would pick its own timestamped file.
    """
    if cfg.runner.output:
        return Path(cfg.runner.output)
    if cfg.runner.devices * cfg.runner.num_nodes > 1 and _external_launcher():
        raise ConfigError(
            "--output", None, "a results file named explicitly when torchrun or srun starts the processes"
        )
    inherited = os.environ.get("SELFSPEC_RUN_OUTPUT")
    if inherited and launch_rank(cfg) > 0:
        return Path(inherited)
    path = stamped(cfg.method.label, ".jsonl")
    if cfg.runner.devices * cfg.runner.num_nodes > 1:
        os.environ["SELFSPEC_RUN_OUTPUT"] = str(path)
    return path


def _accelerator(device: str) -> str:
    if device == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device", device, "cpu or auto (this machine has no CUDA device)")
        return "gpu"
    return "cpu"


def _devices(cfg: RunConfig) -> Any:
    if cfg.model.device.startswith("cuda:"):  # one named GPU
        return [int(cfg.model.device.split(":", 1)[1])]
    return cfg.runner.devices


class _quiet_lightning:
    """Silence Lightning's start-up banners and its advice about data-loader workers (one prompt
    per step is the point here)."""

    def __enter__(self) -> None:
        self._levels = {}
        for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric"):
            lg = logging.getLogger(name)
            self._levels[name] = lg.level
            lg.setLevel(logging.WARNING)
        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*predict_dataloader.*num_workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
        warnings.filterwarnings("ignore", message=".*infer the batch indices.*")
        warnings.filterwarnings("ignore", message=".*`DataLoader` across ranks is zero.*")

    def __exit__(self, *exc: Any) -> None:
        self._warn.__exit__(*exc)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


def print_error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
