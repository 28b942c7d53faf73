"""Command line: ``python experiments/run.py --selector static --length confidence ...``.

Strategy names and their hyper-parameter flags come from the registry: every field ``f`` of a
registered strategy's config is settable as ``--<kind>.<f> VALUE`` (``--selector.skip_ratio 0.3``,
``--length.threshold 0.7``). Out-of-tree strategies are loaded with ``--import my_pkg.module``.
Bad input exits with status 2 and a message naming the flag, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Callable, Sequence

from framework.config import ConfigError, build_config, field_defaults, field_help
from framework.experiment.data import DataError
from framework.experiment.models import DTYPES, ModelLoadError
from framework.experiment.plugins import load_builtin_strategies
from framework.experiment.presets import MissingStrategyError, list_presets, load_preset
from framework.interfaces import REGISTRIES
from framework.registry import UnknownNameError
from framework.utils import MissingDependencyError

#: Strategy names used when neither --method nor the flag names one.
DEFAULTS = {"selector": "static", "length": "confidence", "drafter": "layer_skip", "verifier": "greedy"}

#: Short flags for the most used strategy fields: ``--skip-set F`` is ``--selector.skip_set F``.
ALIASES = {
    "--skip-set": ("selector", "skip_set"),
    "--calib-data": ("selector", "calib_data"),
    "--calib-limit": ("selector", "calib_limit"),
}

USER_ERRORS = (ConfigError, UnknownNameError, DataError, ModelLoadError, MissingDependencyError)


def list_strategies(verbose: bool = True) -> str:
    """Every registry with each name's one-line description (and its config fields)."""
    lines = []
    for kind, reg in REGISTRIES.items():
        lines.append(f"{kind}s (--{kind}):")
        for e in reg.entries():
            lines.append(f"  {e.name:<22} {e.description}")
            if verbose:
                helps, defaults = field_help(e.config), field_defaults(e.config)
                for f in dataclasses.fields(e.config):
                    lines.append(
                        f"      --{kind}.{f.name} (default {defaults.get(f.name)!r}): {helps[f.name]}"
                    )
        lines.append("")
    lines.append("presets (--method):")
    for name in list_presets():
        try:
            desc = load_preset(name)["description"].splitlines()[0]
        except MissingStrategyError as err:
            desc = f"(needs {err.kind} {err.strategy!r}, not implemented yet)"
        lines.append(f"  {name:<22} {desc}")
    return "\n".join(lines)


def _import_user_modules(argv: Sequence[str]) -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--import", dest="imports", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    for mod in known.imports:
        try:
            importlib.import_module(mod)
        except ImportError as err:
            raise ConfigError("--import", mod, f"an importable module ({err})") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py",
        description="Self-speculative decoding experiment: decode every prompt with vanilla greedy decoding and "
        "with the chosen strategies, interleaved, and print speedup, M, alpha and the lossless check.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Strategy hyper-parameters: --<kind>.<field> VALUE (see --list for every field and default).",
    )
    p.add_argument(
        "--list", action="store_true", help="list every registered strategy with its config fields and exit"
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration as JSON and exit"
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module that registers extra strategies (repeatable)",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", default=None, help="HF model directory or hub id (default: embedded SmolLM2-135M-Instruct)"
    )
    g.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)} (default float32)")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument(
        "--no-kernels",
        dest="kernels",
        action="store_false",
        help="stock PyTorch instead of the batch-invariant CPU kernels (float32 on CPU; also SELFSPEC_KERNEL=0)",
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="Spec-Bench-format JSONL (default: the built-in suite)")
    g.add_argument("--categories", default="", help="comma-separated categories to keep (e.g. mt_bench,qa)")
    g.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    g.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per turn (default 128)")
    g.add_argument(
        "--stop", action="append", default=[], metavar="STRING", help="extra stop string (repeatable)"
    )
    g = p.add_argument_group("strategies")
    g.add_argument(
        "--method",
        default=None,
        metavar="PRESET",
        help="a preset from framework/experiment/assets/presets/ ("
        + ", ".join(list_presets())
        + ") or a YAML file; "
        "every flag below overrides it",
    )
    for kind, reg in REGISTRIES.items():
        g.add_argument(
            f"--{kind}",
            default=None,
            metavar="{" + ",".join(reg.names()) + "}",
            help=f"{kind} (default {DEFAULTS[kind]})",
        )
    g = p.add_argument_group("offline search (selfsd_bo)")
    for flag, (kind, fname) in ALIASES.items():
        g.add_argument(flag, dest=f"{kind}.{fname}", default=None, metavar="V", help=f"= --{kind}.{fname}")
    g = p.add_argument_group("strategy hyper-parameters")
    for kind, reg in REGISTRIES.items():
        owners: dict[str, list[str]] = {}
        for e in reg.entries():
            for f in dataclasses.fields(e.config):
                owners.setdefault(f.name, []).append(e.name)
        for fname, names in sorted(owners.items()):
            g.add_argument(
                f"--{kind}.{fname}",
                dest=f"{kind}.{fname}",
                default=None,
                metavar="V",
                help=f"({', '.join(names)})",
            )
    g = p.add_argument_group("output")
    g.add_argument(
        "--output", default=None, help="results JSONL, appended (default runs/<method>-<time>.jsonl)"
    )
    g.add_argument("--name", default=None, help="method name in the results (default <selector>+<length>)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup", type=int, default=1, help="warm-up generations per method (default 1)")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue --output FILE: skip the prompts already in it (refused if written by another configuration)",
    )
    g.add_argument(
        "--logger",
        default="wandb",
        help="wandb (default; offline without an API key, upload later with `wandb sync`), csv or none",
    )
    g.add_argument("--wandb-project", default="selfspec", help="W&B project (default selfspec)")
    g.add_argument("--no-plots", dest="plots", action="store_false", help="do not save PNG plots")
    g = p.add_argument_group("devices")
    g.add_argument(
        "--devices",
        type=int,
        default=1,
        help="processes per node, each decoding its share of the prompts (DDP)",
    )
    g.add_argument("--num-nodes", type=int, default=1, help="nodes (Lightning's multi-node DDP environment)")
    return p


def config_from_args(args: argparse.Namespace):
    """Build a validated `RunConfig` from parsed arguments."""
    from framework.experiment.runner import RunConfig, StrategySpec

    preset = load_preset(args.method) if args.method else {}
    specs = {}
    for kind, reg in REGISTRIES.items():
        from_preset = dict(preset.get(kind, {}))
        preset_name = from_preset.pop("name", None)
        name = getattr(args, kind) or preset_name or DEFAULTS[kind]
        entry = reg.entry(name)  # UnknownNameError lists the registered names
        # The preset's fields apply to its own strategy only; a flag naming another one drops them.
        values = from_preset if name == preset_name else {}
        values.update(
            {
                key.split(".", 1)[1]: val
                for key, val in vars(args).items()
                if key.startswith(f"{kind}.") and val is not None
            }
        )
        specs[kind] = StrategySpec(name, build_config(entry.config, values, flag_prefix=f"--{kind}."))
    return RunConfig(
        model=args.model,
        dtype=args.dtype
        if args.dtype in DTYPES
        else _bad("--dtype", args.dtype, f"one of {', '.join(DTYPES)}"),
        device=args.device,
        data=args.data,
        categories=tuple(c.strip() for c in args.categories.split(",") if c.strip()),
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        output=args.output,
        seed=args.seed,
        warmup=args.warmup,
        threads=args.threads,
        stop_strings=tuple(args.stop),
        resume=args.resume,
        kernels=args.kernels,
        logger=args.logger,
        wandb_project=args.wandb_project,
        plots=args.plots,
        devices=args.devices,
        num_nodes=args.num_nodes,
        name=args.name or preset.get("name"),
        baseline_only=preset.get("baseline_only", False),
        **specs,
    )


def _bad(flag: str, value, allowed: str):
    raise ConfigError(flag, value, allowed)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        load_builtin_strategies()
        _import_user_modules(argv)
        args = build_parser().parse_args(argv)
        if args.list:
            print(list_strategies())
            return 0
        cfg = config_from_args(args)
        if args.print_config:
            print(json.dumps(cfg.describe(), indent=2, default=str))
            return 0
        from framework.experiment.runner import run

        run(cfg)
        return 0

    return guarded(
        body,
        "every finished prompt is in the output file; continue with the same flags plus --resume --output FILE",
    )


def guarded(body: Callable[[], int], interrupted: str, errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a command's ``body`` and turn its failures into exit statuses: bad input (``USER_ERRORS``,
    ``errors``, and ValueError such as ``--device cuda`` without CUDA) prints one ``error:`` line and
    returns 2; Ctrl-C prints ``interrupted: <interrupted>`` and returns 130."""
    try:
        return body()
    except (*USER_ERRORS, *errors, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {interrupted}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
