"""Command lines over the one pipeline (`framework.runner.pipeline.run`): ``run.py`` (one method
against vanilla; also the ``selfspec`` script) and ``bench.py`` (several methods and the
benchmark's report). Their flags are `RunConfig`'s fields (``framework.session.flags`` says how a
field becomes flags); ``bench.py`` names its methods (``--methods``, ``--raw``, ``--preset-args
METHOD=FLAGS``) instead of the method section's flags. Both build their config as the Python API
does (`config_from_args`). Bad input exits with status 2 and a message naming the flag, the value
and what is allowed; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from framework.config_fields import ConfigError, field_defaults, field_help
from framework.interfaces import REGISTRIES
from framework.models.loading import describe_models
from framework.results.records import read_records
from framework.runner.pipeline import resolve_output, run
from framework.session.errors import USER_ERRORS, OneLineParser, guarded, pop_debug
from framework.session.flags import add_config_flags, config_overrides_from_args
from framework.session.methods import BASELINE, DEFAULT_METHODS, HF_METHODS, allowed_methods
from framework.session.notes import PAPER_PRESETS, published_by
from framework.session.plugins import import_recorded, import_user_modules
from framework.session.presets import MissingStrategyError, list_presets, load_preset
from framework.session.run_config import RunConfig

__all__ = [
    "USER_ERRORS",
    "BENCH_ONLY",
    "bench_main",
    "build_parser",
    "config_from_args",
    "guarded",
    "list_strategies",
    "main",
    "print_config",
]

#: The compare section's fields that only bench.py has (run.py compares its one method with vanilla).
BENCH_ONLY = (
    "methods",
    "raw",
    "preset_args",
    "skip_set",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "early_exit_layer",
    "hf_kernels",
    "synthetic",
)


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


def build_parser(bench: bool = False) -> argparse.ArgumentParser:
    """The ``run.py`` parser (``bench``: ``bench.py``'s): the tool's own flags plus the flags
    generated from `RunConfig` (the ``--import`` modules must be imported first; the built-in
    strategies register themselves on the registries' first lookup)."""
    if bench:
        return _bench_parser()
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
    _add_list(p)
    _add_source(p)
    add_config_flags(p, RunConfig, exclude=(*BENCH_ONLY, "command"))  # groups: the sections
    return p


def _add_list(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-l",
        "--list",
        action="store_true",
        help="list every registered strategy with its config fields, the presets and the models, and exit",
    )


def _add_source(p: argparse.ArgumentParser, method: bool = True) -> None:
    """``--print-config``, and ``--config`` (with ``run.py``'s ``--method`` as its alternative)."""
    p.add_argument(
        "--print-config",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the resolved configuration as YAML to FILE (default: stdout) and exit; "
        "`--config FILE` runs it",
    )
    source = p.add_mutually_exclusive_group()
    if method:
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
        help="a saved configuration (--print-config FILE, or the config.yaml a run wrote beside its "
        "results); every other flag overrides it",
    )


def _bench_parser() -> argparse.ArgumentParser:
    presets = [m for m in allowed_methods() if m != BASELINE and m not in HF_METHODS]
    p = OneLineParser(
        prog="bench.py",
        description="Spec-Bench-style benchmark: our vanilla baseline, Hugging Face generate (greedy, prompt "
        "lookup, early exit) and any of our presets, interleaved on the same prompts with one model load.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Methods: vanilla, {', '.join(HF_METHODS)}, the presets {', '.join(presets)}, or preset YAML "
        f"files (default {','.join(DEFAULT_METHODS)}). See docs/benchmarks.md.\n\n"
        "examples:\n"
        "  python experiments/bench.py --limit 1 --max-new-tokens 64     # the default methods, 1 prompt per category\n"
        "  python experiments/bench.py --methods vanilla,swift,swift_safe,clasp_safe --raw --repeats 2\n"
        "  python experiments/bench.py --data ../shared/data/spec_bench/question.jsonl --limit 1 "
        "--model qwen2.5-coder-0.5b",
    )
    _add_list(p)
    _add_source(p, method=False)
    groups = {f: "benchmark" for f in (*BENCH_ONLY, "repeats", "cost_model")}
    add_config_flags(p, RunConfig, exclude=("method", "preset_args", "command"), groups=groups)
    p.add_argument(
        "--preset-args",
        action="append",
        default=[],
        metavar="METHOD=FLAGS",
        help="extra run.py flags for one preset, e.g. 'swift=--selector.skip_ratio 0.3' (repeatable)",
    )
    return p


def config_from_args(
    args: argparse.Namespace, command: str | None = None, *, bench: bool | None = None
) -> RunConfig:
    """The validated `RunConfig` of parsed arguments: ``--config FILE`` or the ``--method``
    preset (defaults when neither), with every generated flag that was given applied on top.
    ``command``: the command line, for the report. ``bench`` (default: a ``command`` was given):
    ``bench.py``'s arguments, whose methods default to `DEFAULT_METHODS` and whose
    ``--preset-args METHOD=FLAGS`` are read.

    Raises:
        ConfigError: an invalid value, named by its flag (UnknownNameError: a strategy name).
    """
    overrides = config_overrides_from_args(args)
    bench = command is not None if bench is None else bench
    if command is not None:
        overrides["compare.command"] = command
    if bench:
        pairs = []
        for item in args.preset_args:
            method, sep, flags = item.partition("=")
            if not sep or not method.strip():
                raise ConfigError(
                    "--preset-args", item, "METHOD=FLAGS, e.g. 'swift=--selector.skip_ratio 0.3'"
                )
            pairs.append((method.strip(), flags))
        if pairs:
            overrides["compare.preset_args"] = tuple(pairs)
    if args.config:
        return RunConfig.load(args.config, **overrides)
    if bench and "compare.methods" not in overrides:
        overrides["compare.methods"] = DEFAULT_METHODS
    return RunConfig.from_preset(getattr(args, "method", None), **overrides)


def print_config(cfg: RunConfig, dest: str) -> None:
    """Write ``cfg`` as YAML to the file ``dest`` (``-``: stdout)."""
    if dest == "-":
        sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    else:
        cfg.save(dest)
        print(f"[selfspec] configuration written to {dest}", file=sys.stderr)


def main(
    argv: Sequence[str] | None = None, *, bench: bool = False, model: Any = None, tokenizer: Any = None
) -> int:
    """``experiments/run.py`` (``bench``: ``experiments/bench.py``); returns the exit status (2 for
    bad input, 130 when interrupted). ``model``, ``tokenizer``: an already loaded model (tests)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = pop_debug(argv)
    tool = "bench.py" if bench else "run.py"
    outputs: list[Path] = []  # the results, once chosen: what the error messages point at

    def body() -> int:
        _import_user_modules(argv)
        args = build_parser(bench).parse_args(argv)
        if getattr(args, "list", False):
            print(list_strategies())
            return 0
        command = f"python experiments/{tool} {shlex.join(argv)}".strip()
        cfg = config_from_args(args, command, bench=bench)
        if args.print_config is not None:
            print_config(cfg, args.print_config)
            return 0
        outputs.append(resolve_output(cfg))
        run(cfg, output=outputs[-1], model=model, tokenizer=tokenizer)
        return 0

    def kept() -> str | None:
        """What is on disk: the finished prompts and the command that continues."""
        out = outputs[-1] if outputs else None
        records = out / "records.jsonl" if out is not None and out.is_dir() else out
        if records is None or not records.exists() or not records.stat().st_size:
            return None
        done = len({(r.get("repeat", 0), r["question_id"], r["method"]) for r in read_records(records)})
        command = shlex.join(["python", f"experiments/{tool}", *argv])
        extra = [] if "--resume" in argv else ["--resume"]
        extra += [] if "--output" in argv else ["--output", str(out)]
        return f"{done} finished prompt records are in {records}; continue with: {command} {shlex.join(extra)}".rstrip()

    return guarded(
        body,
        lambda: kept() or "nothing was written yet (no prompt had finished)",
        resume=kept,
        debug=debug,
    )


def bench_main(argv: Sequence[str] | None = None, *, model: Any = None, tokenizer: Any = None) -> int:
    """``experiments/bench.py``: `main` with ``bench=True``."""
    return main(argv, bench=True, model=model, tokenizer=tokenizer)


if __name__ == "__main__":
    sys.exit(main())
