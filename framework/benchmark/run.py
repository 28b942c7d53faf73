"""One benchmark run: load the model once, build every method, warm up, then decode every prompt with
every method back to back in rotating order (`framework.results.timing`), check each against
vanilla, and write the records, the report and the plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from framework.benchmark.config import BASELINE, RAW_SUFFIX, BenchConfig, MethodSpec
from framework.benchmark.hf import HFGenerateDecoder
from framework.benchmark.report import make_plots, render_report, summarize
from framework.config import ConfigError
from framework.data.prompts import Prompt, encode_chat, load_prompts
from framework.data.specbench import (
    check_answer_dir,
    write_answer_files,
    written_on_interrupt,
)
from framework.engine.context import PreparedCache
from framework.engine.cost_model import CostModel
from framework.engine.decoding import GenerationResult
from framework.interfaces import REGISTRIES
from framework.models.loading import dtype_name, load_model, model_name
from framework.results.records import turn_record
from framework.results.timing import first_mismatch, mismatch_details, rotated, warm_up
from framework.session.config import RunConfig
from framework.session.experiment import Experiment
from framework.session.flags import add_config_flags, config_overrides_from_args

#: Warm-up generations are this many tokens long (at most ``max_new_tokens``).
WARMUP_TOKENS = 16


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """The machine and the versions, for ``meta.json`` and the report."""
    import transformers

    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


def preset_flags_parser() -> argparse.ArgumentParser:
    """A parser of ``--preset-args`` flags: every run option of ``run.py`` (generated from
    `RunConfig`; strategy flags for the registered strategies) except the ones the benchmark
    decides (``--output``, ``--name``)."""
    parser = argparse.ArgumentParser(prog="--preset-args", add_help=False, exit_on_error=False)
    add_config_flags(parser, RunConfig, exclude=("output", "name"))
    return parser


def parse_preset_flags(label: str, flags: str) -> dict[str, Any]:
    """The overrides (``{"selector.skip_ratio": "0.3", ...}``) that ``--preset-args
    'LABEL=FLAGS'`` gives, read with `preset_flags_parser`.

    Raises:
        ConfigError: a flag ``run.py`` does not have, or a flag without its value.
    """
    where = f"--preset-args {label}"
    try:
        args, unknown = preset_flags_parser().parse_known_args(shlex.split(flags))
    except (argparse.ArgumentError, ValueError) as err:
        raise ConfigError(where, flags, f"valid run.py flags ({err})") from None
    if unknown:
        raise ConfigError(where, " ".join(unknown), "run.py flags (see run.py --help)")
    return config_overrides_from_args(args)


def preset_run_config(spec: MethodSpec, cfg: BenchConfig) -> RunConfig:
    """The `RunConfig` of a preset method: the preset with the benchmark's shared run options
    (`BenchConfig.shared`), the gate off for a ``--raw`` companion, ``--skip-set`` when the
    preset's selector takes one, then the method's ``--preset-args``; named after the method.

    Raises:
        ConfigError: a bad ``--preset-args`` flag or value, or a preset whose verifier samples.
    """
    gate_off = {"gate": {"enabled": False}} if spec.raw else {}
    run_cfg = RunConfig.from_preset(spec.source, **cfg.shared(), **gate_off, name=spec.label)
    overrides: dict[str, Any] = {}
    selector_cfg = run_cfg.selector.config
    if (
        cfg.skip_set
        and selector_cfg is not None
        and "skip_set" in {f.name for f in dataclasses.fields(selector_cfg)}
    ):
        overrides["selector.skip_set"] = cfg.skip_set
    for method, flags in cfg.preset_args:  # a raw companion takes its method's flags too
        if method == spec.label or (spec.raw and method + RAW_SUFFIX == spec.label):
            overrides.update(parse_preset_flags(spec.label, flags))
    if overrides:
        run_cfg = run_cfg.replace(**overrides)
    verifier = REGISTRIES["verifier"].get(run_cfg.verifier.name)
    if getattr(verifier, "lossless", "greedy") != "greedy":
        raise ConfigError(
            "--methods",
            spec.source,
            f"a greedy preset (the benchmark is greedy; its verifier {run_cfg.verifier.name!r} samples)",
        )
    return run_cfg


def bench_record(
    prompt: Prompt, spec: MethodSpec, repeat: int, position: int, turns: list[tuple[GenerationResult, str]]
) -> dict[str, Any]:
    """One line of ``records.jsonl``: a prompt decoded by one method in one repeat (all turns)."""
    results = [r for r, _ in turns]
    new_tokens = sum(r.new_tokens for r in results)
    wall = sum(r.wall_time for r in results)
    keys = {k for r in results for k in r.timings}
    return {
        "repeat": repeat,
        "position": position,
        "question_id": prompt.question_id,
        "category": prompt.category,
        "subcategory": prompt.subcategory,
        "method": spec.label,
        "kind": spec.kind,
        "turns": [turn_record(r, text) for r, text in turns],
        "new_tokens": new_tokens,
        "wall_time": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
        "accept_lengths": [a for r in results for a in r.accept_lengths],
        "drafted": sum(r.drafted for r in results),
        "accepted": sum(r.accepted for r in results),
        "timings": {k: sum(r.timings.get(k, 0.0) for r in results) for k in sorted(keys)},
    }


def head_costs(
    cost: CostModel, specs: list[MethodSpec], decoders: dict[str, Any], adapter: Any
) -> dict[str, CostModel]:
    """``{label: cost model}`` of the preset methods whose drafter scores a reduced vocabulary or
    runs compressed weights: ``cost`` with its draft steps priced for that head
    (`CostModel.with_head`) and those weights (`CostModel.with_weights`)."""
    out = {}
    by_weights: dict[str, CostModel] = {}  # the sub-layer ratios of one format, measured once
    for s in specs:
        drafter = getattr(decoders.get(s.label), "drafter", None)
        if s.kind != "preset" or drafter is None:
            continue
        head, weights = drafter.draft_head(), drafter.draft_weights()
        fmt = "float32" if weights is None else weights.weights
        if head is None and fmt == "float32":
            continue
        priced = cost
        if fmt != "float32":
            if fmt not in by_weights:
                by_weights[fmt] = cost.with_weights(adapter, weights)
            priced = dataclasses.replace(
                cost, attn=by_weights[fmt].attn, mlp=by_weights[fmt].mlp, draft_weights=fmt
            )
        out[s.label] = priced.with_head(adapter, head) if head is not None else priced
    return out


def load_cost_model(path: str) -> CostModel:
    """A `CostModel` from a JSON file (``{"cost_model": ...}`` as saved, or a skip-set file).

    Raises:
        ConfigError: unreadable, or not a cost model.
    """
    try:
        data = json.loads(Path(path).read_text())
        return CostModel.from_dict(data.get("cost_model", data))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise ConfigError(
            "--cost-model", path, f"'measure', 'none' or a CostModel / skip-set JSON ({err})"
        ) from None


def run_benchmark(
    cfg: BenchConfig,
    model: Any = None,
    tokenizer: Any = None,
    *,
    log: Callable[[str], None] = print,
    custom: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"out", "report", "summary", "records", "plots",
    "specbench_answers"}`` (the Spec-Bench answer files of ``cfg.specbench_answers``, also written
    when the run is interrupted; `framework.data.specbench`).

    Args:
        cfg: the configuration.
        model: an already loaded model (else ``cfg.run.model`` is loaded).
        tokenizer: its tokenizer.
        log: progress lines.
        custom: extra methods ``{label: decoder}``; a decoder has ``generate(prompt_ids, stop) ->
            GenerationResult`` (e.g. a modified decoder under test).

    Raises:
        ConfigError, DataError, ModelLoadError, UnknownNameError: bad input, before anything is
            written.
    """
    run = cfg.run
    torch.manual_seed(run.seed)
    if run.threads:
        torch.set_num_threads(run.threads)
    specs = cfg.method_specs
    for label in custom or {}:
        if any(s.label == label for s in specs):
            raise ConfigError("custom", label, "a name not used by --methods")
        specs.append(MethodSpec(label, "custom"))
    prompts = load_prompts(run.data, run.categories or None, run.limit)
    out_dir = Path(cfg.out) if cfg.out else Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    records_path = out_dir / "records.jsonl"
    if records_path.exists() and records_path.stat().st_size:
        raise ConfigError("--out", str(out_dir), "a new or empty directory (records.jsonl exists)")
    check_answer_dir(cfg.specbench_answers, [s.label for s in specs], [records_path])
    preset_cfgs = {s.label: preset_run_config(s, cfg) for s in specs if s.kind == "preset"}
    cost = load_cost_model(cfg.cost_model) if cfg.cost_model not in ("none", "measure") else None

    if model is None:
        model, tokenizer = load_model(run.model, run.dtype, run.device)
    base = Experiment(run.replace(baseline_only=True), model, tokenizer, log=log, prompts=prompts)
    exps: dict[str, Any] = {}
    decoders: dict[str, Any] = {}
    # One preparation cache for every method: an offline search (a preset and its ':raw' companion
    # search the same skip set), the cost model and the token ranking are computed once.
    prepared = PreparedCache()
    for s in specs:
        if s.kind == "baseline":
            exps[s.label], decoders[s.label] = base, base.vanilla
        elif s.kind == "hf":
            exps[s.label] = base
            decoders[s.label] = HFGenerateDecoder(
                model,
                s.label,
                prompt_lookup_num_tokens=cfg.prompt_lookup_num_tokens,
                max_matching_ngram_size=cfg.max_matching_ngram_size,
                early_exit_layer=cfg.early_exit_layer,
                kernels=cfg.hf_kernels,
            )
        elif s.kind == "custom":
            exps[s.label], decoders[s.label] = base, (custom or {})[s.label]
        else:
            out_dir.mkdir(parents=True, exist_ok=True)  # a search may save its skip set here
            log(f"[bench] preparing {s.label} ...")
            exps[s.label] = Experiment(
                preset_cfgs[s.label],
                model,
                tokenizer,
                artifact_stem=out_dir / s.label,
                log=log,
                prepared=prepared,
            )
            decoders[s.label] = exps[s.label].spec
    info = base.adapter.info()
    if cost is not None and cost.num_layers != info.num_layers:
        raise ConfigError(
            "--cost-model",
            cfg.cost_model,
            f"a cost model of a {info.num_layers}-layer model, not {cost.num_layers}",
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    meta = {"config": cfg.describe(), "environment": env, "started": time.time(), "prompts": len(prompts)}
    meta["hf"] = {s.label: decoders[s.label].describe() for s in specs if s.kind == "hf"}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    log(
        f"[bench] {len(prompts)} prompts x {cfg.repeats} repeat(s) | model {info.name} ({dtype_name(base.adapter.dtype)}, "
        f"{base.adapter.device}) | methods {', '.join(s.label for s in specs)} | output {out_dir}"
    )

    errors: dict[str, str] = {}

    def decode(s: MethodSpec, prompt: Prompt, max_new_tokens: int | None = None) -> Any:
        if s.label in errors:
            return None
        try:
            return exps[s.label].decode_prompt(decoders[s.label], prompt, max_new_tokens)
        except Exception as err:  # noqa: BLE001 - an HF method's failure is reported, not raised
            if s.kind != "hf":
                raise
            errors[s.label] = f"{type(err).__name__}: {err}".strip()
            log(f"[bench] {s.label} failed and is left out from now on: {errors[s.label]}")
            return None

    warm_up(specs, lambda s: decode(s, prompts[0], min(WARMUP_TOKENS, run.max_new_tokens)), run.warmup)
    if cfg.cost_model == "measure":
        cost = prepared.cost_model()
        if cost is None:
            log("[bench] measuring the cost model (draft and verification costs) ...")
            cost = CostModel.measure(base.adapter)
        # Reusable by a later run on the same machine: --cost-model <out>/cost_model.json
        (out_dir / "cost_model.json").write_text(json.dumps({"cost_model": cost.to_dict()}, indent=2))

    records: list[dict[str, Any]] = []

    def write_answers() -> dict[str, Path]:  # Spec-Bench's answer files, rewritten from the records
        if not cfg.specbench_answers:
            return {}
        paths = write_answer_files(
            records,
            cfg.specbench_answers,
            model=model_name(run.model, model),
            repeats=cfg.repeats,
            protect=[records_path],
        )
        log(f"[bench] Spec-Bench answer files: {', '.join(str(p) for p in paths.values())}")
        return paths

    turn = 0
    t_start = time.perf_counter()
    with records_path.open("a", encoding="utf-8") as fh, written_on_interrupt(write_answers):

        def write(rec: dict[str, Any]) -> None:
            fh.write(json.dumps(rec, default=str) + "\n")
            fh.flush()
            records.append(rec)

        for rep in range(cfg.repeats):
            for s in specs:  # fresh strategy state for every repeat (an offline search is reused)
                if s.kind == "preset":
                    exps[s.label].rebuild()
                    decoders[s.label] = exps[s.label].spec
            for i, prompt in enumerate(prompts):
                order = rotated([s for s in specs if s.label not in errors], turn)
                turn += 1
                results = {}
                for s in order:
                    res = decode(s, prompt)
                    if res is not None:
                        results[s.label] = res
                if BASELINE not in results:
                    raise RuntimeError("the vanilla baseline produced no result")
                want = [r.tokens for r, _ in results[BASELINE]]
                line = []
                for s in specs:
                    if s.label not in results:
                        continue
                    rec = bench_record(prompt, s, rep, order.index(s), results[s.label])
                    got = [t["tokens"] for t in rec["turns"]]
                    rec["first_mismatch"] = first_mismatch(got, want)
                    rec["lossless"] = rec["first_mismatch"] is None
                    if not rec["lossless"]:  # the target's top-1/top-2 margin there: near-tie or bug?
                        rec["first_mismatch"] = mismatch_details(
                            base.adapter,
                            lambda messages: encode_chat(base.tokenizer, messages),
                            prompt.turns,
                            [(r.tokens, text) for r, text in results[BASELINE]],
                            got,
                            rec["first_mismatch"],
                        )
                    write(rec)
                    mark = "" if rec["lossless"] else " MISMATCH"
                    line.append(f"{s.label} {rec['tokens_per_s']:.1f} tok/s{mark}")
                for label in errors:
                    if not any(r["method"] == label and r.get("error") for r in records):
                        write(
                            {
                                "repeat": rep,
                                "question_id": prompt.question_id,
                                "category": prompt.category,
                                "method": label,
                                "error": errors[label],
                            }
                        )
                rtag = f" r{rep + 1}" if cfg.repeats > 1 else ""
                log(
                    f"[{i + 1}/{len(prompts)}{rtag}] {prompt.category:<14} q{prompt.question_id}: "
                    + ", ".join(line)
                )
    elapsed = time.perf_counter() - t_start

    heads = head_costs(cost, specs, decoders, base.adapter) if cost is not None else {}
    method_costs = {s.label: heads.get(s.label, cost) for s in specs}
    summary = summarize(records, [s.label for s in specs], method_costs)
    plots = make_plots(out_dir, summary, records, info.num_layers) if run.plots else {}
    report = render_report(
        cfg, summary, env, len(prompts), elapsed, plots, meta["hf"], cost, heads, method_costs
    )
    (out_dir / "bench.md").write_text(report)
    log("\n" + report)
    answers = write_answers()
    return {
        "out": str(out_dir),
        "report": report,
        "summary": summary,
        "records": records,
        "plots": plots,
        "specbench_answers": [str(p) for p in answers.values()],
    }


__all__ = [
    "bench_record",
    "environment",
    "load_cost_model",
    "parse_preset_flags",
    "preset_run_config",
    "run_benchmark",
]
