"""One benchmark run: load the model once, build every method, warm up, then decode every prompt with
every method back to back in rotating order (`framework.results.compare`), check each against
vanilla, and write the records, the report and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.benchmark.bench_config import BASELINE, BenchConfig, MethodSpec, preset_run_config
from framework.benchmark.hf import HFGenerateDecoder
from framework.benchmark.load import LoadMonitor, vanilla_spread
from framework.benchmark.load import warnings as load_warnings
from framework.benchmark.report import make_plots, render_report, summarize
from framework.benchmark.tracking import log_benchmark
from framework.config_fields import ConfigError
from framework.data.prompts import Prompt
from framework.data.specbench import written_on_interrupt
from framework.driver import AnswerFiles, metadata, stamped, start, write_json
from framework.engine.context import PreparedCache
from framework.engine.cost_model import CostModel
from framework.models.loading import dtype_name, load_model
from framework.results.compare import Method, compare_methods, explain_with, warm_up
from framework.session.run_config import RunConfig
from framework.session.session import Session

#: Warm-up generations are this many tokens long (at most ``max_new_tokens``).
WARMUP_TOKENS = 16


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
        out[s.label] = priced.with_head(adapter, head, weights=weights) if head is not None else priced
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

    The steps pass values along: the `BenchPlan` the configuration fixes, the `Methods` loaded
    from it, the metadata written, the `Timed` decoding; what every run does once (seed, prompts,
    metadata, answer files, tracker) is `framework.driver`'s.

    Args:
        cfg: the configuration.
        model: an already loaded model (else ``cfg.run.model.name_or_path`` is loaded).
        tokenizer: its tokenizer.
        log: progress lines.
        custom: extra methods ``{label: decoder}``; a decoder has ``generate(prompt_ids, stop) ->
            GenerationResult`` (e.g. a modified decoder under test).

    Raises:
        ConfigError, DataError, ModelLoadError, UnknownNameError: bad input, before anything is
            written.
    """
    plan = plan_benchmark(cfg, custom or {}, log)
    methods = load_methods(plan, model, tokenizer, custom or {}, log)
    meta = write_meta(plan, methods, log)
    graphs, cost = warm_up_methods(plan, methods, log)
    timed = decode_all(plan, methods, log)
    return finish(plan, methods, meta, dataclasses.replace(timed, graphs=graphs, cost=cost), log)


@dataclass(frozen=True)
class BenchPlan:
    """What a benchmark's configuration fixes before the model loads, all of it validated
    (nothing is written yet)."""

    cfg: BenchConfig
    #: every method, in the order of ``--methods``, then the custom ones
    specs: tuple[MethodSpec, ...]
    prompts: list[Prompt]
    out_dir: Path
    answers: AnswerFiles
    #: the `RunConfig` of each preset method, by label
    preset_cfgs: dict[str, RunConfig]
    #: the cost model of a ``--cost-model`` file (``measure``: measured after the warm-up)
    cost: CostModel | None

    @property
    def records_path(self) -> Path:
        return self.out_dir / "records.jsonl"

    @property
    def run(self) -> RunConfig:
        return self.cfg.run


def plan_benchmark(cfg: BenchConfig, custom: dict[str, Any], log: Callable[[str], None]) -> BenchPlan:
    """Seed, load the prompts, choose the output folder, check the answer folder and resolve
    every method's configuration.

    Raises:
        ConfigError: a custom method named like one of ``--methods``, an output folder with
            records in it, or a bad method configuration.
    """
    prompts = start(cfg.run)
    specs = list(cfg.method_specs)
    for label in custom:
        if any(s.label == label for s in specs):
            raise ConfigError("custom", label, "a name not used by --methods")
        specs.append(MethodSpec(label, "custom"))
    out_dir = Path(cfg.out) if cfg.out else stamped("bench")
    records = out_dir / "records.jsonl"
    if records.exists() and records.stat().st_size:
        raise ConfigError("--out", str(out_dir), "a new or empty directory (records.jsonl exists)")
    model = cfg.run.model.name_or_path
    answers = AnswerFiles(cfg.specbench_answers, [s.label for s in specs], [records], model, log, "[bench]")
    return BenchPlan(
        cfg=cfg,
        specs=tuple(specs),
        prompts=prompts,
        out_dir=out_dir,
        answers=answers,
        preset_cfgs={s.label: preset_run_config(s, cfg) for s in specs if s.kind == "preset"},
        cost=load_cost_model(cfg.cost_model) if cfg.cost_model not in ("none", "measure") else None,
    )


@dataclass
class Methods:
    """The loaded model and every method's session and decoder. A preset's decoder is rebuilt
    for every repeat; an HF method that fails is left out from then on (``errors``)."""

    model: Any
    #: the session of the baseline, the HF and the custom methods (plain decoding)
    base: Session
    sessions: dict[str, Session]
    decoders: dict[str, Any]
    #: one preparation cache for every method: an offline search (a preset and its ':raw'
    #: companion search the same skip set), the cost model and the token ranking, computed once
    prepared: PreparedCache
    log: Callable[[str], None]
    errors: dict[str, str] = field(default_factory=dict)

    def decode(self, s: MethodSpec, prompt: Prompt, max_new_tokens: int | None = None) -> Any:
        """``prompt``'s turns by method ``s``, or ``None`` once an HF method has failed (reported)."""
        if s.label in self.errors:
            return None
        try:
            return self.sessions[s.label].decode_prompt(self.decoders[s.label], prompt, max_new_tokens)
        except Exception as err:  # noqa: BLE001 - an HF method's failure is reported, not raised
            if s.kind != "hf":
                raise
            self.errors[s.label] = f"{type(err).__name__}: {err}".strip()
            self.log(f"[bench] {s.label} failed and is left out from now on: {self.errors[s.label]}")
            return None

    def rebuild(self, specs: Sequence[MethodSpec]) -> None:
        """Fresh strategy state for every preset method (an offline search is reused)."""
        for s in specs:
            if s.kind == "preset":
                self.sessions[s.label].rebuild()
                self.decoders[s.label] = self.sessions[s.label].spec

    def notes(self) -> dict[str, list[str]]:
        """What each method cannot do as configured (`Session.notes`), by label."""
        return {label: e.notes for label, e in self.sessions.items() if e.notes}


def load_methods(
    plan: BenchPlan, model: Any, tokenizer: Any, custom: dict[str, Any], log: Callable[[str], None]
) -> Methods:
    """Load the model (unless given) and build every method's session and decoder.

    Raises:
        ConfigError: a ``--cost-model`` file of a model with another number of layers.
    """
    run = plan.run
    if model is None:
        m = run.model
        model, tokenizer = load_model(m.name_or_path, m.dtype, m.device, m.device_map)
    base = Session(run.replace(baseline_only=True), model, tokenizer, log=log, prompts=plan.prompts)
    methods = Methods(model, base, {}, {}, PreparedCache(), log)
    for s in plan.specs:
        methods.sessions[s.label] = base
        if s.kind == "baseline":
            methods.decoders[s.label] = base.vanilla
        elif s.kind == "hf":
            methods.decoders[s.label] = _hf_decoder(plan.cfg, model, s.label)
        elif s.kind == "custom":
            methods.decoders[s.label] = custom[s.label]
        else:
            plan.out_dir.mkdir(parents=True, exist_ok=True)  # a search may save its skip set here
            log(f"[bench] preparing {s.label} ...")
            methods.sessions[s.label] = Session(
                plan.preset_cfgs[s.label],
                model,
                tokenizer,
                artifact_stem=plan.out_dir / s.label,
                log=log,
                prepared=methods.prepared,
            )
            methods.decoders[s.label] = methods.sessions[s.label].spec
    layers = base.adapter.arch.info().num_layers
    if plan.cost is not None and plan.cost.num_layers != layers:
        raise ConfigError(
            "--cost-model",
            plan.cfg.cost_model,
            f"a cost model of a {layers}-layer model, not {plan.cost.num_layers}",
        )
    return methods


def _hf_decoder(cfg: BenchConfig, model: Any, label: str) -> HFGenerateDecoder:
    return HFGenerateDecoder(
        model,
        label,
        prompt_lookup_num_tokens=cfg.prompt_lookup_num_tokens,
        max_matching_ngram_size=cfg.max_matching_ngram_size,
        early_exit_layer=cfg.early_exit_layer,
        kernels=cfg.hf_kernels,
    )


def write_meta(plan: BenchPlan, methods: Methods, log: Callable[[str], None]) -> dict[str, Any]:
    """Write ``meta.json`` (the configuration, the machine, what produced the run, each method's
    resolved strategies and the HF methods' settings) and the run's first log line; returns it."""
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    meta = metadata(plan.cfg.describe(), methods.base, prompts=len(plan.prompts))
    meta["notes"] = methods.notes()
    # each method's resolved strategies and gate (a preset's name alone does not say what ran)
    meta["methods"] = {label: e.cfg.method.settings() for label, e in methods.sessions.items()}
    meta["hf"] = {s.label: methods.decoders[s.label].describe() for s in plan.specs if s.kind == "hf"}
    write_json(plan.out_dir / "meta.json", meta)
    adapter = methods.base.adapter
    log(
        f"[bench] {len(plan.prompts)} prompts x {plan.cfg.repeats} repeat(s) | model {adapter.arch.info().name} "
        f"({dtype_name(adapter.arch.dtype)}, {adapter.arch.device}) | methods {', '.join(s.label for s in plan.specs)} "
        f"| output {plan.out_dir}"
    )
    return meta


def warm_up_methods(
    plan: BenchPlan, methods: Methods, log: Callable[[str], None]
) -> tuple[tuple[int, float] | None, CostModel | None]:
    """With ``--cuda-graphs``, record every graph each method can use (`Session.prepare_graphs`);
    warm every method up; with ``--cost-model measure``, measure (or take) the cost model.
    Returns ``(graphs recorded and their seconds, or None; the cost model)``."""
    run = plan.run
    graphs: tuple[int, float] | None = None
    if run.model.cuda_graphs:
        unique = {id(e): e for e in methods.sessions.values()}.values()
        recorded = [e.prepare_graphs(plan.prompts) for e in unique]
        graphs = (sum(n for n, _ in recorded), sum(t for _, t in recorded))
        log(f"[bench] CUDA graphs: {graphs[0]} recorded before timing ({graphs[1]:.1f} s)")
    short = min(WARMUP_TOKENS, run.generation.max_new_tokens)
    warm_up(list(plan.specs), lambda s: methods.decode(s, plan.prompts[0], short), run.runner.warmup)
    cost = plan.cost
    if plan.cfg.cost_model == "measure":
        cost = methods.prepared.cost_model()
        if cost is None:
            log("[bench] measuring the cost model (draft and verification costs) ...")
            cost = CostModel.measure(methods.base.adapter)
        # Reusable by a later run on the same machine: --cost-model <out>/cost_model.json
        write_json(plan.out_dir / "cost_model.json", {"cost_model": cost.to_dict()})
    return graphs, cost


@dataclass(frozen=True)
class Timed:
    """The timed part of a benchmark: every record, how long it took, and the machine's load
    meanwhile (`framework.benchmark.load`); the graphs recorded before it and the cost model."""

    records: list[dict[str, Any]]
    elapsed: float
    load: dict[str, Any]
    graphs: tuple[int, float] | None = None
    cost: CostModel | None = None


def decode_all(plan: BenchPlan, methods: Methods, log: Callable[[str], None]) -> Timed:
    """Every repeat over the prompts, each record appended to ``records.jsonl`` at once; Ctrl-C
    writes the answer files of the records so far, then goes on."""
    records: list[dict[str, Any]] = []

    def write_answers() -> dict[str, Path]:
        return plan.answers.write(records, plan.cfg.repeats, methods.model)

    t_start = time.perf_counter()
    monitor = LoadMonitor().start()  # what other processes did to the machine while timed
    turn, reported = 0, set[str]()  # reported: the failed HF methods whose error is recorded
    with plan.records_path.open("a", encoding="utf-8") as fh, written_on_interrupt(write_answers):

        def write(rec: dict[str, Any]) -> None:
            fh.write(json.dumps(rec, default=str) + "\n")
            fh.flush()
            records.append(rec)

        for rep in range(plan.cfg.repeats):
            turn = decode_repeat(plan, methods, rep, turn, write, reported, log)
    load = monitor.stop()
    return Timed(records, time.perf_counter() - t_start, load)


def decode_repeat(
    plan: BenchPlan,
    methods: Methods,
    rep: int,
    turn: int,
    write: Callable[[dict[str, Any]], None],
    reported: set[str],
    log: Callable[[str], None],
) -> int:
    """One pass over the prompts (`framework.results.compare.compare_methods`), each prompt's
    records written as soon as it is decoded, starting the rotation of methods at ``turn``, and
    one error record for each HF method that failed and is not in ``reported`` yet; returns the
    turn the next pass starts at."""
    methods.rebuild(plan.specs)
    by_label = {s.label: s for s in plan.specs}
    rounds = compare_methods(
        [Method(s.label, methods.decoders[s.label], s.kind) for s in plan.specs],
        plan.prompts,
        lambda m, prompt: methods.decode(by_label[m.label], prompt),
        explain=explain_with(methods.base),
        start_turn=turn,
        baseline=BASELINE,
    )
    for i, cmp in enumerate(rounds):
        turn += 1
        line = []
        for s in plan.specs:
            if s.label not in cmp.results:
                continue
            rec = cmp.record(s.label, repeat=rep, kind=s.kind)
            write(rec)
            mark = " MISMATCH" if rec["lossless"] is False else ""
            if rec.get("synthetic_acceptance") is not None:
                mark = " (synthetic: not the model's output)"
            line.append(f"{s.label} {rec['tokens_per_s']:.1f} tok/s{mark}")
        for label, error in methods.errors.items():
            if label not in reported:
                reported.add(label)
                prompt = cmp.prompt
                error_rec = {"question_id": prompt.question_id, "category": prompt.category}
                write({"repeat": rep, **error_rec, "method": label, "error": error})
        rtag = f" r{rep + 1}" if plan.cfg.repeats > 1 else ""
        log(
            f"[{i + 1}/{len(plan.prompts)}{rtag}] {cmp.prompt.category:<14} q{cmp.prompt.question_id}: "
            + ", ".join(line)
        )
    return turn


def trust(plan: BenchPlan, meta: dict[str, Any], timed: Timed) -> tuple[dict[str, Any] | None, list[str]]:
    """The machine's load while timed and the warnings it and the baseline's repeats call for
    (`framework.benchmark.load`); both go into ``meta.json`` too."""
    by_rep: dict[int, list[float]] = {}
    for r in timed.records:
        if r["method"] == BASELINE and not r.get("error"):
            by_rep.setdefault(r["repeat"], [0.0, 0.0])
            by_rep[r["repeat"]][0] += r["new_tokens"]
            by_rep[r["repeat"]][1] += r["wall_time"]
    spread = vanilla_spread([t / w for t, w in by_rep.values() if w > 0])
    said = load_warnings(timed.load, spread)
    meta |= {"load": timed.load, "vanilla_repeat_spread": spread, "warnings": said}
    write_json(plan.out_dir / "meta.json", meta)
    return timed.load, said


def finish(
    plan: BenchPlan, methods: Methods, meta: dict[str, Any], timed: Timed, log: Callable[[str], None]
) -> dict[str, Any]:
    """The summary, the plots, the report (``bench.md``), the tracker and the answer files."""
    cost, specs, out_dir = timed.cost, plan.specs, plan.out_dir
    load, said = trust(plan, meta, timed)
    adapter = methods.base.adapter
    heads = head_costs(cost, list(specs), methods.decoders, adapter) if cost is not None else {}
    method_costs = {s.label: heads.get(s.label, cost) for s in specs}
    summary = summarize(timed.records, [s.label for s in specs], method_costs)
    plots = (
        make_plots(out_dir, summary, timed.records, adapter.arch.info().num_layers)
        if plan.run.runner.plots
        else {}
    )
    report = render_report(
        plan.cfg,
        summary,
        meta["environment"],
        len(plan.prompts),
        timed.elapsed,
        plots,
        meta["hf"],
        cost,
        heads,
        method_costs,
        graphs=timed.graphs,
        run_notes=methods.notes(),
        load=load,
        warnings=said,
    )
    (out_dir / "bench.md").write_text(report)
    log("\n" + report)
    log_benchmark(plan.run, out_dir, meta, summary, report, plots, log)
    answers = plan.answers.write(timed.records, plan.cfg.repeats, methods.model)
    return {
        "out": str(out_dir),
        "report": report,
        "summary": summary,
        "records": timed.records,
        "plots": plots,
        "specbench_answers": [str(p) for p in answers.values()],
    }


__all__ = [
    "BenchPlan",
    "Methods",
    "Timed",
    "load_cost_model",
    "preset_run_config",
    "run_benchmark",
]
