"""Sweep files: W&B sweep configurations (``experiments/sweeps/*.yaml``) parsed, checked and expanded
into trials.

A sweep file has ``method`` (grid, random, bayes), ``metric`` ({name, goal}) and ``parameters``;
`load_sweep` checks its structure and every parameter entry (a constant, a list of values, or one
of W&B's distributions), `expand_trials` turns it into the trials' parameter dicts (the grid's
cartesian product in file order, or seeded random draws). Whether the parameter *names and values*
are valid run options is `framework.sweep.trial`'s business.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.session.presets import yaml_problem

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
DEFAULT_PROJECT = "selfspec-sweeps"


class SweepError(ValueError):
    """A sweep file or sweep parameter is invalid (the message says which and what is allowed)."""


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
    dist = spec.get("distribution") or _inferred_distribution(name, spec)
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
        return _categorical(name, spec)
    if dist in ("normal", "q_normal"):
        mu = _number(name, "mu", spec.get("mu", 0.0))
        sigma = _number(name, "sigma", spec.get("sigma", 1.0))
        if sigma <= 0:
            raise SweepError(f"parameter {name!r}: sigma must be > 0, got {sigma}")
        q = _number(name, "q", spec.get("q", 1)) if dist == "q_normal" else None
        return Param(name, dist, mu=mu, sigma=sigma, q=q)
    return _ranged(name, dist, spec)


def _inferred_distribution(name: str, spec: dict[str, Any]) -> str:
    """W&B's inference of a distribution from the keys given: value -> constant, values ->
    categorical, min/max of ints -> int_uniform (else uniform), mu/sigma -> normal."""
    if "value" in spec:
        return "constant"
    if "values" in spec:
        return "categorical"
    if "min" in spec or "max" in spec:
        both_int = all(
            isinstance(spec.get(k), int) and not isinstance(spec.get(k), bool) for k in ("min", "max")
        )
        return "int_uniform" if both_int else "uniform"
    if "mu" in spec or "sigma" in spec:
        return "normal"
    raise SweepError(f"parameter {name!r}: give value, values, min/max or a distribution")


def _categorical(name: str, spec: dict[str, Any]) -> Param:
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
    return Param(name, "categorical", values=tuple(values), probabilities=tuple(probs) if probs else None)


def _ranged(name: str, dist: str, spec: dict[str, Any]) -> Param:
    """A distribution between ``min`` and ``max`` (uniform, int, log, quantised)."""
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
        raise SweepError(f"{path}: not valid YAML ({yaml_problem(err)})") from None
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
    notices: list[str] = []
    name, goal = _metric(path, data.get("metric"), notices)
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


def _metric(path: Path, metric: Any, notices: list[str]) -> tuple[str, str]:
    """``(name, goal)`` of a sweep file's ``metric`` (``speedup``, maximised, when it has none;
    W&B's default goal, minimize, when it names none: both noted in ``notices``)."""
    if metric is None:
        notices.append("no metric in the sweep file: ranking by speedup (maximize)")
        return "speedup", "maximize"
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
    return name, goal


def _known_metric(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    return name in METRICS or ("/" in name and name.rsplit("/", 1)[1] in METRICS)


def expand_trials(sweep: Sweep, count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The trials' parameters: the grid's cartesian product (in file order), or seeded random draws.

    ``bayes`` is drawn like ``random`` here: the local runner runs the first of them as its random
    start and proposes the rest from a GP as the trials finish (`framework.sweep.bayes`); every
    draw is validated up front all the same. ``count`` keeps the first N grid points; random and
    bayes search need it (or the file's ``run_cap``).
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


__all__ = [
    "DISTRIBUTIONS",
    "METRICS",
    "SEARCH_METHODS",
    "Param",
    "Sweep",
    "SweepError",
    "expand_trials",
    "load_sweep",
    "parse_param",
]
