"""One benchmark run: load the model once, build every method, warm up, then decode every prompt with
every method back to back in rotating order (`framework.results.compare`), check each against
vanilla, and write the records, the report and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from framework.benchmark.bench_config import BASELINE, RAW_SUFFIX, BenchConfig, MethodSpec, method_section
from framework.benchmark.hf import HFGenerateDecoder
from framework.benchmark.load import LoadMonitor, vanilla_spread
from framework.benchmark.load import warnings as load_warnings
from framework.benchmark.report import make_plots, render_report, summarize
from framework.benchmark.tracking import log_benchmark
from framework.config_fields import ConfigError
from framework.data.prompts import Prompt, load_prompts
from framework.data.specbench import (
    check_answer_dir,
    write_answer_files,
    written_on_interrupt,
)
from framework.engine.context import PreparedCache
from framework.engine.cost_model import CostModel
from framework.interfaces import REGISTRIES
from framework.models.loading import dtype_name, load_model, model_name
from framework.models.provenance import environment, run_provenance
from framework.results.compare import Method, compare_methods, explain_with, warm_up
from framework.session.run_config import MethodConfig, RunConfig
from framework.session.session import Session

#: Warm-up generations are this many tokens long (at most ``max_new_tokens``).
WARMUP_TOKENS = 16


def preset_run_config(spec: MethodSpec, cfg: BenchConfig) -> RunConfig:
    """The `RunConfig` of a preset method: the benchmark's shared sections with the preset's method
    section (`BenchConfig.method_run_config`), the gate off for a ``--raw`` companion,
    ``--skip-set`` when the preset's selector takes one, then the method's ``--preset-args``
    overrides; named after the method.

    Raises:
        ConfigError: a bad ``--preset-args`` value, or a preset whose verifier samples.
    """
    method = dataclasses.replace(method_section(spec.source), name=spec.label)
    if spec.raw:
        method = dataclasses.replace(method, gate=dataclasses.replace(method.gate, enabled=False))
    overrides: dict[str, Any] = {}
    selector_cfg = method.selector.config
    if (
        cfg.skip_set
        and selector_cfg is not None
        and "skip_set" in {f.name for f in dataclasses.fields(selector_cfg)}
    ):
        overrides["selector.skip_set"] = cfg.skip_set
    for label, given in cfg.preset_args:  # a raw companion takes its method's overrides too
        if label == spec.label or (spec.raw and label + RAW_SUFFIX == spec.label):
            overrides.update(given)
    run_cfg = cfg.method_run_config(method, overrides)
    verifier = REGISTRIES["verifier"].get(run_cfg.method.verifier.name)
    if getattr(verifier, "lossless", "greedy") != "greedy":
        raise ConfigError(
            "--methods",
            spec.label if isinstance(spec.source, MethodConfig) else spec.source,
            f"a greedy preset (the benchmark is greedy; its verifier {run_cfg.method.verifier.name!r} samples)",
        )
    return run_cfg


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
    bench = _Bench(cfg, log, custom or {})
    bench.load(model, tokenizer)
    bench.write_meta()
    bench.warm_up()
    t_start = time.perf_counter()
    monitor = LoadMonitor().start()  # what other processes did to the machine while timed
    with bench.records_path.open("a", encoding="utf-8") as fh, written_on_interrupt(bench.write_answers):
        for rep in range(cfg.repeats):
            bench.decode_repeat(rep, fh)
    bench.load_info = monitor.stop()
    return bench.finish(time.perf_counter() - t_start)


class _Bench:
    """The state of one `run_benchmark`: its methods, their experiments and decoders, and the
    records written so far (each step a method, so that no function grows long)."""

    def __init__(self, cfg: BenchConfig, log: Callable[[str], None], custom: dict[str, Any]) -> None:
        run = cfg.run
        torch.manual_seed(run.generation.seed)
        if run.runner.threads:
            torch.set_num_threads(run.runner.threads)
        self.cfg, self.run, self.log, self.custom = cfg, run, log, custom
        self.specs = cfg.method_specs
        for label in custom:
            if any(s.label == label for s in self.specs):
                raise ConfigError("custom", label, "a name not used by --methods")
            self.specs.append(MethodSpec(label, "custom"))
        self.prompts = load_prompts(
            run.data.path, run.data.categories or None, run.data.limit, run.data.offset
        )
        self.out_dir = Path(cfg.out) if cfg.out else Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
        self.records_path = self.out_dir / "records.jsonl"
        if self.records_path.exists() and self.records_path.stat().st_size:
            raise ConfigError("--out", str(self.out_dir), "a new or empty directory (records.jsonl exists)")
        check_answer_dir(cfg.specbench_answers, [s.label for s in self.specs], [self.records_path])
        self.preset_cfgs = {s.label: preset_run_config(s, cfg) for s in self.specs if s.kind == "preset"}
        self.cost = load_cost_model(cfg.cost_model) if cfg.cost_model not in ("none", "measure") else None
        self.exps: dict[str, Session] = {}
        self.decoders: dict[str, Any] = {}
        self.errors: dict[str, str] = {}  # an HF method that failed: left out from then on
        self.records: list[dict[str, Any]] = []
        self.turn = 0
        # One preparation cache for every method: an offline search (a preset and its ':raw'
        # companion search the same skip set), the cost model and the token ranking, computed once.
        self.prepared = PreparedCache()

    def load(self, model: Any, tokenizer: Any) -> None:
        """Load the model (unless given) and build every method's experiment and decoder."""
        run = self.run
        if model is None:
            m = run.model
            model, tokenizer = load_model(m.name_or_path, m.dtype, m.device, m.device_map)
        self.model = model
        self.base = Session(
            run.replace(baseline_only=True), model, tokenizer, log=self.log, prompts=self.prompts
        )
        for s in self.specs:
            self.exps[s.label] = self.base
            if s.kind == "baseline":
                self.decoders[s.label] = self.base.vanilla
            elif s.kind == "hf":
                self.decoders[s.label] = self._hf_decoder(s.label)
            elif s.kind == "custom":
                self.decoders[s.label] = self.custom[s.label]
            else:
                self.out_dir.mkdir(parents=True, exist_ok=True)  # a search may save its skip set here
                self.log(f"[bench] preparing {s.label} ...")
                self.exps[s.label] = Session(
                    self.preset_cfgs[s.label],
                    model,
                    tokenizer,
                    artifact_stem=self.out_dir / s.label,
                    log=self.log,
                    prepared=self.prepared,
                )
                self.decoders[s.label] = self.exps[s.label].spec
        self.info = self.base.adapter.info()
        if self.cost is not None and self.cost.num_layers != self.info.num_layers:
            raise ConfigError(
                "--cost-model",
                self.cfg.cost_model,
                f"a cost model of a {self.info.num_layers}-layer model, not {self.cost.num_layers}",
            )

    def _hf_decoder(self, label: str) -> HFGenerateDecoder:
        cfg = self.cfg
        return HFGenerateDecoder(
            self.model,
            label,
            prompt_lookup_num_tokens=cfg.prompt_lookup_num_tokens,
            max_matching_ngram_size=cfg.max_matching_ngram_size,
            early_exit_layer=cfg.early_exit_layer,
            kernels=cfg.hf_kernels,
        )

    def run_notes(self) -> dict[str, list[str]]:
        """What each method cannot do as configured (`Session.notes`), by label."""
        return {label: e.notes for label, e in self.exps.items() if e.notes}

    @staticmethod
    def method_settings(exp: Session) -> dict[str, Any]:
        """What a method ran: each strategy's name and config and the gate (``baseline_only``:
        plain decoding)."""
        method = exp.cfg.method
        if method.baseline_only:
            return {"baseline_only": True}
        out: dict[str, Any] = {kind: spec.describe() for kind, spec in method.strategies().items()}
        out["gate"] = dataclasses.asdict(method.gate)
        return out

    def write_meta(self) -> None:
        """``meta.json`` (the configuration, the machine, the HF methods' settings) and the run's
        first log line."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.env = environment()
        meta = {
            "config": self.cfg.describe(),
            "environment": self.env,
            "started": time.time(),
            "prompts": len(self.prompts),
        }
        adapter = self.base.adapter
        meta["provenance"] = run_provenance(
            self.run.model.name_or_path, adapter.model, device=adapter.device, dtype=dtype_name(adapter.dtype)
        )
        meta["notes"] = self.run_notes()
        # each method's resolved strategies and gate (a preset's name alone does not say what ran)
        meta["methods"] = {label: self.method_settings(e) for label, e in self.exps.items()}
        meta["hf"] = self.hf = {
            s.label: self.decoders[s.label].describe() for s in self.specs if s.kind == "hf"
        }
        self.meta = meta
        (self.out_dir / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        self.log(
            f"[bench] {len(self.prompts)} prompts x {self.cfg.repeats} repeat(s) | model {self.info.name} "
            f"({dtype_name(adapter.dtype)}, {adapter.device}) | methods {', '.join(s.label for s in self.specs)} "
            f"| output {self.out_dir}"
        )

    def decode(self, s: MethodSpec, prompt: Prompt, max_new_tokens: int | None = None) -> Any:
        """``prompt``'s turns by method ``s``, or ``None`` once an HF method has failed (reported)."""
        if s.label in self.errors:
            return None
        try:
            return self.exps[s.label].decode_prompt(self.decoders[s.label], prompt, max_new_tokens)
        except Exception as err:  # noqa: BLE001 - an HF method's failure is reported, not raised
            if s.kind != "hf":
                raise
            self.errors[s.label] = f"{type(err).__name__}: {err}".strip()
            self.log(f"[bench] {s.label} failed and is left out from now on: {self.errors[s.label]}")
            return None

    def warm_up(self) -> None:
        """With ``--cuda-graphs``, record every graph each method can use (`Session.prepare_graphs`);
        warm every method up; with ``--cost-model measure``, measure (or take) the cost model."""
        self.graphs: tuple[int, float] | None = None
        if self.run.model.cuda_graphs:
            recorded = [
                e.prepare_graphs(self.prompts) for e in {id(e): e for e in self.exps.values()}.values()
            ]
            self.graphs = (sum(n for n, _ in recorded), sum(t for _, t in recorded))
            self.log(f"[bench] CUDA graphs: {self.graphs[0]} recorded before timing ({self.graphs[1]:.1f} s)")
        short = min(WARMUP_TOKENS, self.run.generation.max_new_tokens)
        warm_up(self.specs, lambda s: self.decode(s, self.prompts[0], short), self.run.runner.warmup)
        if self.cfg.cost_model == "measure":
            cost = self.prepared.cost_model()
            if cost is None:
                self.log("[bench] measuring the cost model (draft and verification costs) ...")
                cost = CostModel.measure(self.base.adapter)
            self.cost = cost
            # Reusable by a later run on the same machine: --cost-model <out>/cost_model.json
            (self.out_dir / "cost_model.json").write_text(
                json.dumps({"cost_model": cost.to_dict()}, indent=2)
            )

    def decode_repeat(self, rep: int, fh: Any) -> None:
        """One pass over the prompts (`framework.results.compare.compare_methods`), each prompt's
        records written as soon as it is decoded."""
        for s in self.specs:  # fresh strategy state for every repeat (an offline search is reused)
            if s.kind == "preset":
                self.exps[s.label].rebuild()
                self.decoders[s.label] = self.exps[s.label].spec
        by_label = {s.label: s for s in self.specs}
        methods = [Method(s.label, self.decoders[s.label], s.kind) for s in self.specs]
        rounds = compare_methods(
            methods,
            self.prompts,
            lambda m, prompt: self.decode(by_label[m.label], prompt),
            explain=explain_with(self.base),
            start_turn=self.turn,
            baseline=BASELINE,
        )
        for i, cmp in enumerate(rounds):
            self.turn += 1
            line = []
            for s in self.specs:
                if s.label not in cmp.results:
                    continue
                rec = cmp.record(s.label, repeat=rep, kind=s.kind)
                self._write(fh, rec)
                mark = "" if rec["lossless"] else " MISMATCH"
                line.append(f"{s.label} {rec['tokens_per_s']:.1f} tok/s{mark}")
            for label, error in self.errors.items():
                if not any(r["method"] == label and r.get("error") for r in self.records):
                    prompt = cmp.prompt
                    error_rec = {"question_id": prompt.question_id, "category": prompt.category}
                    self._write(fh, {"repeat": rep, **error_rec, "method": label, "error": error})
            rtag = f" r{rep + 1}" if self.cfg.repeats > 1 else ""
            self.log(
                f"[{i + 1}/{len(self.prompts)}{rtag}] {cmp.prompt.category:<14} q{cmp.prompt.question_id}: "
                + ", ".join(line)
            )

    def _write(self, fh: Any, rec: dict[str, Any]) -> None:
        fh.write(json.dumps(rec, default=str) + "\n")
        fh.flush()
        self.records.append(rec)

    def write_answers(self) -> dict[str, Path]:
        """Spec-Bench's answer files, rewritten from the records (``--specbench-answers``)."""
        if not self.cfg.specbench_answers:
            return {}
        paths = write_answer_files(
            self.records,
            self.cfg.specbench_answers,
            model=model_name(self.run.model.name_or_path, self.model),
            repeats=self.cfg.repeats,
            protect=[self.records_path],
        )
        self.log(f"[bench] Spec-Bench answer files: {', '.join(str(p) for p in paths.values())}")
        return paths

    def trust(self) -> tuple[dict[str, Any] | None, list[str]]:
        """The machine's load while timed and the warnings it and the baseline's repeats call
        for (`framework.benchmark.load`); both go into ``meta.json`` too."""
        load = getattr(self, "load_info", None)
        by_rep: dict[int, list[float]] = {}
        for r in self.records:
            if r["method"] == BASELINE and not r.get("error"):
                by_rep.setdefault(r["repeat"], [0.0, 0.0])
                by_rep[r["repeat"]][0] += r["new_tokens"]
                by_rep[r["repeat"]][1] += r["wall_time"]
        spread = vanilla_spread([t / w for t, w in by_rep.values() if w > 0])
        said = load_warnings(load, spread)
        self.meta |= {"load": load, "vanilla_repeat_spread": spread, "warnings": said}
        (self.out_dir / "meta.json").write_text(json.dumps(self.meta, indent=2, default=str))
        return load, said

    def finish(self, elapsed: float) -> dict[str, Any]:
        """The summary, the plots, the report (``bench.md``) and the answer files."""
        cost, specs = self.cost, self.specs
        load, said = self.trust()
        heads = head_costs(cost, specs, self.decoders, self.base.adapter) if cost is not None else {}
        method_costs = {s.label: heads.get(s.label, cost) for s in specs}
        summary = summarize(self.records, [s.label for s in specs], method_costs)
        plots = (
            make_plots(self.out_dir, summary, self.records, self.info.num_layers)
            if self.run.runner.plots
            else {}
        )
        report = render_report(
            self.cfg,
            summary,
            self.env,
            len(self.prompts),
            elapsed,
            plots,
            self.hf,
            cost,
            heads,
            method_costs,
            graphs=self.graphs,
            run_notes=self.run_notes(),
            load=load,
            warnings=said,
        )
        (self.out_dir / "bench.md").write_text(report)
        self.log("\n" + report)
        log_benchmark(self.run, self.out_dir, self.meta, summary, report, plots, self.log)
        answers = self.write_answers()
        return {
            "out": str(self.out_dir),
            "report": report,
            "summary": summary,
            "records": self.records,
            "plots": plots,
            "specbench_answers": [str(p) for p in answers.values()],
        }


__all__ = [
    "environment",
    "load_cost_model",
    "preset_run_config",
    "run_benchmark",
]
