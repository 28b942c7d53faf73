"""Command line: ``python experiments/run.py --method swift --limit 2`` (also the ``selfspec`` script).

The flags are generated from the fields of `RunConfig` (``framework.session.flags``): every
field is a flag (``max_new_tokens`` -> ``--max-new-tokens``), each strategy kind is ``--<kind>
NAME`` plus ``--<kind>.<f> VALUE`` for every field ``f`` of a registered strategy's config
(``--selector.skip_ratio 0.3``), and the draft gate is ``--gate.<f>``. The command line builds
its config with ``RunConfig.from_preset(--method, **flags given)`` (or, with ``--config FILE``,
``RunConfig.load(FILE).replace(**flags given)``), so it follows exactly the rules of the Python
API. Out-of-tree strategies are loaded with ``--import my_pkg.module``. Bad input exits with
status 2 and a message naming the flag, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from framework.config_fields import field_defaults, field_help
from framework.interfaces import REGISTRIES
from framework.models.loading import describe_models
from framework.results.records import read_records
from framework.runner.launch import resolve_output, run
from framework.session.errors import USER_ERRORS, OneLineParser, guarded, pop_debug
from framework.session.flags import add_config_flags, config_overrides_from_args
from framework.session.notes import PAPER_PRESETS, published_by
from framework.session.plugins import import_recorded, import_user_modules
from framework.session.presets import MissingStrategyError, list_presets, load_preset
from framework.session.run_config import RunConfig

__all__ = [
    "USER_ERRORS",
    "build_parser",
    "config_from_args",
    "guarded",
    "list_strategies",
    "main",
    "print_config",
]

#: The ``--help`` section of each `RunConfig` field.
GROUPS = {
    **dict.fromkeys(
        (
            "model",
            "dtype",
            "device",
            "threads",
            "kernels",
            "exact",
            "phase_timing",
            "cuda_graphs",
            "cuda_graph_route",
        ),
        "model",
    ),
    **dict.fromkeys(("data", "categories", "limit", "offset", "max_new_tokens", "stop_strings"), "data"),
    **dict.fromkeys((*REGISTRIES, "baseline_only"), "strategies"),
    "gate": "draft gate (framework.drafting.gate)",
    **dict.fromkeys(
        (
            "output",
            "name",
            "seed",
            "warmup",
            "resume",
            "logger",
            "wandb_project",
            "plots",
            "specbench_answers",
        ),
        "output",
    ),
    **dict.fromkeys(("devices", "num_nodes"), "devices"),
}


def list_strategies(verbose: bool = True) -> str:
    """Every registry with each name's one-line description (and its config fields), the presets and
    the named models."""
    lines = []
    published = {kind: published_by(kind) for kind in REGISTRIES}
    for kind, reg in REGISTRIES.items():
        lines.append(f"{kind}s (--{kind}):")
        for e in reg.entries():
            lines.append(f"  {e.name:<22} {e.description}")
            if e.name in published[kind]:
                lines.append(
                    f"  {'':<22} (a building block with this framework's defaults; as published: "
                    f"--method {published[kind][e.name]})"
                )
            if verbose:
                helps, defaults = field_help(e.config), field_defaults(e.config)
                for f in dataclasses.fields(e.config):
                    lines.append(
                        f"      --{kind}.{f.name} (default {defaults.get(f.name)!r}): {helps[f.name]}"
                    )
        lines.append("")
    lines.append(
        "presets (--method; [paper]: a seed paper's method as published, the others add this framework's parts):"
    )
    for name in list_presets():
        try:
            desc = load_preset(name)["description"].splitlines()[0]
        except MissingStrategyError as err:
            desc = f"(needs {err.kind} {err.strategy!r}, not implemented yet)"
        tag = "[paper] " if name in PAPER_PRESETS else ""
        lines.append(f"  {name:<22} {tag}{desc}")
    lines += ["", describe_models()]
    return "\n".join(lines)


def _import_user_modules(argv: Sequence[str]) -> None:
    """Import the ``--import`` modules, and those a ``--config`` file recorded, before the parser
    is built (their strategies get flags)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--import", dest="imports", action="append", default=[])
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    import_user_modules(known.imports)
    if known.config and Path(known.config).is_file():  # an unreadable file is reported by the load
        try:
            saved = yaml.safe_load(Path(known.config).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError:
            return
        method = saved.get("method") if isinstance(saved, dict) else None
        if isinstance(method, dict) and method.get("imports"):
            import_recorded(method["imports"])


def build_parser() -> argparse.ArgumentParser:
    """The ``run.py`` parser: the tool's own flags plus the flags generated from `RunConfig` (the
    ``--import`` modules must be imported first; the built-in strategies register themselves on the
    registries' first lookup)."""
    p = OneLineParser(
        prog="run.py",
        description="Self-speculative decoding experiment: decode every prompt with vanilla greedy decoding and "
        "with the chosen strategies, interleaved, and print speedup, M, alpha and the lossless check.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Strategy hyper-parameters: --<kind>.<field> VALUE (see --list for every field and default).\n\n"
        "examples:\n"
        "  python experiments/run.py --limit 1                      # the default strategies, 1 prompt per category\n"
        "  python experiments/run.py --method swift --limit 2       # a published method (a preset)\n"
        "  python experiments/run.py --selector clasp_dp --length fixed --length.k 4\n"
        "  python experiments/run.py --list                         # every strategy, flag and preset",
    )
    p.add_argument(
        "--list", action="store_true", help="list every registered strategy with its config fields and exit"
    )
    p.add_argument(
        "--print-config",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the resolved configuration as YAML to FILE (default: stdout) and exit; "
        "`run.py --config FILE` runs it",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--method",
        default=None,
        metavar="PRESET",
        help="a preset from framework/session/assets/presets/ ("
        + ", ".join(list_presets())
        + ") or a YAML file; every other flag overrides it",
    )
    source.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a saved configuration (--print-config FILE, or <output>.config.yaml of a run); "
        "every other flag overrides it",
    )
    add_config_flags(p, RunConfig, groups=GROUPS)
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The validated `RunConfig` of parsed arguments: ``--config FILE`` or the ``--method``
    preset (defaults when neither), with every generated flag that was given applied on top.

    Raises:
        ConfigError: an invalid value, named by its flag (UnknownNameError: a strategy name).
    """
    overrides = config_overrides_from_args(args)
    if args.config:
        return RunConfig.load(args.config).replace(**overrides)
    return RunConfig.from_preset(args.method, **overrides)


def print_config(cfg: RunConfig, dest: str) -> None:
    """Write ``cfg`` as YAML to the file ``dest`` (``-``: stdout)."""
    if dest == "-":
        sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    else:
        cfg.save(dest)
        print(f"[selfspec] configuration written to {dest}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = pop_debug(argv)
    outputs: list[Path] = []  # the results file, once chosen: what the error messages point at

    def body() -> int:
        _import_user_modules(argv)
        args = build_parser().parse_args(argv)
        if args.list:
            print(list_strategies())
            return 0
        cfg = config_from_args(args)
        if args.print_config is not None:
            print_config(cfg, args.print_config)
            return 0
        outputs.append(resolve_output(cfg))
        run(cfg, output=outputs[-1])
        return 0

    def kept() -> str | None:
        """What is on disk: the finished prompts and the command that continues."""
        out = outputs[-1] if outputs else None
        if out is None or not out.exists() or not out.stat().st_size:
            return None
        done = len({(r["question_id"], r["method"]) for r in read_records(out)})
        command = shlex.join(["python", "experiments/run.py", *argv])
        extra = [] if "--resume" in argv else ["--resume"]
        extra += [] if "--output" in argv else ["--output", str(out)]
        return f"{done} finished prompt records are in {out}; continue with: {command} {shlex.join(extra)}".rstrip()

    return guarded(
        body,
        lambda: kept() or "nothing was written yet (no prompt had finished)",
        resume=kept,
        debug=debug,
    )


if __name__ == "__main__":
    sys.exit(main())
