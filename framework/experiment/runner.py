"""The experiment runner: decode every prompt with vanilla and speculative decoding, interleaved.

``run(cfg)`` validates everything it can before writing anything (strategy configs, skip sets
against the model, the data, prompt lengths), warms both decoders up, then for each prompt decodes
all turns with both methods (alternating which goes first, so slow drift on a shared machine hits
both equally), checks the speculative tokens against vanilla, and appends one JSON line per prompt
and method to the output file, flushed at once: an interrupted run keeps every finished prompt,
and ``--resume`` continues it.

The loop is a PyTorch Lightning predict loop (``framework.experiment.lightning``): Lightning places the model,
splits the prompts over processes (``--devices``, ``--num-nodes``), seeds, shows the progress bar
and drives the logger (``--logger wandb|csv|none``, ``framework.experiment.tracking``). `Experiment` is the
loaded model with both decoders, usable without Lightning (benchmarks, tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from framework.config import ConfigError, check_range, param
from framework.engine.adapter import ModelAdapter, adapter_for
from framework.engine.context import PrepareContext
from framework.engine.decoding import GenerationResult, SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.experiment.data import Prompt, encode_chat, load_prompts, stop_token_ids
from framework.experiment.metrics import results_table, time_breakdown
from framework.experiment.plugins import load_builtin_strategies
from framework.interfaces import REGISTRIES


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy name and its (validated) config object."""

    name: str
    config: Any = None

    def build(self, kind: str):
        cls = REGISTRIES[kind].get(self.name)
        return cls(self.config if self.config is not None else cls.Config())

    def describe(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config) if self.config is not None else {}
        return {"name": self.name, "config": cfg}


#: Values of ``--logger``.
LOGGERS = ("wandb", "csv", "none")


@dataclass(frozen=True)
class RunConfig:
    """Everything one experiment needs (built by the CLI, or directly in Python)."""

    model: str | None = param(
        None, help="HF model directory or hub id; default: embedded SmolLM2-135M-Instruct"
    )
    dtype: str = param("float32", help="float32 (exact greedy equality), float16, bfloat16, float64")
    device: str = param("auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    data: str | None = param(None, help="Spec-Bench-format JSONL; default: the built-in suite")
    categories: tuple[str, ...] = param((), help="keep only these categories")
    limit: int | None = param(None, help="at most this many prompts per category")
    max_new_tokens: int = param(128, help="new tokens per turn; >= 1")
    selector: StrategySpec = field(default_factory=lambda: StrategySpec("static"))
    length: StrategySpec = field(default_factory=lambda: StrategySpec("confidence"))
    drafter: StrategySpec = field(default_factory=lambda: StrategySpec("layer_skip"))
    verifier: StrategySpec = field(default_factory=lambda: StrategySpec("greedy"))
    output: str | None = param(None, help="results JSONL (appended); default runs/<method>-<time>.jsonl")
    seed: int = param(0, help="torch seed")
    warmup: int = param(1, help="warm-up generations per method before timing")
    threads: int | None = param(None, help="torch CPU threads (default: torch's choice)")
    stop_strings: tuple[str, ...] = param((), help="extra strings that end a turn")
    name: str | None = param(None, help="method name in the results (default selector+length)")
    baseline_only: bool = param(False, help="decode with the vanilla baseline only (the `vanilla` preset)")
    kernels: bool = param(
        True, help="the batch-invariant CPU kernels (framework.kernels.cpu) for float32 on CPU"
    )
    logger: str = param("none", help="wandb (offline without an API key), csv or none")
    wandb_project: str = param("selfspec", help="W&B project of --logger wandb")
    plots: bool = param(True, help="save PNG plots in the run directory (and log them)")
    resume: bool = param(False, help="skip prompts already in --output (same configuration only)")
    devices: int = param(1, help="processes per node (GPUs, or CPU processes); > 1 splits the prompts (DDP)")
    num_nodes: int = param(1, help="nodes of a multi-node run (Lightning's DDP environment)")

    def __post_init__(self) -> None:
        check_range("--max-new-tokens", self.max_new_tokens, 1, integer=True)
        check_range("--warmup", self.warmup, 0, integer=True)
        if self.limit is not None:
            check_range("--limit", self.limit, 1, integer=True)
        if self.threads is not None:
            check_range("--threads", self.threads, 1, integer=True)
        check_range("--devices", self.devices, 1, integer=True)
        check_range("--num-nodes", self.num_nodes, 1, integer=True)
        if self.device.startswith("cuda:") and self.devices * self.num_nodes > 1:
            raise ConfigError(
                "--device",
                self.device,
                "auto or cuda with --devices > 1 (cuda:N names one GPU; --devices N uses GPUs 0..N-1)",
            )
        if self.logger not in LOGGERS:
            raise ConfigError("--logger", self.logger, f"one of {', '.join(LOGGERS)}")
        if self.name == "vanilla" and not self.baseline_only:
            raise ConfigError("--name", self.name, "a name other than 'vanilla' (the baseline's name)")
        for kind in REGISTRIES:
            spec = getattr(self, kind)
            if not isinstance(spec, StrategySpec):
                raise ConfigError(f"--{kind}", spec, "a StrategySpec")

    @property
    def method_name(self) -> str:
        if self.baseline_only:
            return "vanilla"
        return self.name or f"{self.selector.name}+{self.length.name}"

    def describe(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in REGISTRIES}
        out.update({kind: getattr(self, kind).describe() for kind in REGISTRIES})
        out["categories"] = list(self.categories)
        out["stop_strings"] = list(self.stop_strings)
        return out


def build_decoder(adapter: ModelAdapter, cfg: RunConfig) -> SpeculativeDecoder:
    """Instantiate the four strategies and the speculative decoder (runs every ``setup``)."""
    parts = {kind: getattr(cfg, kind).build(kind) for kind in REGISTRIES}
    return SpeculativeDecoder(
        adapter, parts["selector"], parts["length"], parts["drafter"], parts["verifier"]
    )


def turn_record(res: GenerationResult, text: str) -> dict[str, Any]:
    """One turn of a results record (the fields every JSONL record of a run and a benchmark has)."""
    return {
        "tokens": res.tokens,
        "text": text,
        "new_tokens": res.new_tokens,
        "wall_time": res.wall_time,
        "stop_reason": res.stop_reason,
        "accept_lengths": res.accept_lengths,
        "draft_lengths": res.draft_lengths,
        "drafted": res.drafted,
        "accepted": res.accepted,
        "skip_ratios": res.skip_ratios,
        "plans": res.plans,
        "exit_layers": res.exit_layers,
        "timings": res.timings,
        "target_forwards": res.target_forwards,
        "draft_forwards": res.draft_forwards,
        "verify_tokens": res.verify_tokens,
        "strategy_summary": res.strategy_summary,
    }


def _prompt_record(prompt: Prompt, name: str, results: list, lossless: bool | None) -> dict[str, Any]:
    """One JSONL line: a prompt decoded by one method (all turns)."""
    return {
        "question_id": prompt.question_id,
        "category": prompt.category,
        "subcategory": prompt.subcategory,
        "method": name,
        "turns": [turn_record(r, t) for r, t in results],
        "new_tokens": sum(r.new_tokens for r, _ in results),
        "wall_time": sum(r.wall_time for r, _ in results),
        "accept_lengths": [a for r, _ in results for a in r.accept_lengths],
        "drafted": sum(r.drafted for r, _ in results),
        "accepted": sum(r.accepted for r, _ in results),
        "timings": {k: sum(r.timings.get(k, 0.0) for r, _ in results) for k in results[0][0].timings},
        "lossless": lossless,
    }


class Experiment:
    """A loaded model plus both decoders, ready to decode prompts (used by ``run`` and tests)."""

    def __init__(
        self,
        cfg: RunConfig,
        model: Any = None,
        tokenizer: Any = None,
        *,
        artifact_stem: Path | None = None,
        log: Callable[[str], None] = print,
        prompts: list[Prompt] | None = None,
    ) -> None:
        load_builtin_strategies()
        self.cfg = cfg
        if model is None:
            from framework.experiment.models import load_model

            model, tokenizer = load_model(cfg.model, cfg.dtype, cfg.device)
        self.model, self.tokenizer = model, tokenizer
        self.adapter = adapter_for(model, fast_kernels=None if cfg.kernels else False)
        self.eos = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.prepare_ctx = PrepareContext(
            adapter=self.adapter,
            encode=lambda text: encode_chat(self.tokenizer, [{"role": "user", "content": text}]),
            eos_token_ids=frozenset(self.eos),
            artifact_stem=artifact_stem,
            log=log,
            dtype=cfg.dtype,
        )
        if prompts is not None:  # before any (possibly long) preparation
            self.check_prompts(prompts)
        self.rebuild()

    def rebuild(self) -> None:
        """Fresh strategy instances (after warm-up, so that state a strategy carries across
        prompts, such as an adaptive threshold or a sampler's RNG, starts from its defaults).

        Each instance's `Strategy.prepare` runs with the experiment's context; work kept in
        ``prepare_ctx.store`` (an offline search) is not repeated.
        """
        self.spec = build_decoder(self.adapter, self.cfg)
        if not self.cfg.baseline_only:
            self.spec.prepare(self.prepare_ctx)
        # The baseline gets its own verifier instance (its own RNG stream when sampling).
        self.vanilla = VanillaDecoder(self.adapter, self.cfg.verifier.build("verifier"))

    def stop(self, max_new_tokens: int | None = None) -> StopCondition:
        return StopCondition(
            max_new_tokens or self.cfg.max_new_tokens,
            self.eos,
            self.cfg.stop_strings,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
        )

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.eos], skip_special_tokens=True)

    def check_prompts(self, prompts: list[Prompt]) -> None:
        """Fail before any decoding if a first turn cannot fit in the context."""
        limit = self.adapter.max_context
        for p in prompts:
            n = len(encode_chat(self.tokenizer, [{"role": "user", "content": p.turns[0]}]))
            if n + self.cfg.max_new_tokens > limit:
                raise ConfigError(
                    f"prompt {p.question_id} ({p.category})",
                    f"{n} tokens + --max-new-tokens {self.cfg.max_new_tokens}",
                    f"at most the model's context of {limit} tokens",
                )

    def decode_prompt(
        self, decoder: Any, prompt: Prompt, max_new_tokens: int | None = None
    ) -> list[tuple[GenerationResult, str]]:
        """All turns of ``prompt``; each turn sees this decoder's own earlier answers."""
        messages: list[dict[str, str]] = []
        out = []
        stop = self.stop(max_new_tokens)
        for turn in prompt.turns:
            messages.append({"role": "user", "content": turn})
            ids = torch.tensor([encode_chat(self.tokenizer, messages)], device=self.adapter.device)
            res = decoder.generate(ids, stop)
            text = self.text(res.tokens)
            messages.append({"role": "assistant", "content": text})
            out.append((res, text))
        return out


def default_output(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = "".join(ch if ch.isalnum() or ch in "-_+" else "_" for ch in cfg.method_name)
    return Path("runs") / f"{safe}-{stamp}.jsonl"


def environment() -> dict[str, Any]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


#: RunConfig fields that may differ between a run and its ``--resume``: they change how or where
#: prompts are decoded and logged, or which prompts are in the set, never a prompt's result.
RESUMABLE_FIELDS = frozenset(
    {
        "output",
        "resume",
        "warmup",
        "threads",
        "devices",
        "num_nodes",
        "logger",
        "plots",
        "wandb_project",
        "limit",
        "categories",
    }
)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a results JSONL (a torn last line from a killed run is ignored)."""
    if not path.exists():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ConfigError("--output", str(path), f"a results JSONL (line {i + 1} is not JSON)") from None
    return out


def _repair_tail(path: Path, log: Callable[[str], None]) -> None:
    """Cut a torn last line (a run killed mid-write) so that appended records start on a fresh line."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    path.write_bytes(data[:cut])
    log(
        f"[selfspec] {path}: dropped an incomplete last line ({len(data) - cut} bytes) left by an interrupted run"
    )


def resume_state(
    cfg: RunConfig, out_path: Path, methods: list[str], log: Callable[[str], None]
) -> set[tuple[str, str]]:
    """Prompts already complete in ``out_path`` (every method recorded), after checking that the
    file was written by the same configuration.

    Raises:
        ConfigError: no ``--output``, no metadata next to the file, or a different configuration.
    """
    from framework.experiment.lightning import prompt_key

    if cfg.output is None:
        raise ConfigError("--output", None, "the results file to continue when --resume is given")
    if not out_path.exists():
        return set()
    meta_path = out_path.with_suffix(".meta.json")
    if not meta_path.exists():
        raise ConfigError(
            "--resume",
            str(out_path),
            f"a results file written by run.py (its metadata {meta_path.name} is missing)",
        )
    old = json.loads(meta_path.read_text()).get("config", {})
    new = json.loads(json.dumps(cfg.describe(), default=str))
    diff = sorted(k for k in set(old) | set(new) if k not in RESUMABLE_FIELDS and old.get(k) != new.get(k))
    if diff:
        detail = "; ".join(f"{k}: file {old.get(k)!r}, now {new.get(k)!r}" for k in diff)
        raise ConfigError(
            "--resume",
            str(out_path),
            f"a results file from the same configuration (it differs in {detail}); "
            "resume with the original flags or write to a new --output",
        )
    _repair_tail(out_path, log)
    seen: dict[tuple[str, str], set[str]] = {}
    for rec in read_records(out_path):
        seen.setdefault(prompt_key(rec), set()).add(rec["method"])
    return {k for k, got in seen.items() if set(methods) <= got}


def run(
    cfg: RunConfig, log: Callable[[str], None] = print, model: Any = None, tokenizer: Any = None
) -> dict[str, Any]:
    """Run one experiment as a Lightning predict loop; returns ``{"output", "table", "breakdown",
    "records", "summary", "plots", "run_dir"}`` (on rank 0; other ranks get ``{}``).

    Every prompt's records are appended to ``cfg.output`` as soon as the prompt is done. With
    ``cfg.resume`` the prompts already in the file are skipped (the file must come from the same
    configuration). Ctrl-C stops after the current prompt's records are written and raises
    KeyboardInterrupt.

    Raises:
        ConfigError, DataError, ModelLoadError, UnknownNameError: bad input, before anything is
            written.
    """
    import pytorch_lightning as pl

    from framework.experiment.lightning import (
        DecodeModule,
        PlainProgress,
        ResultsWriter,
        SpeedupProgressBar,
        prompt_key,
    )
    from framework.experiment.tracking import TrackingCallback, make_logger, summary_metrics

    pl.seed_everything(cfg.seed, verbose=False)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    prompts = load_prompts(cfg.data, cfg.categories or None, cfg.limit)
    out_path = resolve_output(cfg)
    method = cfg.method_name
    names = ["vanilla"] + ([] if cfg.baseline_only else [method])
    rank0 = launch_rank(cfg) == 0
    done = resume_state(cfg, out_path, names, log if rank0 else (lambda _m: None)) if cfg.resume else set()
    todo = [p for p in prompts if prompt_key(p) not in done]
    if done and rank0:
        log(
            f"[selfspec] --resume: {len(prompts) - len(todo)} of {len(prompts)} prompts already in {out_path}"
        )
    run_dir = out_path.with_suffix("")
    meta = {"config": cfg.describe(), "environment": environment(), "method": method, "started": time.time()}
    exp = None
    if cfg.devices * cfg.num_nodes == 1:  # validate and prepare before any logger or file exists
        exp = Experiment(cfg, model, tokenizer, artifact_stem=run_dir, log=log, prompts=todo)
    module = DecodeModule(cfg, todo, out_path, meta, model, tokenizer, log, experiment=exp)
    tty = sys.stderr.isatty() and rank0
    callbacks: list[Any] = [
        ResultsWriter(out_path),
        TrackingCallback(out_path, method, run_dir / "plots" if cfg.plots else None, read_records),
        SpeedupProgressBar() if tty else PlainProgress(),
    ]
    logger = (
        make_logger(cfg.logger, run_dir, run_dir.name, cfg.wandb_project, cfg.describe()) if rank0 else None
    )
    t_start = time.perf_counter()
    sigint = signal.getsignal(signal.SIGINT)
    with _quiet_lightning():
        trainer = pl.Trainer(
            accelerator=_accelerator(cfg.device),
            devices=_devices(cfg),
            num_nodes=cfg.num_nodes,
            strategy="ddp" if cfg.devices * cfg.num_nodes > 1 else "auto",
            logger=logger if logger is not None else False,
            callbacks=callbacks,
            enable_progress_bar=tty,
            enable_checkpointing=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            inference_mode=True,
            default_root_dir=str(run_dir),
        )
        try:
            trainer.predict(module, return_predictions=False)
        except SystemExit:
            # Lightning turns Ctrl-C into SystemExit(1) after a graceful shutdown (and ignores
            # further SIGINTs); give the caller the interruption back, with the usual handler.
            signal.signal(signal.SIGINT, sigint)
            if trainer.interrupted:
                raise KeyboardInterrupt from None
            raise
    if trainer.global_rank != 0:
        return {}
    records = read_records(out_path)
    table = results_table(records, method)
    breakdown = time_breakdown(records, names)
    title = "vanilla (baseline only)" if cfg.baseline_only else f"{method} vs vanilla"
    plot_paths = callbacks[1].plot_paths
    report = (
        f"## {title}\n\n{table}\n\nWhere the time goes (share of wall time):\n\n{breakdown}\n\n"
        f"{len(todo)} prompts decoded in {time.perf_counter() - t_start:.0f} s"
        + (f" ({len(prompts) - len(todo)} resumed from the file)" if done else "")
        + f"; results: {out_path}\n"
        + (f"plots: {run_dir / 'plots'}\n" if plot_paths else "")
    )
    out_path.with_suffix(".md").write_text(report)
    log("\n" + report)
    if logger is not None:
        _close_logger(logger, log)
    return {
        "output": str(out_path),
        "table": table,
        "breakdown": breakdown,
        "records": records,
        "summary": summary_metrics(records, method),
        "plots": [str(p) for p in plot_paths],
        "run_dir": str(run_dir),
    }


def launch_rank(cfg: RunConfig) -> int:
    """This process's global rank as the launcher set it before Lightning starts: ``RANK``
    (torchrun), ``SLURM_PROCID`` (srun), else Lightning's own ``NODE_RANK`` and ``LOCAL_RANK``."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return int(env.get("NODE_RANK", "0")) * cfg.devices + int(env.get("LOCAL_RANK", "0"))


def _external_launcher() -> bool:
    """Processes started by torchrun or srun (not by Lightning's launcher from rank 0)."""
    env = os.environ
    return (
        "TORCHELASTIC_RUN_ID" in env
        or ("RANK" in env and "WORLD_SIZE" in env)
        or int(env.get("SLURM_NTASKS", "1")) > 1
    )


def resolve_output(cfg: RunConfig) -> Path:
    """``cfg.output``, or a fresh ``runs/<method>-<time>.jsonl``; DDP ranks started by Lightning's
    launcher inherit rank 0's choice through the environment.

    Raises:
        ConfigError: several processes started by an external launcher (torchrun, srun) and no
            ``--output``: each would pick its own timestamped file.
    """
    if cfg.output:
        return Path(cfg.output)
    if cfg.devices * cfg.num_nodes > 1 and _external_launcher():
        raise ConfigError(
            "--output", None, "a results file named explicitly when torchrun or srun starts the processes"
        )
    inherited = os.environ.get("SELFSPEC_RUN_OUTPUT")
    if inherited and launch_rank(cfg) > 0:
        return Path(inherited)
    path = default_output(cfg)
    if cfg.devices * cfg.num_nodes > 1:
        os.environ["SELFSPEC_RUN_OUTPUT"] = str(path)
    return path


def _accelerator(device: str) -> str:
    if device == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device", device, "cpu or auto (this machine has no CUDA device)")
        return "gpu"
    return "cpu"


def _devices(cfg: RunConfig) -> Any:
    if cfg.device.startswith("cuda:"):  # one named GPU
        return [int(cfg.device.split(":", 1)[1])]
    return cfg.devices


class _quiet_lightning:
    """Silence Lightning's start-up banners and its advice about data-loader workers (one prompt
    per step is the point here)."""

    def __enter__(self) -> None:
        import logging
        import warnings

        self._levels = {}
        for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric"):
            lg = logging.getLogger(name)
            self._levels[name] = lg.level
            lg.setLevel(logging.WARNING)
        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*predict_dataloader.*num_workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated.*")
        warnings.filterwarnings("ignore", message=".*infer the batch indices.*")
        warnings.filterwarnings("ignore", message=".*`DataLoader` across ranks is zero.*")

    def __exit__(self, *exc: Any) -> None:
        import logging

        self._warn.__exit__(*exc)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


def _close_logger(logger: Any, log: Callable[[str], None]) -> None:
    """Finish a W&B run this experiment started (not one a sweep agent owns) and say where it is."""
    from pytorch_lightning.loggers import WandbLogger

    if not isinstance(logger, WandbLogger):
        log(f"[selfspec] metrics: {logger.log_dir}")
        return
    import wandb

    run = logger.experiment
    offline = run.settings.mode in ("offline", "dryrun")
    run_dir = Path(run.dir).parent
    if getattr(logger, "selfspec_owned", False) and wandb.run is run:
        run.finish()
    if offline:
        log(f"[selfspec] W&B offline run: {run_dir} (upload with `wandb sync {run_dir}`)")


def print_error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
