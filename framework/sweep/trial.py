"""One sweep trial: sweep parameters -> a validated `RunConfig` -> one experiment -> summary metrics.

Parameter names are the run options of ``experiments/run.py`` without the dashes, generated from
`RunConfig`'s fields (their flags and aliases): ``method`` (a preset), ``limit``,
``max_new_tokens`` (``max-new-tokens`` too), ``categories``, ``threads``, ``stop``, ``selector``
(a strategy name), ``selector.skip_ratio``, ``length.threshold``, ``gate.enabled`` and every other
``<kind>.<field>`` that ``run.py --list`` prints, ``skip_set`` (``selector.skip_set``), ``no_plots``,
``import`` (modules that register strategies). A trial's config is
``RunConfig.from_preset(params["method"], **overrides)``; values are spelled as on the command
line (lists comma-joined, ``true``/``false``, ``none``) and parsed with the field's type.

`train` is what ``wandb agent`` runs (and what a local sweep calls per trial): it reads the
parameters from ``wandb.config``, runs `framework.runner.pipeline.run` and logs ``speedup``,
``mean_accepted_tokens``, ``alpha``, ... to the W&B run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from framework.config_fields import ConfigError
from framework.data.prompts import load_prompts
from framework.interfaces import REGISTRIES
from framework.models.loading import TINY_MODEL, load_model
from framework.results.metrics import aggregate, speedup
from framework.runner.pipeline import run as run_experiment
from framework.session.errors import USER_ERRORS
from framework.session.flags import flag_name
from framework.session.loggers import has_wandb_credentials
from framework.session.plugins import import_user_modules
from framework.session.run_config import FLAT_KEYS, SECTIONS, MethodConfig, RunConfig
from framework.sweep.spec import Sweep, SweepError

#: Run options a sweep may not set: the sweep owns the output files (answer files included), and
#: these only print.
FORBIDDEN_OPTIONS = ("help", "list", "print_config", "output", "specbench_answers")
#: Parameters naming modules to import before the config is built (``--import``).
IMPORT_OPTIONS = ("import", "imports")
#: Set to 1 to run `--trial` (what `wandb agent` calls) in smoke mode: the agent passes no flags.
SMOKE_ENV = "SELFSPEC_SWEEP_SMOKE"
SMOKE_MAX_NEW_TOKENS = 8


# --------------------------------------------------------------------------------------------
# Sweep parameters -> RunConfig overrides
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunOption:
    """What a sweep parameter name sets: the `RunConfig` override ``key``; ``negate`` for the
    ``no_<flag>`` spelling of a boolean; ``repeat`` for a repeatable flag (``stop``)."""

    key: str
    negate: bool = False
    repeat: bool = False


def _bare(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def run_options() -> dict[str, RunOption]:
    """``{parameter name: RunOption}`` for every run option a sweep may set, generated from
    `RunConfig`'s sections: each field by its flat key (`FLAT_KEYS`) and its flags' spellings
    without dashes (``max_new_tokens``, ``stop`` for ``stop_strings``), ``no_<flag>`` for booleans,
    the strategy flags' short aliases (``skip_set`` for ``selector.skip_set``) and ``method``."""
    table: dict[str, RunOption] = {"method": RunOption("method")}
    for key, (section, name) in FLAT_KEYS.items():
        if key in FORBIDDEN_OPTIONS or section == "compare":  # a trial is one method
            continue
        cls = SECTIONS[section]
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        repeat = bool(f.metadata.get("repeat"))
        flags = [flag_name(f), *f.metadata.get("aliases", ())]
        for alias in (key, *map(_bare, flags)):
            table.setdefault(alias, RunOption(key, repeat=repeat))
        if typing.get_type_hints(cls)[name] is bool:
            for flag in flags:
                table.setdefault("no_" + _bare(flag), RunOption(key, negate=True))
    for f in dataclasses.fields(MethodConfig):
        kind = f.metadata.get("strategy")
        if kind is None:  # the gate (name and baseline_only are plain fields, in the table already)
            table.setdefault(f.name, RunOption(f.name))
            continue
        table.setdefault(kind, RunOption(kind))
        for alias, fname in f.metadata.get("field_aliases", {}).items():
            table.setdefault(_bare(alias), RunOption(f"{kind}.{fname}"))
    return table


def _dotted_heads() -> list[str]:
    """What takes ``<key>.<field>`` parameters: the strategy kinds, the gate and the sections."""
    return [*REGISTRIES, "gate", *SECTIONS]


def format_value(value: Any) -> str:
    """A YAML / wandb.config value as the command line spells it (``true``, ``none``, ``8`` for
    ``8.0``, lists comma-joined)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value)
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
    heads = _dotted_heads()
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in heads and isinstance(value, dict):
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


def _unknown_name(key: str, table: dict[str, RunOption]) -> SweepError:
    hint = ""
    if key in FORBIDDEN_OPTIONS:
        hint = " (the sweep sets each trial's output itself)" if key == "output" else " (it only prints)"
    elif key in _strategy_fields():
        hint = f" (did you mean {' or '.join(_strategy_fields()[key])}?)"
    allowed = sorted({*table, *IMPORT_OPTIONS[:1]})
    return SweepError(
        f"sweep parameter {key!r} is not a run option{hint}; allowed: {', '.join(allowed)}, "
        f"or <kind>.<field> with kind one of {', '.join(_dotted_heads())} (python experiments/run.py "
        "--list prints every strategy's fields)"
    )


def _import_modules(params: dict[str, Any]) -> None:
    mods = params.get("import", params.get("imports", []))
    try:
        import_user_modules(
            [mods] if isinstance(mods, str) else list(mods or []), flag="sweep parameter 'import'"
        )
    except ConfigError as err:
        raise SweepError(str(err)) from None


def run_overrides(params: dict[str, Any]) -> dict[str, Any]:
    """`RunConfig.from_preset` overrides for sweep parameters (``method`` and ``import`` left out):
    names translated (`run_options`), values typed as the sweep file has them (the config coerces
    them with the fields' types: `framework.config_fields.coerce_value`; no round trip through
    command-line text).

    Raises:
        SweepError: a name that is not a run option (the message lists the allowed ones).
    """
    table = run_options()
    heads = _dotted_heads()
    out: dict[str, Any] = {}
    for raw, value in params.items():
        key = str(raw)
        if key in IMPORT_OPTIONS or key == "method":
            continue
        if "." in key:
            if key.split(".", 1)[0] not in heads:
                raise _unknown_name(key, table)
            out[key] = value
            continue
        opt = table.get(key.replace("-", "_"))
        if opt is None:
            raise _unknown_name(key, table)
        if opt.negate:
            out[opt.key] = not _truth(key, value)
        elif opt.repeat:
            out[opt.key] = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        else:
            out[opt.key] = value
    return out


def check_names(names: Sequence[str], imports: Any = None) -> None:
    """Raise `SweepError` for a parameter name that is not a run option (before any value is built)."""
    _import_modules({"import": imports or []})
    run_overrides(dict.fromkeys(names))


def _parameter_of(flag: Any, params: dict[str, Any]) -> str | None:
    """The sweep parameter behind a config error's flag (``--max-new-tokens`` -> ``max_new_tokens``)."""
    if not isinstance(flag, str):
        return None
    bare = flag.lstrip("-")
    for key in (bare, bare.replace("-", "_")):
        if key in params:
            return key
    table = run_options()
    for key in params:
        opt = table.get(str(key).replace("-", "_"))
        if opt is not None and opt.key in (bare, bare.replace("-", "_")):
            return str(key)
    return None


def build_run_config(params: dict[str, Any], *, output: str | None = None) -> RunConfig:
    """A validated `RunConfig` from sweep parameters: ``RunConfig.from_preset(params["method"],
    **overrides)`` (see the module docstring for the names and values).

    Raises:
        SweepError: a name that is not a run option, or a value that a config rejects (the
            message names the parameter).
        ConfigError, UnknownNameError: other invalid options.
    """
    params = _flatten({k: v for k, v in params.items() if not str(k).startswith("_")})
    _import_modules(params)
    overrides = run_overrides(params)
    mods = params.get("import", params.get("imports"))
    if mods:  # recorded in the trial's configuration, with the hash of each source
        overrides["imports"] = (mods,) if isinstance(mods, str) else tuple(mods)
    if output is not None:
        overrides["output"] = output
    method = params.get("method")
    try:
        return RunConfig.from_preset(None if method is None else format_value(method), **overrides)
    except ConfigError as err:
        name = _parameter_of(err.field, params)
        if name is not None:
            raise SweepError(f"sweep parameter {name!r}: {err}") from None
        raise


def describe_params(params: dict[str, Any], names: Sequence[str] | None = None) -> str:
    keys = names if names is not None else list(params)
    return ", ".join(f"{k}={format_value(params[k])}" for k in keys if k in params)


def command_line(params: dict[str, Any]) -> str:
    """The ``run.py`` invocation equivalent to one trial (for --dry-run)."""
    parts = ["python experiments/run.py"]
    for key, value in params.items():
        flag = "--" + (key if "." in key else key.replace("_", "-"))
        vals = value if key == "stop" and isinstance(value, list) else [value]
        for v in vals:
            parts.append(f"{flag} {format_value(v)}")
    return " ".join(parts)


def validate_trials(
    sweep: Sweep, trials: list[dict[str, Any]], *, overrides: dict[str, Any] | None = None
) -> list[RunConfig]:
    """Check every parameter name, build every trial's `RunConfig` and load each distinct prompt
    selection, before anything runs (no model is loaded).

    Returns the configs. Raises `SweepError` naming the file, the first bad trial and the parameter.
    """
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
        key = (cfg.data.path, cfg.data.categories, cfg.data.limit, cfg.data.offset)
        if key not in seen:
            seen.add(key)
            try:
                load_prompts(cfg.data.path, cfg.data.categories or None, cfg.data.limit, cfg.data.offset)
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


def _model_for(cfg: RunConfig) -> tuple[Any, Any]:
    """The loaded model and tokenizer for ``cfg``, kept between trials (one model at a time)."""
    key = (cfg.model.name_or_path, cfg.model.dtype, cfg.model.device, cfg.model.device_map)
    if key not in _MODEL_CACHE:
        _MODEL_CACHE.clear()
        m = cfg.model
        _MODEL_CACHE[key] = load_model(m.name_or_path, m.dtype, m.device, m.device_map)
    return _MODEL_CACHE[key]


def smoke_setup(directory: Path) -> tuple[Any, Any, dict[str, Any]]:
    """Smoke mode: the tiny random model and tokenizer of ``--model tiny-random``, and the run
    options that go with them (``model: tiny-random``, so that every trial's metadata and saved
    configuration name the model that ran and ``--config`` reruns it; a prompt file of the tiny
    vocabulary in ``directory``, one prompt per built-in category; short generations)."""
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
    model, tokenizer = load_model(TINY_MODEL, "float32", "cpu")
    # One thread: the tiny matmuls only lose from intra-op threading.
    options = {"model": TINY_MODEL, "data": str(data), "max_new_tokens": SMOKE_MAX_NEW_TOKENS, "threads": 1}
    return model, tokenizer, options


def summarize(records: list[dict[str, Any]], method: str) -> dict[str, float]:
    """Overall metrics of ``method`` against vanilla (as in the results table), plus per category
    ``<category>/speedup``, ``<category>/mean_accepted_tokens`` and ``<category>/alpha``."""
    out: dict[str, float] = {}
    for cat, by_method in aggregate(records).items():
        base, m = by_method.get("vanilla"), by_method.get(method, by_method.get("vanilla"))
        if base is None or m is None:
            continue
        vals = {
            "speedup": speedup(m.tokens_per_s, base.tokens_per_s),
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
    ``wandb.init`` records), builds the validated `RunConfig` (`build_run_config`),
    runs the experiment and logs the summary metrics to the run (``wandb.log`` and ``run.summary``).

    Args:
        config: the trial's parameters (``{"selector.skip_ratio": 0.3, ...}``); ``None`` under
            ``wandb agent``, which supplies them through ``wandb.config``.
        model: an already loaded model (else one is loaded, and kept for the next trial).
        tokenizer: its tokenizer.
        output: the trial's run folder (default ``runs/sweeps/<sweep id or local>/<run id>``).
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
            output = str(Path("runs") / "sweeps" / os.environ.get("WANDB_SWEEP_ID", "local") / stem)
        extra = dict(overrides or {})
        if mode == "disabled" and "logger" not in params:
            extra.setdefault("logger", "none")  # the runner's own W&B logger would start a run
        cfg = build_run_config({**params, **extra}, output=output)
        if model is None:
            model, tokenizer = _model_for(cfg)
        result = run_experiment(cfg, log=log, model=model, tokenizer=tokenizer)
        if "records" not in result:  # a non-zero rank of a multi-process run: rank 0 reports
            result = {"records": [], "output": str(cfg.runner.output)}
        metrics = summarize(result["records"], cfg.method.label)
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


__all__ = [
    "SMOKE_ENV",
    "RunOption",
    "build_run_config",
    "check_names",
    "command_line",
    "describe_params",
    "format_value",
    "run_options",
    "run_overrides",
    "smoke_setup",
    "summarize",
    "train",
    "validate_trials",
    "wandb_mode",
]
