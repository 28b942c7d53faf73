"""The one pipeline behind ``run.py``, ``bench.py``, the sweeps and the Python API: `run`.

A run decodes every prompt with each of its methods in rotated order, through a Lightning predict
loop (`framework.runner.lightning`), and writes each prompt's records as soon as they exist. Its
methods come from the configuration (`framework.session.methods`): ``run.py``'s are the vanilla
baseline and the method section; ``bench.py`` names several (``compare.methods``). Whatever the
methods, the run does the same steps: seed and load the prompts, skip what ``--resume`` finds
finished, load the model and build every method (before anything is written: bad input fails
first), write the metadata and the configuration (``--config`` reruns it), record the CUDA graphs
and warm up, decode (DDP over prompts with ``--devices``/``--num-nodes``), take the cost model
(``--cost-model``), and write the report, the plots, the tracker's summary (``--logger``) and the
Spec-Bench answer files (also on Ctrl-C).

Where the files go (`Layout`): one folder, whatever the number of methods: ``records.jsonl``,
``meta.json``, ``config.yaml``, ``bench.md`` (the report, `framework.benchmark.report`), the plots,
``cost_model.json`` and ``tracking/``. Before issue 56 ``run.py`` wrote ``<stem>.jsonl`` beside
``<stem>.meta.json``, ``<stem>.config.yaml`` and ``<stem>.md``; ``--output <stem>.jsonl`` now names
the folder ``<stem>``, and ``--resume`` continues such a file there (`migrate_results_file`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from framework.benchmark.load import other_cores_now, threads_for_load, vanilla_spread
from framework.benchmark.load import warnings as load_warnings
from framework.benchmark.report import make_plots, render_report, results_markdown, summarize
from framework.config_fields import ConfigError
from framework.data.prompts import load_prompts
from framework.data.specbench import check_answer_dir, write_answer_files
from framework.engine.cost_model import CostModel
from framework.models.loading import dtype_name, model_name
from framework.models.provenance import environment
from framework.results.metrics import aggregate, time_breakdown
from framework.results.records import read_records, resume_state
from framework.runner.lightning import DecodeModule, Methods, PlainProgress, ResultsWriter, SpeedupProgressBar
from framework.runner.tracking import TrackingCallback, log_summary
from framework.session.dependencies import check_dependencies
from framework.session.loggers import close_logger, make_logger
from framework.session.methods import BASELINE, MethodSpec, preset_run_config
from framework.session.methods import specs as methods_of
from framework.session.run_config import RunConfig
from framework.session.session import provenance


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's): Lightning's
    ``seed_everything``, without its log line."""
    pl.seed_everything(seed, verbose=False)


def stamped(label: str, suffix: str = "") -> Path:
    """``runs/<label>-<YYYYmmdd-HHMMSS><suffix>``, ``label`` made safe for a file name."""
    safe = "".join(ch if ch.isalnum() or ch in "-_+" else "_" for ch in label)
    return Path("runs") / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}"


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented JSON (values JSON cannot hold written as strings)."""
    path.write_text(json.dumps(data, indent=2, default=str))


@dataclass(frozen=True)
class Layout:
    """Where a run's files go: one folder, whatever the number of methods (``run.py``'s one,
    ``bench.py``'s several)."""

    root: Path

    @property
    def records(self) -> Path:
        return self.root / "records.jsonl"

    @property
    def meta(self) -> Path:
        return self.root / "meta.json"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def report(self) -> Path:
        return self.root / "bench.md"

    @property
    def plots(self) -> Path:
        return self.root

    @property
    def tracker(self) -> Path:
        return self.root / "tracking"

    def stem(self, label: str) -> Path:
        """Where method ``label`` keeps its artefacts (an offline search's skip set)."""
        return self.root / label


class AnswerFiles:
    """Spec-Bench's answer files of a run (``--specbench-answers``; off when empty), one per
    method, rewritten whole from the records each time they are written.

    Raises:
        ConfigError: at once, before anything is written (`check_answer_dir`).
    """

    def __init__(
        self,
        directory: str | None,
        methods: Sequence[str],
        protect: Iterable[Path],
        model: str | None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.protect = list(protect)
        check_answer_dir(directory, methods, self.protect)
        self.directory, self.model, self.log = directory, model, log

    def write(
        self, records: Iterable[Mapping[str, Any]], repeats: int | None = None, net: Any = None
    ) -> dict[str, Path]:
        """Write the files of ``records`` (``repeats`` > 1: one folder per repeat); ``net``: the
        loaded model, which names the answers when ``--model`` is a path."""
        if not self.directory:
            return {}
        model = model_name(self.model, net)
        paths = write_answer_files(
            records, self.directory, model=model, repeats=repeats, protect=self.protect
        )
        self.log(f"[selfspec] Spec-Bench answer files: {', '.join(str(p) for p in paths.values())}")
        return paths


def run(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    model: Any = None,
    tokenizer: Any = None,
    *,
    output: Path | None = None,
    custom: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``cfg``'s methods on its prompts; returns (on rank 0; ``{}`` elsewhere) ``{"output"
    (the results JSONL), "out" (the run's folder), "records", "report", "table" (the report's
    results table), "summary" (`framework.benchmark.report.summarize`), "plots" ({name: path}),
    "specbench_answers"}``.

    Args:
        cfg: the configuration.
        log: progress lines.
        model: an already loaded model (tests, sweeps); else ``cfg.model`` is loaded.
        tokenizer: ``model``'s tokenizer (with ``model``).
        output: where the results go (default `resolve_output`).
        custom: extra methods ``{label: decoder}`` (a decoder has ``generate(prompt_ids, stop) ->
            GenerationResult``), e.g. a modified decoder under test; one process only.

    Ctrl-C stops after the current prompt's records are written, writes the answer files of the
    records so far and raises KeyboardInterrupt.

    Raises:
        ConfigError, DataError, ModelLoadError, UnknownNameError: bad input, before anything is
            written.
    """
    r = _Run(cfg, log, output, custom)
    methods = None
    if r.world == 1:  # validated and prepared before any logger or file exists
        methods = Methods.load(
            cfg, r.specs, model, tokenizer, stem=r.layout.stem, log=log, prompts=r.prompts, custom=custom
        )
        _check_layers(cfg, methods, r.cost)
    module = DecodeModule(
        cfg,
        r.specs,
        r.items,
        r.layout.stem,
        log,
        methods,
        model=model,
        tokenizer=tokenizer,
        custom=custom,
        on_setup=r.on_setup,
    )
    tty = sys.stderr.isatty() and r.rank0
    progress = SpeedupProgressBar() if tty else PlainProgress()
    callbacks = [ResultsWriter(r.layout.records), TrackingCallback(), progress]
    logger = r.tracker(methods) if r.rank0 else None
    try:
        trainer_args = _trainer_args(cfg, r.layout.root, callbacks, logger, tty)
        trainer = _predict(cfg, module, trainer_args, lambda: r.write_answers(module))
        result = r.finish(module, logger) if trainer.global_rank == 0 else {}
    except BaseException:
        if logger is not None:
            close_logger(logger, log, failed=True)
        raise
    if logger is not None:
        close_logger(logger, log)
    return result


class _Run:
    """The plan and the steps of one `run`: what to decode (the prompts, the methods, what
    ``--resume`` left), where it goes (`Layout`), and what is written before and after."""

    def __init__(
        self,
        cfg: RunConfig,
        log: Callable[[str], None],
        output: Path | None,
        custom: dict[str, Any] | None,
    ) -> None:
        seed_everything(cfg.generation.seed)
        if cfg.runner.threads:
            torch.set_num_threads(cfg.runner.threads)
        elif _on_cpu(cfg):
            _yield_busy_cores(log)
        self.cfg, self.log, d = cfg, log, cfg.data
        self.prompts = load_prompts(d.path, d.categories or None, d.limit, d.offset)
        self.specs = methods_of(cfg) + [MethodSpec(label, "custom") for label in custom or {}]
        presets = [
            preset_run_config(s, cfg).method for s in self.specs if s.kind == "preset" and cfg.compare.methods
        ]
        check_dependencies(cfg, presets, self.prompts)  # before any model loads
        labels = self.labels = [s.label for s in self.specs]
        if len(set(labels)) != len(labels):
            raise ConfigError(
                "custom", sorted({x for x in labels if labels.count(x) > 1}), "names not used by --methods"
            )
        layout = self.layout = Layout(output or resolve_output(cfg))
        self.rank0, self.world = launch_rank(cfg) == 0, cfg.runner.devices * cfg.runner.num_nodes
        if custom and self.world > 1:
            raise ConfigError("--devices", self.world, "1 with custom decoders (they live in this process)")
        if not cfg.runner.resume and layout.records.exists() and layout.records.stat().st_size:
            # appending would mix this run's records with an earlier run's in one report
            raise ConfigError(
                "--output", str(layout.root), "a new or empty directory (records.jsonl exists), or --resume"
            )
        if cfg.runner.resume and self.rank0:
            migrate_results_file(cfg, layout, log)
        self.answers = AnswerFiles(
            cfg.runner.specbench_answers, labels, [layout.records], cfg.model.name_or_path, log
        )
        say = log if self.rank0 else (lambda _m: None)
        done = (
            resume_state(cfg, layout.records, labels, say, layout.meta, repair=self.rank0)
            if cfg.runner.resume
            else set()
        )
        self.resumed = bool(done)
        reps = cfg.compare.repeats
        self.items = [
            (r, p)
            for r in range(reps)
            for p in self.prompts
            if (r, p.category, str(p.question_id)) not in done
        ]
        if done:
            total = len(self.prompts) * reps
            say(
                f"[selfspec] --resume: {total - len(self.items)} of {total} prompts already in {layout.records}"
            )
        given = cfg.compare.cost_model
        self.cost = load_cost_model(given) if given not in ("none", "measure") else None
        self.meta = {
            "config": cfg.describe(),
            "environment": environment(),
            "prompts": len(self.prompts),
            "started": time.time(),
        }

    def describe(self, ms: Methods) -> dict[str, Any]:
        """What the methods resolved to, once per process: provenance, notes, resolved ``auto``
        settings and each method's settings (the metadata's and the tracker's)."""
        if "methods" not in self.meta:
            self.meta.update(
                provenance=provenance(self.cfg.model.name_or_path, ms.base),
                dtype_resolved=dtype_name(ms.base.adapter.arch.dtype),
                method=", ".join(self.labels[1:]) or BASELINE,
                notes=ms.notes(),
                resolved={k: e.resolved() for k, e in ms.sessions.items() if k != BASELINE},
                methods=ms.settings(),
            )
        return {k: self.meta[k] for k in ("provenance", "notes", "resolved", "methods")}

    def on_setup(self, module: DecodeModule) -> None:
        """Once the methods exist on this process: the metadata and the saved config (rank 0)."""
        cfg, layout = self.cfg, self.layout
        self.describe(module.methods)
        if module.trainer.global_rank != 0:
            return
        if not (cfg.runner.resume and layout.meta.exists()):  # a resumed run keeps its metadata
            layout.records.parent.mkdir(parents=True, exist_ok=True)
            write_json(layout.meta, self.meta)
            cfg.save(layout.config)  # `run.py --config` reruns it
        arch = module.methods.base.adapter.arch
        self.log(
            f"[selfspec] {len(self.items)} prompt(s) to decode on {module.trainer.world_size} process(es) | "
            f"model {arch.info().name} ({self.meta['dtype_resolved']}, {arch.device}) | methods "
            f"{', '.join(self.labels)} | max_new_tokens={cfg.generation.max_new_tokens} | output {layout.root}"
        )

    def tracker(self, methods: Methods | None) -> Any:
        """The ``--logger`` of the run, its config the run's settings and `describe` (on several
        processes the methods load later: their entries are empty)."""
        cfg, layout = self.cfg, self.layout
        tracked = {**cfg.describe(), "provenance": None, "notes": [], "resolved": {}, "methods": {}}
        if methods is not None:
            tracked.update(self.describe(methods))
        return make_logger(
            cfg.runner.logger, layout.tracker, layout.root.name, cfg.runner.wandb_project, tracked
        )

    def write_answers(
        self, module: DecodeModule, records: list[dict[str, Any]] | None = None
    ) -> dict[str, Path]:
        net = module.methods.model if module.methods else None
        records = read_records(self.layout.records) if records is None else records
        return self.answers.write(records, self.cfg.compare.repeats, net)

    def finish(self, module: DecodeModule, logger: Any) -> dict[str, Any]:
        """After decoding (rank 0): the cost model, the load check, the report and plots, the
        tracker's summary and the answer files."""
        cfg, layout, ms, specs, labels = self.cfg, self.layout, module.methods, self.specs, self.labels
        records = read_records(layout.records)
        cost = self.cost
        if cfg.compare.cost_model == "measure":
            cost = ms.prepared.cost_model()
            if cost is None:
                self.log("[selfspec] measuring the cost model (draft and verification costs; about 15 s) ...")
                start = time.perf_counter()
                cost = CostModel.measure(ms.base.adapter, log=self.log)
                self.log(f"[selfspec] cost model measured in {time.perf_counter() - start:.0f} s")
            layout.root.mkdir(parents=True, exist_ok=True)
            write_json(layout.root / "cost_model.json", {"cost_model": cost.to_dict()})  # --cost-model
        spread = _spread(records)
        host_lines = [w.line(label) for label, w in module.host_work.items()]
        full = full_model_drafts(records, labels)
        for label, note in full.items():
            self.log(f"note: {label}: {note}")
        load, said = module.load, load_warnings(module.load, spread)
        if layout.meta.exists():
            meta = json.loads(layout.meta.read_text())
            write_json(
                layout.meta,
                {**meta, "load": load, "vanilla_repeat_spread": spread, "warnings": said,
                 "host_work": {label: w.summary() for label, w in module.host_work.items()}},
            )  # fmt: skip
        heads = head_costs(cost, specs, ms.decoders, ms.base.adapter) if cost is not None else {}
        method_costs = {s.label: heads.get(s.label, cost) for s in specs}
        summary = summarize(records, labels, method_costs)
        plots = {}
        if cfg.runner.plots and records:
            layers = ms.base.adapter.arch.info().num_layers
            plots = make_plots(layout.plots, summary, records, layers)
        hf = {s.label: ms.decoders[s.label].describe() for s in specs if s.kind == "hf"}
        undone = len(self.prompts) * cfg.compare.repeats - len(self.items)
        report = render_report(
            self.cfg, summary, self.meta["environment"], len(self.prompts), module.elapsed, plots, hf, cost,
            heads, method_costs, graphs=module.graphs, load=load, warnings=said,
            run_notes={k: [*self.meta["notes"].get(k, []), *([full[k]] if k in full else [])]
                       for k in {*self.meta["notes"], *full}},
            host_work=host_lines, resumed=undone if self.resumed else 0,
            breakdown=time_breakdown([r for r in records if not r.get("error")], labels),
        )  # fmt: skip
        layout.report.write_text(report)
        self.log("\n" + report)
        if logger is not None:
            log_summary(logger, records, summary, report, plots, labels)
        written = self.write_answers(module, records)
        return {
            "output": str(layout.records),
            "out": str(layout.root),
            "records": records,
            "report": report,
            "table": results_markdown(summary),
            "summary": summary,
            "plots": plots,
            "specbench_answers": [str(p) for p in written.values()],
        }


def _on_cpu(cfg: RunConfig) -> bool:
    """The run decodes on this machine's CPU in one process."""
    m, r = cfg.model, cfg.runner
    on_cpu = m.device == "cpu" or (m.device == "auto" and not m.device_map and not torch.cuda.is_available())
    return on_cpu and r.devices * r.num_nodes == 1


def _yield_busy_cores(log: Callable[[str], None]) -> None:
    """Fewer torch threads when other processes keep cores busy (`threads_for_load`), said."""
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    if threads <= 1:
        return  # nothing to give up (and no half second spent looking)
    other = other_cores_now()
    use = threads_for_load(threads, cores, other)
    if use < threads:
        torch.set_num_threads(use)
        log(
            f"[selfspec] other processes keep {other:.2f} of {cores} cores busy: torch runs {use} thread(s), "
            f"not {threads}, on the cores left free (--threads N sets it)"
        )


def _check_layers(cfg: RunConfig, methods: Methods, cost: CostModel | None) -> None:
    layers = methods.base.adapter.arch.info().num_layers
    if cost is not None and cost.num_layers != layers:
        raise ConfigError(
            "--cost-model",
            cfg.compare.cost_model,
            f"a cost model of a {layers}-layer model, not {cost.num_layers}",
        )


def _spread(records: list[dict[str, Any]]) -> float | None:
    by_rep: dict[int, list[float]] = {}
    for r in records:
        if r["method"] == BASELINE and not r.get("error"):
            tw = by_rep.setdefault(r.get("repeat", 0), [0.0, 0.0])
            tw[0] += r["new_tokens"]
            tw[1] += r["wall_time"]
    return vanilla_spread([t / w for t, w in by_rep.values() if w > 0])


def head_costs(
    cost: CostModel, specs: list[MethodSpec], decoders: dict[str, Any], adapter: Any
) -> dict[str, CostModel]:
    """``{label: cost model}`` of the methods whose drafter scores a reduced vocabulary or runs
    compressed weights: ``cost`` with its draft steps priced for that head and those weights."""
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


def full_model_drafts(records: list[dict[str, Any]], labels: Sequence[str]) -> dict[str, str]:
    """``{method: a sentence}`` for each method whose drafts ran with plans that skipped nothing
    (a skip ratio that rounds to zero sub-layers of the model): its draft was the full model, so
    every draft token was accepted and no round could be cheaper than plain decoding."""
    stats = aggregate([r for r in records if not r.get("error")]).get("overall", {})
    out = {}
    for label in labels:
        m = stats.get(label)
        if label != BASELINE and m is not None and m.skip_rounds and m.skip_ratio == 0.0 and m.drafted:
            out[label] = (
                "its drafts skipped no sub-layer in any round (the skip ratio rounds to zero of this model's "
                "sub-layers): the draft is the full model, so alpha is 1 by construction and drafting only "
                "costs time; raise --selector.skip_ratio or use a larger model"
            )
    return out


def _external_environment() -> ClusterEnvironment | None:
    """The cluster environment of processes an external launcher started (torchrun, srun), as
    Lightning's trainer detects it; ``None`` for one process or Lightning's own launcher."""
    for kind in (TorchElasticEnvironment, SLURMEnvironment):
        if kind.detect():
            return kind()
    return None


def launch_rank(cfg: RunConfig) -> int:
    """This process's global rank before Lightning starts: the external launcher's (torchrun,
    srun), else what Lightning's own launcher gives its processes (node rank and local rank)."""
    external = _external_environment()
    if external is not None:
        return external.global_rank()
    own = LightningEnvironment()
    return own.node_rank() * cfg.runner.devices + own.local_rank()


def resolve_output(cfg: RunConfig) -> Path:
    """The run's folder: ``cfg.runner.output``, or a fresh ``runs/<method>-<time>`` (several
    methods: ``runs/bench-<time>``). A results file's name (``x.jsonl``, what ``run.py`` wrote
    before issue 56) names the folder ``x``. DDP ranks started by Lightning's launcher inherit rank
    0's choice through the environment.

    Raises:
        ConfigError: several processes started by an external launcher (torchrun, srun) and no
            ``--output``: each would pick its own timestamped folder.
    """
    if cfg.runner.output:
        given = Path(cfg.runner.output)
        return given.with_suffix("") if given.suffix == ".jsonl" else given
    several = cfg.runner.devices * cfg.runner.num_nodes > 1
    if several and _external_environment() is not None:
        raise ConfigError(
            "--output", None, "a folder named explicitly when torchrun or srun starts the processes"
        )
    inherited = os.environ.get("SELFSPEC_RUN_OUTPUT")
    if inherited and launch_rank(cfg) > 0:
        return Path(inherited)
    path = stamped("bench" if cfg.compare.methods else cfg.method.label)
    if several:
        os.environ["SELFSPEC_RUN_OUTPUT"] = str(path)
    return path


def migrate_results_file(cfg: RunConfig, layout: Layout, log: Callable[[str], None] = print) -> bool:
    """``--resume`` of a results file ``run.py`` wrote before issue 56 (``x.jsonl`` beside
    ``x.meta.json``, its plots and tracker in ``x/``): its records and metadata are copied into the
    folder ``x`` as ``records.jsonl`` and ``meta.json`` (the file stays as it was), once, and the
    run continues there. Returns whether it copied."""
    given = Path(cfg.runner.output) if cfg.runner.output else None
    if given is None or given.suffix != ".jsonl" or not given.is_file() or layout.records.exists():
        return False
    layout.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(given, layout.records)
    old_meta = given.with_suffix(".meta.json")
    if old_meta.is_file():
        shutil.copyfile(old_meta, layout.meta)
    log(
        f"[selfspec] --resume: {given} (an earlier run.py's results file) continues in the folder {layout.root}"
    )
    return True


def _trainer_args(
    cfg: RunConfig, run_dir: Path, callbacks: list[Any], logger: Any, tty: bool
) -> dict[str, Any]:
    """The `pl.Trainer` of a run: its devices and processes, our callbacks and logger, no
    checkpoints, no distributed sampler (the module shards the prompts itself)."""
    device = cfg.model.device
    if device == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device", device, "cpu or auto (this machine has no CUDA device)")
        accelerator = "gpu"
    else:
        accelerator = "cpu"
    return {
        "accelerator": accelerator,
        "devices": [int(device.split(":", 1)[1])] if device.startswith("cuda:") else cfg.runner.devices,
        "num_nodes": cfg.runner.num_nodes,
        "strategy": "ddp" if cfg.runner.devices * cfg.runner.num_nodes > 1 else "auto",
        "logger": logger if logger is not None else False,
        "callbacks": callbacks,
        "enable_progress_bar": tty,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
        "inference_mode": True,
        "default_root_dir": str(run_dir),
    }


def _predict(
    cfg: RunConfig, module: DecodeModule, trainer_args: dict[str, Any], on_interrupt: Callable[[], Any]
) -> pl.Trainer:
    """Run the predict loop; Ctrl-C writes ``on_interrupt`` (rank 0) and raises KeyboardInterrupt."""
    sigint = signal.getsignal(signal.SIGINT)
    with _quiet_lightning():
        trainer = pl.Trainer(**trainer_args)
        try:
            trainer.predict(module, return_predictions=False)
        except SystemExit:
            # Lightning turns Ctrl-C into SystemExit(1) after a graceful shutdown (and ignores
            # further SIGINTs); give the caller the interruption back, with the usual handler.
            signal.signal(signal.SIGINT, sigint)
            if trainer.interrupted:
                if trainer.global_rank == 0:
                    on_interrupt()
                raise KeyboardInterrupt from None
            raise
    return trainer


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Silence Lightning's start-up banners and its advice about data-loader workers (one prompt
    per step is the point here)."""
    names = ("pytorch_lightning", "lightning.pytorch", "lightning.fabric")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)
    with warnings.catch_warnings():
        for message in (
            ".*does not have many workers.*",
            ".*predict_dataloader.*num_workers.*",
            ".*LeafSpec.*is deprecated.*",
            ".*infer the batch indices.*",
            ".*`DataLoader` across ranks is zero.*",
        ):
            warnings.filterwarnings("ignore", message=message)
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


__all__ = [
    "AnswerFiles",
    "Layout",
    "head_costs",
    "launch_rank",
    "load_cost_model",
    "migrate_results_file",
    "resolve_output",
    "run",
    "seed_everything",
    "stamped",
    "write_json",
]
