"""Command line of the sweeps: ``python experiments/sweep.py FILE [--count N] [--out DIR]
[--dry-run] [--no-wandb] [--online] [--smoke]`` runs a sweep file locally; ``--trial`` runs one
trial from ``wandb.config`` (what ``wandb agent`` calls); ``--agent SWEEP_ID`` runs the W&B agent
in this process (the model loaded once). Bad input exits with status 2 and ``error: ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from framework.session.errors import OneLineParser, guarded, pop_debug
from framework.session.loggers import has_wandb_credentials
from framework.sweep.local import run_sweep
from framework.sweep.spec import SweepError
from framework.sweep.trial import SMOKE_ENV, smoke_setup, train


def build_sweep_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="sweep.py",
        allow_abbrev=False,
        description="Run a W&B sweep file (experiments/sweeps/*.yaml) locally, trial after trial, with the "
        "W&B runs written offline; or run one trial from wandb.config (--trial, what `wandb agent` calls).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="With a W&B server: wandb sweep FILE, then wandb agent ENTITY/PROJECT/SWEEP_ID (or "
        "python experiments/sweep.py --agent ENTITY/PROJECT/SWEEP_ID). See docs/howto/sweeps.md.\n\n"
        "examples:\n"
        "  python experiments/sweep.py experiments/sweeps/static.yaml --dry-run   # list the trials\n"
        "  python experiments/sweep.py experiments/sweeps/static.yaml --count 4   # 4 trials, W&B offline\n"
        "  wandb sweep experiments/sweeps/swift.yaml && wandb agent ENTITY/PROJECT/SWEEP_ID",
    )
    p.add_argument("file", nargs="?", metavar="FILE", help="a sweep YAML (W&B's sweep configuration format)")
    p.add_argument(
        "--count", type=int, default=None, help="trials to run (grid: the first N; random: N draws)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random and bayes search (default 0)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run option every trial takes instead of the file's (repeatable; e.g. --set max_new_tokens=16); "
        "not a swept parameter",
    )
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category (= --set limit=N)")
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
    debug = pop_debug(argv)
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
            overrides=parse_sets(args.sets, args.limit),
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

    return guarded(body, "every finished trial is in the results table", errors=(SweepError,), debug=debug)


def parse_sets(sets: list[str], limit: int | None = None) -> dict[str, Any]:
    """``--set KEY=VALUE`` (the value read as YAML: ``16`` an int, ``true`` a bool) and ``--limit``.

    Raises:
        SweepError: an entry without ``=``.
    """
    import yaml

    out: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SweepError(f"--set {item!r}: expected KEY=VALUE (e.g. --set max_new_tokens=16)")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            out[key.strip()] = value
    if limit is not None:
        out["limit"] = limit
    return out


__all__ = ["build_sweep_parser", "main", "parse_sets"]
