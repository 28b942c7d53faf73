"""Hyper-parameter sweeps from W&B sweep YAML, with or without a W&B server.

- `framework.sweep.spec`: the sweep file (`load_sweep`, `Sweep`, `Param`, `expand_trials`);
- `framework.sweep.trial`: a trial's parameters -> `RunConfig` (`build_run_config`), one trial
  (`train`, what ``wandb agent`` runs), W&B's mode (`wandb_mode`), smoke mode;
- `framework.sweep.local`: a whole sweep run locally (`run_sweep`, `results_table`);
- `framework.sweep.cli`: ``experiments/sweep.py`` (`main`).

See ``docs/howto/sweeps.md``.
"""

from framework.sweep.cli import main
from framework.sweep.local import SweepResult, results_table, run_sweep
from framework.sweep.spec import Param, Sweep, SweepError, expand_trials, load_sweep, parse_param
from framework.sweep.trial import (
    SMOKE_ENV,
    build_run_config,
    smoke_setup,
    summarize,
    train,
    validate_trials,
    wandb_mode,
)

__all__ = [
    "SMOKE_ENV",
    "Param",
    "Sweep",
    "SweepError",
    "SweepResult",
    "build_run_config",
    "expand_trials",
    "load_sweep",
    "main",
    "parse_param",
    "results_table",
    "run_sweep",
    "smoke_setup",
    "summarize",
    "train",
    "validate_trials",
    "wandb_mode",
]
