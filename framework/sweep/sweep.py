"""Hyper-parameter sweeps over the framework's run options, with or without a W&B server
(``experiments/sweep.py`` is the command line).

A sweep file (``experiments/sweeps/*.yaml``) is a W&B sweep configuration: ``method`` (grid,
random, bayes), ``metric`` ({name, goal}) and ``parameters``. Parameter names are the run options
of ``experiments/run.py`` without the dashes: ``method`` (a preset), ``limit``, ``max_new_tokens``,
``categories``, ``threads``, ``selector`` (a strategy name), ``selector.skip_ratio``,
``length.threshold`` and every other ``<kind>.<field>`` that ``run.py --list`` prints. One trial
is one `framework.experiment.runner.run` with those options; its summary metrics (``speedup``,
``mean_accepted_tokens``, ``alpha``, ``tokens_per_s``, ``lossless``, ...) go to the W&B run.

With a W&B server (the YAML's ``command`` makes the agent call ``python experiments/sweep.py
--trial``, which reads the trial's parameters from ``wandb.config``)::

    wandb login
    wandb sweep experiments/sweeps/static.yaml        # prints the sweep id
    wandb agent ENTITY/PROJECT/SWEEP_ID [--count N]
    python experiments/sweep.py --agent ENTITY/PROJECT/SWEEP_ID [--count N]   # model loaded once

Without a server (the same YAML, the same training function, W&B runs written offline)::

    python experiments/sweep.py experiments/sweeps/static.yaml [--count N] [--seed S] [--out DIR]
        [--dry-run] [--no-wandb] [--online] [--smoke]

Every trial of a local sweep is built and validated before the first one runs (grid points, and
the random draws, which are seeded); results go to ``DIR/trials.jsonl`` and ``DIR/results.md``,
one row per finished trial, flushed at once, and the table sorted by the metric is printed at the
end. ``method: bayes`` runs locally as random search (with a notice). Bad input exits with status 2
and ``error: ...``. See ``docs/howto/sweeps.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.config import ConfigError
from framework.experiment.cli import USER_ERRORS, build_parser, config_from_args, guarded
from framework.experiment.metrics import aggregate
from framework.experiment.plugins import load_builtin_strategies
from framework.experiment.tracking import has_wandb_credentials
from framework.interfaces import REGISTRIES

#: Top-level keys of a W&B sweep configuration (the server rejects others).
SWEEP_KEYS = (
    "program",
    "method",
    "metric",
    "parameters",
    "command",
    "name",
    "description",
    "project",
    "entity",
    "early_terminate",
    "run_cap",
    "controller",
    "job",
    "image_uri",
)
SEARCH_METHODS = ("grid", "random", "bayes")
#: Distributions the local runner samples (W&B's names and semantics).
DISTRIBUTIONS = (
    "constant",
    "categorical",
    "int_uniform",
    "uniform",
    "q_uniform",
    "log_uniform",
    "log_uniform_values",
    "q_log_uniform_values",
    "normal",
    "q_normal",
)
#: W&B distributions the local runner does not sample (``wandb agent`` does).
UNSUPPORTED_DISTRIBUTIONS = (
    "q_log_uniform",
    "inv_log_uniform",
    "inv_log_uniform_values",
    "log_normal",
    "q_log_normal",
    "beta",
    "q_beta",
)
PARAM_KEYS = ("value", "values", "probabilities", "distribution", "min", "max", "q", "mu", "sigma", "a", "b")
#: Summary metrics of one trial (overall); ``<category>/speedup`` etc. are logged too.
METRICS = (
    "speedup",
    "mean_accepted_tokens",
    "alpha",
    "tokens_per_s",
    "vanilla_tokens_per_s",
    "skip_ratio",
    "lossless",
    "lossless_checked",
    "prompts",
    "new_tokens",
    "wall_time",
)
#: Run options a sweep may not set: the sweep owns the output files, and these only print.
FORBIDDEN_OPTIONS = ("help", "list", "print_config", "output")
DEFAULT_PROJECT = "selfspec-sweeps"
#: Set to 1 to run `--trial` (what `wandb agent` calls) in smoke mode: the agent passes no flags.
SMOKE_ENV = "SELFSPEC_SWEEP_SMOKE"
SMOKE_MAX_NEW_TOKENS = 8


class SweepError(ValueError):
    """A sweep file or sweep parameter is invalid (the message says which and what is allowed)."""


# --------------------------------------------------------------------------------------------
# The sweep file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One entry of ``parameters``: a constant, a list of values, or a distribution."""

    name: str
    distribution: str
    values: tuple[Any, ...] = ()
    probabilities: tuple[float, ...] | None = None
    min: float | None = None
    max: float | None = None
    q: float | None = None
    mu: float = 0.0
    sigma: float = 1.0

    def grid_values(self) -> list[Any]:
        """The values a grid search visits (W&B's rules: values, or an integer / quantised range)."""
        if self.distribution in ("constant", "categorical"):
            return list(self.values)
        if self.distribution == "int_uniform":
            return list(range(int(self.min), int(self.max) + 1))
        if self.distribution == "q_uniform":  # the multiples of q in [min, max]
            lo, hi = math.ceil(self.min / self.q - 1e-9), math.floor(self.max / self.q + 1e-9)
            return [_tidy(i * self.q, self) for i in range(lo, hi + 1)]
        raise SweepError(
            f"parameter {self.name!r}: method grid needs discrete values, but the distribution is "
            f"{self.distribution!r} (use values: [...], int_uniform, q_uniform, or method: random)"
        )

    def sample(self, rng: random.Random) -> Any:
        d = self.distribution
        if d == "constant":
            return self.values[0]
        if d == "categorical":
            if self.probabilities:
                return rng.choices(self.values, weights=self.probabilities)[0]
            return rng.choice(self.values)
        if d == "int_uniform":
            return rng.randint(int(self.min), int(self.max))
        if d == "uniform":
            return rng.uniform(self.min, self.max)
        if d == "q_uniform":
            return _tidy(
                min(self.max, max(self.min, round(rng.uniform(self.min, self.max) / self.q) * self.q)), self
            )
        if d == "log_uniform":  # min and max are exponents (natural log), as in W&B
            return math.exp(rng.uniform(self.min, self.max))
        if d in ("log_uniform_values", "q_log_uniform_values"):
            x = math.exp(rng.uniform(math.log(self.min), math.log(self.max)))
            if d == "log_uniform_values":
                return x
            return _tidy(min(self.max, max(self.min, round(x / self.q) * self.q)), self)
        if d == "normal":
            return rng.gauss(self.mu, self.sigma)
        if d == "q_normal":
            return _tidy(round(rng.gauss(self.mu, self.sigma) / self.q) * self.q, self)
        raise AssertionError(d)


def _tidy(x: float, p: Param) -> Any:
    """A quantised value without float noise (0.30000000000000004 -> 0.3); an int for integer steps."""
    if all(
        isinstance(v, int) and not isinstance(v, bool)
        for v in (p.q, *(b for b in (p.min, p.max) if b is not None))
    ):
        return int(round(x))
    return round(x, 10)


@dataclass(frozen=True)
class Sweep:
    """A parsed and checked sweep file."""

    path: Path
    method: str
    metric: str
    goal: str
    params: dict[str, Param]
    name: str
    project: str
    entity: str | None = None
    run_cap: int | None = None
    notices: tuple[str, ...] = ()

    @property
    def swept(self) -> list[str]:
        """Names of the parameters that vary between trials."""
        return [n for n, p in self.params.items() if not _fixed(p)]

    @property
    def constants(self) -> dict[str, Any]:
        """The parameters every trial shares."""
        return {n: p.values[0] for n, p in self.params.items() if _fixed(p)}


def _fixed(p: Param) -> bool:
    return p.distribution == "constant" or (p.distribution == "categorical" and len(p.values) == 1)


def _number(name: str, key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SweepError(f"parameter {name!r}: {key} must be a number, got {v!r}")
    return v


def parse_param(name: Any, spec: Any) -> Param:
    """One ``parameters`` entry, checked (W&B's inference: min/max of ints -> int_uniform, else uniform)."""
    if not isinstance(name, str) or not name:
        raise SweepError(f"parameter names must be strings, got {name!r}")
    if not isinstance(spec, dict):
        raise SweepError(
            f"parameter {name!r}: expected a mapping such as {{value: 1}}, {{values: [1, 2]}} or "
            f"{{min: 0.1, max: 0.5}}, got {spec!r}"
        )
    if "parameters" in spec:
        raise SweepError(
            f"parameter {name!r}: nested 'parameters' are not supported; use dotted names such as "
            f"{name}.skip_ratio"
        )
    unknown = sorted(set(spec) - set(PARAM_KEYS))
    if unknown:
        raise SweepError(
            f"parameter {name!r}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(PARAM_KEYS)})"
        )
    dist = spec.get("distribution")
    if dist is None:
        if "value" in spec:
            dist = "constant"
        elif "values" in spec:
            dist = "categorical"
        elif "min" in spec or "max" in spec:
            both_int = all(
                isinstance(spec.get(k), int) and not isinstance(spec.get(k), bool) for k in ("min", "max")
            )
            dist = "int_uniform" if both_int else "uniform"
        elif "mu" in spec or "sigma" in spec:
            dist = "normal"
        else:
            raise SweepError(f"parameter {name!r}: give value, values, min/max or a distribution")
    if dist in UNSUPPORTED_DISTRIBUTIONS:
        raise SweepError(
            f"parameter {name!r}: distribution {dist!r} is not supported by the local runner (supported: "
            f"{', '.join(DISTRIBUTIONS)}); run this sweep with `wandb agent`, or change the distribution"
        )
    if dist not in DISTRIBUTIONS:
        raise SweepError(
            f"parameter {name!r}: unknown distribution {dist!r} (supported: {', '.join(DISTRIBUTIONS)})"
        )
    if dist == "constant":
        if "value" not in spec:
            raise SweepError(f"parameter {name!r}: distribution constant needs 'value'")
        return Param(name, dist, values=(spec["value"],))
    if dist == "categorical":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise SweepError(f"parameter {name!r}: values must be a non-empty list, got {values!r}")
        probs = spec.get("probabilities")
        if probs is not None:
            if not isinstance(probs, list) or len(probs) != len(values):
                raise SweepError(f"parameter {name!r}: probabilities must be a list as long as values")
            probs = [_number(name, "probabilities", p) for p in probs]
            if any(p < 0 for p in probs) or abs(sum(probs) - 1.0) > 1e-6:
                raise SweepError(f"parameter {name!r}: probabilities must be >= 0 and sum to 1, got {probs}")
        return Param(name, dist, values=tuple(values), probabilities=tuple(probs) if probs else None)
    if dist in ("normal", "q_normal"):
        mu = _number(name, "mu", spec.get("mu", 0.0))
        sigma = _number(name, "sigma", spec.get("sigma", 1.0))
        if sigma <= 0:
            raise SweepError(f"parameter {name!r}: sigma must be > 0, got {sigma}")
        q = _number(name, "q", spec.get("q", 1)) if dist == "q_normal" else None
        return Param(name, dist, mu=mu, sigma=sigma, q=q)
    for key in ("min", "max"):
        if key not in spec:
            raise SweepError(f"parameter {name!r}: distribution {dist} needs min and max")
    lo, hi = _number(name, "min", spec["min"]), _number(name, "max", spec["max"])
    if not lo < hi:
        raise SweepError(f"parameter {name!r}: min must be below max, got min {lo}, max {hi}")
    if dist == "int_uniform" and not (float(lo).is_integer() and float(hi).is_integer()):
        raise SweepError(f"parameter {name!r}: int_uniform needs integer min and max, got {lo}, {hi}")
    if dist in ("log_uniform_values", "q_log_uniform_values") and lo <= 0:
        raise SweepError(f"parameter {name!r}: {dist} needs min > 0, got {lo}")
    q = None
    if dist.startswith("q_"):
        q = _number(name, "q", spec.get("q", 1))
        if q <= 0:
            raise SweepError(f"parameter {name!r}: q must be > 0, got {q}")
    return Param(name, dist, min=lo, max=hi, q=q)


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file: structure, method, metric and every parameter entry.

    Parameter *names and values* are checked against the run options by `validate_trials`.

    Raises:
        SweepError: unreadable file, malformed YAML, or a structure W&B or this runner rejects.
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise SweepError(f"cannot read sweep file {str(path)!r}: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SweepError(f"{path}: not valid YAML ({err})".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise SweepError(
            f"{path}: expected a YAML mapping with method, metric and parameters, got {type(data).__name__}"
        )
    unknown = sorted(str(k) for k in set(data) - set(SWEEP_KEYS))
    if unknown:
        raise SweepError(
            f"{path}: unknown key(s) {', '.join(unknown)} (a W&B sweep has {', '.join(SWEEP_KEYS)})"
        )
    method = data.get("method")
    if method not in SEARCH_METHODS:
        raise SweepError(f"{path}: method must be one of {', '.join(SEARCH_METHODS)}, got {method!r}")
    notices = []
    metric = data.get("metric")
    if metric is None:
        name, goal = "speedup", "maximize"
        notices.append("no metric in the sweep file: ranking by speedup (maximize)")
    else:
        if not isinstance(metric, dict) or "name" not in metric:
            raise SweepError(
                f"{path}: metric must be a mapping {{name: speedup, goal: maximize}}, got {metric!r}"
            )
        name, goal = metric["name"], metric.get("goal", "minimize")
        if "goal" not in metric:
            notices.append("metric.goal not given: minimize (W&B's default)")
        if goal not in ("maximize", "minimize"):
            raise SweepError(f"{path}: metric.goal must be maximize or minimize, got {goal!r}")
        if not _known_metric(name):
            raise SweepError(
                f"{path}: metric.name {name!r} is not logged by a trial (logged: {', '.join(METRICS)}, "
                "and <category>/<metric> such as qa/speedup)"
            )
    params = data.get("parameters")
    if params is None:
        raise SweepError(f"{path}: missing 'parameters' (the run options to sweep)")
    if not isinstance(params, dict) or not params:
        raise SweepError(
            f"{path}: parameters must be a non-empty mapping of name -> {{value|values|min/max}}"
        )
    parsed = {}
    for pname, spec in params.items():
        try:
            parsed[pname] = parse_param(pname, spec)
        except SweepError as err:
            raise SweepError(f"{path}: {err}") from None
    run_cap = data.get("run_cap")
    if run_cap is not None and (isinstance(run_cap, bool) or not isinstance(run_cap, int) or run_cap < 1):
        raise SweepError(f"{path}: run_cap must be an integer >= 1, got {run_cap!r}")
    if method == "grid":
        for p in parsed.values():
            try:
                if not p.grid_values():
                    raise SweepError(
                        f"parameter {p.name!r}: no multiple of q={p.q} lies in [{p.min}, {p.max}]"
                    )
            except SweepError as err:
                raise SweepError(f"{path}: {err}") from None
    return Sweep(
        path=path,
        method=method,
        metric=name,
        goal=goal,
        params=parsed,
        name=str(data.get("name") or path.stem),
        project=str(data.get("project") or DEFAULT_PROJECT),
        entity=data.get("entity"),
        run_cap=run_cap,
        notices=tuple(notices),
    )


def _known_metric(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    return name in METRICS or ("/" in name and name.rsplit("/", 1)[1] in METRICS)


def expand_trials(sweep: Sweep, count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The trials' parameters: the grid's cartesian product (in file order), or seeded random draws.

    ``bayes`` is drawn like ``random`` (the local runner has no Bayesian search). ``count`` keeps
    the first N grid points; random search needs it (or the file's ``run_cap``).
    """
    if count is not None and count < 1:
        raise SweepError(f"--count must be >= 1, got {count}")
    if sweep.method == "grid":
        names = list(sweep.params)
        grid = [
            dict(zip(names, combo, strict=True))
            for combo in itertools.product(*(sweep.params[n].grid_values() for n in names))
        ]
        return grid[:count] if count else grid
    n = count or sweep.run_cap
    if n is None:
        raise SweepError(
            f"{sweep.path}: method {sweep.method} needs --count N (or run_cap in the sweep file)"
        )
    rng = random.Random(seed)
    return [{name: p.sample(rng) for name, p in sweep.params.items()} for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Sweep parameters -> run options (the command line's own parser and validation)
# --------------------------------------------------------------------------------------------


def _option_table(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``{parameter name: argparse action}``: each flag by its dest and by its spelling without dashes
    (``max_new_tokens`` and ``max-new-tokens``, ``import``, ``selector.skip_ratio``, ``skip_set``)."""
    table: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in FORBIDDEN_OPTIONS:
            continue
        names = {action.dest}
        for opt in action.option_strings:
            bare = opt.lstrip("-")
            names |= {bare, bare.replace("-", "_")}
        for n in names:
            table.setdefault(n, action)
    return table


def _arg(value: Any) -> str:
    """A YAML / wandb.config value as the command line spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(_arg(v) for v in value)
    return str(value)


def _truth(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SweepError(f"sweep parameter {key!r} must be a boolean (true/false), got {value!r}")


def _flatten(params: dict[str, Any]) -> dict[str, Any]:
    """``selector: {name: swift, skip_ratio: 0.4}`` (a nested wandb.config) -> dotted keys."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in REGISTRIES and isinstance(value, dict):
            for sub, v in value.items():
                out[key if sub == "name" else f"{key}.{sub}"] = v
        else:
            out[key] = value
    return out


def _strategy_fields() -> dict[str, list[str]]:
    """``{field: ["selector.field", ...]}`` over every registered strategy (for suggestions)."""
    out: dict[str, list[str]] = {}
    for kind, reg in REGISTRIES.items():
        for e in reg.entries():
            for f in dataclasses.fields(e.config):
                key = f"{kind}.{f.name}"
                if key not in out.setdefault(f.name, []):
                    out[f.name].append(key)
    return out


def _top_level_names(table: dict[str, argparse.Action]) -> list[str]:
    """The run options that are not strategy fields, spelled as sweep parameters (``max_new_tokens``)."""
    names = set()
    for action in set(table.values()):
        if "." not in action.dest:
            long = [o for o in action.option_strings if o.startswith("--")]
            names.add(long[0].lstrip("-").replace("-", "_"))
    return sorted(names)


def _unknown_name(key: str, table: dict[str, argparse.Action]) -> SweepError:
    hint = ""
    if key in FORBIDDEN_OPTIONS:
        hint = " (the sweep sets each trial's output itself)" if key == "output" else " (it only prints)"
    elif key in _strategy_fields():
        hint = f" (did you mean {' or '.join(_strategy_fields()[key])}?)"
    return SweepError(
        f"sweep parameter {key!r} is not a run option{hint}; allowed: {', '.join(_top_level_names(table))}, "
        f"or <kind>.<field> with kind one of {', '.join(REGISTRIES)} (python experiments/run.py --list "
        "prints every strategy's fields)"
    )


def _import_modules(params: dict[str, Any]) -> None:
    mods = params.get("import", params.get("imports", []))
    for mod in [mods] if isinstance(mods, str) else list(mods or []):
        try:
            importlib.import_module(mod)
        except ImportError as err:
            raise SweepError(f"sweep parameter 'import': cannot import {mod!r} ({err})") from None


def _to_argv(params: dict[str, Any], table: dict[str, argparse.Action]) -> tuple[list[str], dict[str, str]]:
    """Command-line arguments for ``params``, and the ``<kind>.<field>`` entries that no registered
    strategy has (``config_from_args`` rejects those, listing the chosen strategy's fields)."""
    argv: list[str] = []
    extra: dict[str, str] = {}
    for key, value in params.items():
        key = str(key)
        if key in ("import", "imports"):
            continue
        action = table.get(key)
        if action is None:
            kind, _, fname = key.partition(".")
            if kind in REGISTRIES and fname:
                extra[key] = _arg(value)
                continue
            raise _unknown_name(key, table)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._AppendAction):  # --stop is repeatable
            argv += [f"{flag}={_arg(v)}" for v in (value if isinstance(value, (list, tuple)) else [value])]
        elif isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if _truth(key, value) else []
        elif isinstance(action, argparse._StoreFalseAction):  # --no-plots: `plots: false` or `no_plots: true`
            argv += [flag] if _truth(key, value) != (key == action.dest) else []
        else:
            argv.append(f"{flag}={_arg(value)}")
    return argv, extra


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.Action]]:
    parser = build_parser()

    def fail(message: str) -> None:
        raise SweepError(f"sweep parameters: {message}")

    parser.error = fail  # type: ignore[method-assign]  # argparse would print its usage and exit
    return parser, _option_table(parser)


def check_names(names: Sequence[str], imports: Any = None) -> None:
    """Raise `SweepError` for a parameter name that is not a run option (before any value is built)."""
    load_builtin_strategies()
    _import_modules({"import": imports or []})
    _to_argv(dict.fromkeys(names), _parser()[1])


def build_run_config(params: dict[str, Any], *, output: str | None = None):
    """A validated `RunConfig` from sweep parameters, through the command line's parser.

    Each key is a run option (see the module docstring); values are spelled as on the command line
    (``true``, ``none``, lists comma-joined) and parsed and validated exactly as ``run.py`` does.

    Raises:
        SweepError: a name that is not a run option, or a value that the parser or a config
            rejects (the message names the parameter).
        ConfigError, UnknownNameError: other invalid options (an unregistered strategy name).
    """
    load_builtin_strategies()
    params = _flatten({k: v for k, v in params.items() if not str(k).startswith("_")})
    _import_modules(params)
    parser, table = _parser()
    argv, extra = _to_argv(params, table)
    if output is not None:
        argv.append(f"--output={output}")
    args = parser.parse_args(argv)
    for key, value in extra.items():
        setattr(args, key, value)
    try:
        return config_from_args(args)
    except ConfigError as err:
        name = err.field.lstrip("-").replace("-", "_") if isinstance(err.field, str) else ""
        if name in params or name.replace("_", "-") in params:
            raise SweepError(f"sweep parameter {name!r}: {err}") from None
        raise


def describe_params(params: dict[str, Any], names: Sequence[str] | None = None) -> str:
    keys = names if names is not None else list(params)
    return ", ".join(f"{k}={_arg(params[k])}" for k in keys if k in params)


def command_line(params: dict[str, Any]) -> str:
    """The ``run.py`` invocation equivalent to one trial (for --dry-run)."""
    parts = ["python experiments/run.py"]
    for key, value in params.items():
        flag = "--" + (key if "." in key else key.replace("_", "-"))
        vals = value if key == "stop" and isinstance(value, list) else [value]
        for v in vals:
            parts.append(f"{flag} {_arg(v)}")
    return " ".join(parts)


def validate_trials(
    sweep: Sweep, trials: list[dict[str, Any]], *, overrides: dict[str, Any] | None = None
) -> list:
    """Check every parameter name, build every trial's `RunConfig` and load each distinct prompt
    selection, before anything runs (no model is loaded).

    Returns the configs. Raises `SweepError` naming the file, the first bad trial and the parameter.
    """
    from framework.experiment.data import load_prompts

    imports = [
        m
        for v in (sweep.params["import"].values if "import" in sweep.params else ())
        for m in ([v] if isinstance(v, str) else v)
    ]
    try:
        check_names(list(sweep.params), imports)
    except SweepError as err:
        raise SweepError(f"{sweep.path}: {err}") from None
    configs, errors = [], []
    for i, params in enumerate(trials, 1):
        try:
            configs.append(build_run_config({**params, **(overrides or {})}))
        except (SweepError, *USER_ERRORS) as err:
            where = f"trial {i} of {len(trials)}"
            if sweep.swept:
                where += f" ({describe_params(params, sweep.swept)})"
            errors.append(f"{where}: {err}")
    if errors:
        more = f" (and {len(errors) - 1} more of the {len(trials)} trials)" if len(errors) > 1 else ""
        raise SweepError(f"{sweep.path}: {errors[0]}{more}")
    seen = set()
    for cfg in configs:
        key = (cfg.data, cfg.categories, cfg.limit)
        if key not in seen:
            seen.add(key)
            try:
                load_prompts(cfg.data, cfg.categories or None, cfg.limit)
            except USER_ERRORS as err:
                raise SweepError(f"{sweep.path}: {err}") from None
    return configs


# --------------------------------------------------------------------------------------------
# W&B: mode and credentials
# --------------------------------------------------------------------------------------------


def wandb_mode(requested: str | None = None) -> tuple[str, str | None]:
    """``(mode, notice)``: the W&B mode to use, never one that would prompt for a login or hang.

    ``requested`` (``online`` / ``offline`` / ``disabled``) wins; ``online`` without credentials is
    an error. Otherwise ``WANDB_MODE`` is honoured (``online`` without credentials falls back to
    offline), then credentials decide: online when W&B has an API key, else offline.
    """
    creds = has_wandb_credentials()
    if requested == "online":
        if not creds:
            raise SweepError(
                "--online needs W&B credentials: run `wandb login` (or set WANDB_API_KEY); without them "
                "trials are logged offline and can be uploaded later with `wandb sync`"
            )
        return "online", None
    if requested in ("offline", "disabled"):
        return requested, None
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in ("disabled",) or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true"):
        return "disabled", None
    if env in ("offline", "dryrun"):
        return "offline", None
    if creds:
        return "online", None
    why = "WANDB_MODE=online but no" if env in ("online", "run") else "no"
    return "offline", (
        f"wandb: {why} API key found (WANDB_API_KEY, ~/.netrc): logging offline; upload later with `wandb sync`"
    )


# --------------------------------------------------------------------------------------------
# One trial
# --------------------------------------------------------------------------------------------

_MODEL_CACHE: dict[tuple, tuple[Any, Any]] = {}


def _model_for(cfg) -> tuple[Any, Any]:
    """The loaded model and tokenizer for ``cfg``, kept between trials (one model at a time)."""
    key = (cfg.model, cfg.dtype, cfg.device)
    if key not in _MODEL_CACHE:
        from framework.experiment.models import load_model

        _MODEL_CACHE.clear()
        _MODEL_CACHE[key] = load_model(cfg.model, cfg.dtype, cfg.device)
    return _MODEL_CACHE[key]


def smoke_setup(directory: Path) -> tuple[Any, Any, dict[str, Any]]:
    """Smoke mode: a tiny random model and tokenizer, and the run options that go with them
    (a prompt file of the tiny vocabulary, one prompt per built-in category; short generations)."""
    from framework.experiment.tiny import tiny_model, tiny_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "smoke-prompts.jsonl"
    cats = ("writing", "translation", "summarization", "qa", "math_reasoning", "rag", "code")
    rows = [
        {
            "question_id": i + 1,
            "category": c,
            "turns": [" ".join(f"w{5 + (7 * i + 3 * j) % 110}" for j in range(6))],
        }
        for i, c in enumerate(cats)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    model = tiny_model("llama", num_layers=4, vocab_size=128, max_position_embeddings=256)
    # One thread: the tiny matmuls only lose from intra-op threading.
    return model, tiny_tokenizer(), {"data": str(data), "max_new_tokens": SMOKE_MAX_NEW_TOKENS, "threads": 1}


def summarize(records: list[dict[str, Any]], method: str) -> dict[str, float]:
    """Overall metrics of ``method`` against vanilla (as in the results table), plus per category
    ``<category>/speedup``, ``<category>/mean_accepted_tokens`` and ``<category>/alpha``."""
    out: dict[str, float] = {}
    for cat, by_method in aggregate(records).items():
        base, m = by_method.get("vanilla"), by_method.get(method, by_method.get("vanilla"))
        if base is None or m is None:
            continue
        vals = {
            "speedup": m.mean_tokens_per_s / base.mean_tokens_per_s
            if base.mean_tokens_per_s
            else float("nan"),
            "mean_accepted_tokens": m.mean_accepted_length,
            "alpha": m.acceptance_rate,
        }
        if cat == "overall":
            vals.update(
                tokens_per_s=m.mean_tokens_per_s,
                vanilla_tokens_per_s=base.mean_tokens_per_s,
                skip_ratio=m.skip_ratio,
                lossless=m.lossless,
                lossless_checked=m.lossless_checked,
                prompts=m.prompts,
                new_tokens=m.new_tokens,
                wall_time=m.wall_time,
            )
            out.update(vals)
        else:
            out.update({f"{cat}/{k}": v for k, v in vals.items()})
    return out


def train(
    config: dict[str, Any] | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    output: str | None = None,
    mode: str | None = None,
    init: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One sweep trial: what ``wandb agent`` runs (``train()``), and what a local sweep calls per trial.

    Starts a W&B run (online when W&B has credentials, else offline: see `wandb_mode`; it never
    prompts), reads the trial's parameters from ``wandb.config`` (``config``, when given, is what
    ``wandb.init`` records), builds the validated `RunConfig` through the command line's parser,
    runs the experiment and logs the summary metrics to the run (``wandb.log`` and ``run.summary``).

    Args:
        config: the trial's parameters (``{"selector.skip_ratio": 0.3, ...}``); ``None`` under
            ``wandb agent``, which supplies them through ``wandb.config``.
        model: an already loaded model (else one is loaded, and kept for the next trial).
        tokenizer: its tokenizer.
        output: the trial's results JSONL (default ``runs/sweeps/<sweep id or local>/<run id>.jsonl``).
        mode: the W&B mode (``online``, ``offline``, ``disabled``); ``None`` decides as `wandb_mode`.
        init: extra ``wandb.init`` arguments (project, group, name, dir, tags, settings).
        overrides: run options applied over the parameters and not logged (smoke mode's data).
        log: progress lines.

    Returns:
        ``{"params", "metrics", "output", "wandb_dir"}``; ``wandb_dir`` is the offline run's
        directory (or the run's URL online, ``None`` without W&B).

    Raises:
        SweepError, ConfigError, ...: bad parameters; the W&B run is finished as failed first.
    """
    mode, notice = wandb_mode(mode)
    if notice:
        log(notice)
    params = dict(config or {})
    run = None
    if mode != "disabled":
        import wandb as wb

        kwargs = {"job_type": "sweep-trial", **(init or {})}
        run = wb.init(config=params or None, mode=mode, **kwargs)
        params = {k: v for k, v in dict(run.config).items() if not k.startswith("_")}
    try:
        if not params:
            raise SweepError(
                "no sweep parameters: train() reads them from wandb.config, which `wandb agent` fills; "
                "run a sweep file locally with `python experiments/sweep.py FILE`"
            )
        if output is None:
            stem = run.id if run is not None else time.strftime("%Y%m%d-%H%M%S")
            output = str(
                Path("runs") / "sweeps" / os.environ.get("WANDB_SWEEP_ID", "local") / f"{stem}.jsonl"
            )
        extra = dict(overrides or {})
        if mode == "disabled" and "logger" not in params and "logger" in _parser()[1]:
            extra.setdefault("logger", "none")  # the runner's own W&B logger would start a run
        cfg = build_run_config({**params, **extra}, output=output)
        if model is None:
            model, tokenizer = _model_for(cfg)
        from framework.experiment.runner import run as run_experiment

        result = run_experiment(cfg, log=log, model=model, tokenizer=tokenizer)
        if "records" not in result:  # a non-zero rank of a multi-process run: rank 0 reports
            result = {"records": [], "output": str(cfg.output)}
        metrics = summarize(result["records"], cfg.method_name)
        if run is not None:
            run.log(metrics)
            run.summary.update({**metrics, "results_file": result["output"]})
    except BaseException as err:
        if run is not None:
            run.finish(exit_code=130 if isinstance(err, KeyboardInterrupt) else 1)
        raise
    where = None
    if run is not None:
        where = str(Path(run.dir).parent) if mode == "offline" else run.url
        run.finish()
    return {"params": params, "metrics": metrics, "output": result["output"], "wandb_dir": where}


# --------------------------------------------------------------------------------------------
# A local sweep
# --------------------------------------------------------------------------------------------

#: Columns of the results table after the swept parameters: (header, metric, format).
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
    return _arg(v)


def _sort_key(sweep: Sweep, row: dict[str, Any]) -> tuple[int, float]:
    v = row.get("metrics", {}).get(sweep.metric)
    if row["status"] != "ok" or not isinstance(v, (int, float)) or v != v:
        return (1, 0.0)
    return (0, -v if sweep.goal == "maximize" else v)


def results_table(sweep: Sweep, rows: list[dict[str, Any]], *, sort: bool = True) -> str:
    """Markdown: one row per trial (its swept parameters, then the metrics), best first when ``sort``."""
    if sort:
        rows = sorted(rows, key=lambda r: _sort_key(sweep, r))
    cols = list(TABLE_METRICS)
    if sweep.metric not in [key for _, key, _ in cols]:
        cols.insert(0, (sweep.metric, sweep.metric, "{:.4g}"))
    head = ["trial", *sweep.swept, *(h for h, _, _ in cols), "lossless", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    for r in rows:
        m = r.get("metrics") or {}
        cells = [str(r["trial"]), *(_cell(r["params"].get(p)) for p in sweep.swept)]
        cells += [_cell(m.get(key), fmt) for _, key, fmt in cols]
        cells.append(
            f"{m['lossless']}/{m['lossless_checked']}" if m.get("lossless_checked") else "n/a" if m else ""
        )
        cells.append("ok" if r["status"] == "ok" else f"failed: {r.get('error', '')}".replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _header(sweep: Sweep, n: int, seed: int, overrides: dict[str, Any] | None = None) -> str:
    how = sweep.method if sweep.method == "grid" else f"{sweep.method} (seed {seed})"
    if sweep.method == "bayes":
        how = f"bayes, run locally as random (seed {seed})"
    return (
        f"# Sweep {sweep.name}: {n} trials, {how}, metric {sweep.metric} ({sweep.goal})\n\n"
        f"File: {sweep.path}. Fixed: {describe_params(sweep.constants) or 'none'}."
        + (f" Smoke mode (tiny random model): {describe_params(overrides)}." if overrides else "")
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
) -> SweepResult:
    """Run a sweep file locally, trial after trial, through `train`.

    Every trial is validated first (`validate_trials`); the model is loaded once (or ``model`` is
    used) and shared by the trials. Each finished trial appends a row to ``trials.jsonl`` and
    ``results.md`` at once; at the end (or on Ctrl-C) ``results.md`` is rewritten sorted by the
    metric, and the table is logged.

    Args:
        sweep: a sweep file or a `load_sweep` result.
        out_dir: where ``trials.jsonl``, ``results.md``, each trial's results (``trial-NNN.*``) and,
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

    Raises:
        SweepError: bad sweep file or parameters (before any trial runs).
    """
    if not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    for notice in sweep.notices:
        log(f"note: {notice}")
    if sweep.method == "bayes":
        log(
            "note: method bayes runs locally as random search (Bayesian search needs the W&B server: wandb agent)"
        )
    trials = expand_trials(sweep, count, seed)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(out_dir) if out_dir else Path("runs") / "sweeps" / f"{sweep.name}-{stamp}"
    if not dry_run and (out / "trials.jsonl").exists():
        raise SweepError(f"--out {out} already holds a sweep (trials.jsonl): choose another directory")
    overrides: dict[str, Any] = {}
    if smoke:
        import tempfile

        # The prompt file goes to a temporary directory: nothing is written before validation.
        model, tokenizer, overrides = smoke_setup(Path(tempfile.mkdtemp(prefix="selfspec-smoke-")))
        log(
            f"smoke mode: a tiny random 4-block model, prompts {overrides['data']}, max_new_tokens "
            f"{overrides['max_new_tokens']}: this checks the machinery, the numbers mean nothing"
        )
    validate_trials(sweep, trials, overrides=overrides)
    mode, notice = wandb_mode(mode)
    result = SweepResult(sweep, out, trials=trials)
    if dry_run:
        log(_header(sweep, len(trials), seed, overrides))
        for i, params in enumerate(trials, 1):
            log(f"trial {i}: {command_line(params)}")
        log(f"\n{len(trials)} trials validated; nothing was run (--dry-run)")
        return result
    if notice:
        log(notice)
    out.mkdir(parents=True, exist_ok=True)
    jsonl, md = out / "trials.jsonl", out / "results.md"
    md.write_text(
        _header(sweep, len(trials), seed, overrides) + "\n" + results_table(sweep, []) + "\n",
        encoding="utf-8",
    )
    init: dict[str, Any] = {"project": sweep.project, "group": f"{sweep.name}-{stamp}", "tags": [sweep.name]}
    if sweep.entity:
        init["entity"] = sweep.entity
    if mode != "disabled":
        import wandb as wb

        if not os.environ.get("WANDB_DIR"):
            init["dir"] = str(out)
        init["settings"] = wb.Settings(console="off", silent=True)
    log(
        f"sweep {sweep.name}: {len(trials)} trials -> {out}"
        + (f" (W&B {mode})" if mode != "disabled" else "")
    )
    try:
        for i, params in enumerate(trials, 1):
            tag = f"[trial {i}/{len(trials)}]"
            log(f"{tag} {describe_params(params, sweep.swept or list(params))}")
            row: dict[str, Any] = {"trial": i, "params": params, "status": "ok", "metrics": {}}
            t0 = time.perf_counter()
            try:
                res = train(
                    params,
                    model=model,
                    tokenizer=tokenizer,
                    output=str(out / f"trial-{i:03d}.jsonl"),
                    mode=mode,
                    init={**init, "name": f"{sweep.name}-{i:03d}"},
                    overrides=overrides,
                    log=lambda s, tag=tag: log(f"{tag} {s}"),
                )
                row.update(metrics=res["metrics"], output=res["output"], wandb=res["wandb_dir"])
            except (SweepError, *USER_ERRORS) as err:  # what only the model can reject (a skip set)
                row.update(status="failed", error=str(err))
                log(f"{tag} failed: {err}")
            row["seconds"] = round(time.perf_counter() - t0, 2)
            result.rows.append(row)
            with jsonl.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(row, default=str) + "\n")
            with md.open("a", encoding="utf-8") as fh:
                fh.write(results_table(sweep, [row]).splitlines()[-1] + "\n")
            if row["status"] == "ok":
                log(
                    f"{tag} {sweep.metric} {_cell(row['metrics'].get(sweep.metric))} ({row['seconds']:.0f} s)"
                )
    except KeyboardInterrupt:
        result.interrupted = True
    result.table = results_table(sweep, result.rows)
    done = f"{len(result.rows)} of {len(trials)} trials" + (" (interrupted)" if result.interrupted else "")
    md.write_text(
        _header(sweep, len(trials), seed, overrides) + f"\n{done}, best first:\n\n{result.table}\n",
        encoding="utf-8",
    )
    log(f"\n## Sweep {sweep.name}: {done}, best {sweep.metric} first\n\n{result.table}\n")
    log(f"results: {md} and {jsonl}")
    if mode == "offline":
        runs = Path(os.environ.get("WANDB_DIR") or out) / "wandb"
        log(f"W&B offline runs: {runs}/offline-run-*; upload them with `wandb sync {runs}/offline-run-*`")
    return result


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sweep.py",
        allow_abbrev=False,
        description="Run a W&B sweep file (experiments/sweeps/*.yaml) locally, trial after trial, with the "
        "W&B runs written offline; or run one trial from wandb.config (--trial, what `wandb agent` calls).",
        epilog="With a W&B server: wandb sweep FILE, then wandb agent ENTITY/PROJECT/SWEEP_ID (or "
        "python experiments/sweep.py --agent ENTITY/PROJECT/SWEEP_ID). See docs/howto/sweeps.md.",
    )
    p.add_argument("file", nargs="?", metavar="FILE", help="a sweep YAML (W&B's sweep configuration format)")
    p.add_argument(
        "--count", type=int, default=None, help="trials to run (grid: the first N; random: N draws)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random search (default 0)")
    p.add_argument(
        "--out", default=None, metavar="DIR", help="output directory (default runs/sweeps/<name>-<time>)"
    )
    p.add_argument("--dry-run", action="store_true", help="validate and list the trials; run nothing")
    p.add_argument("--no-wandb", action="store_true", help="do not log the trials to W&B at all")
    p.add_argument(
        "--online", action="store_true", help="log the trials to the W&B server (needs wandb login)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"a tiny random model and prompt file: checks the sweep in seconds (also: {SMOKE_ENV}=1)",
    )
    p.add_argument(
        "--trial", action="store_true", help="run one trial from wandb.config (what `wandb agent` calls)"
    )
    p.add_argument(
        "--agent", metavar="SWEEP_ID", default=None, help="run `wandb agent SWEEP_ID` in this process"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_sweep_parser()
    args, unknown = parser.parse_known_args(argv)
    smoke = args.smoke or os.environ.get(SMOKE_ENV) == "1"
    # Under `wandb agent` with W&B's default command (`${args}`), the trial's parameters also arrive
    # as --name=value flags; wandb.config holds the same values, so they are ignored.
    agent_call = args.trial or (
        args.file is None and not args.agent and bool(os.environ.get("WANDB_SWEEP_ID"))
    )

    def body() -> int:
        if unknown and not agent_call:
            raise SweepError(f"unrecognised arguments: {' '.join(unknown)} (see --help)")
        if agent_call or args.agent:
            model = tokenizer = None
            overrides: dict[str, Any] = {}
            if smoke:
                out = Path("runs") / "sweeps" / os.environ.get("WANDB_SWEEP_ID", "local")
                model, tokenizer, overrides = smoke_setup(out)

            def trial() -> None:
                train(model=model, tokenizer=tokenizer, overrides=overrides)

            if agent_call:
                trial()
                return 0
            if not has_wandb_credentials():
                raise SweepError("--agent needs a W&B login: run `wandb login` (or set WANDB_API_KEY)")
            import wandb as wb

            wb.agent(args.agent, function=trial, count=args.count)
            return 0
        if args.file is None:
            raise SweepError(
                "give a sweep file, e.g. python experiments/sweep.py experiments/sweeps/static.yaml"
            )
        if args.online and args.no_wandb:
            raise SweepError("--online and --no-wandb contradict each other")
        env_off = os.environ.get("WANDB_MODE", "").lower() == "disabled"
        result = run_sweep(
            args.file,
            out_dir=args.out,
            count=args.count,
            seed=args.seed,
            mode="disabled" if args.no_wandb or env_off else "online" if args.online else "offline",
            dry_run=args.dry_run,
            smoke=smoke,
        )
        if result.interrupted:
            print("interrupted: every finished trial is in the results table", file=sys.stderr)
            return 130
        if result.failed:
            print(
                f"error: {result.failed} of {len(result.rows)} trials failed (see the table)", file=sys.stderr
            )
            return 1
        return 0

    return guarded(body, "every finished trial is in the results table", errors=(SweepError,))


if __name__ == "__main__":
    sys.exit(main())
