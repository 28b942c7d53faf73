"""The experiment as a PyTorch Lightning predict loop.

`DecodeModule.predict_step` decodes one prompt with the vanilla baseline and the configured
speculative decoder (alternating which goes first) and returns that prompt's records. Lightning
supplies the device placement, the process group when ``--devices``/``--num-nodes`` > 1 (each rank
decodes its own share of the prompts: ``prompts[rank::world]``), seeding, the progress bar and the
loggers; the callbacks here write results and log them:

- `ResultsWriter` appends each finished prompt's records to the JSONL output (one locked write
  per prompt, flushed at once, so several ranks share one file and an interruption loses nothing);
- `SpeedupProgressBar` shows prompts done, tokens/s and the running speedup;
- `TrackingCallback` sends per-prompt metrics to the logger as they come and, at the end, the
  per-category summary, the tables and the plots (``framework.runner.tracking``).

The model is loaded in ``setup`` (on each rank's own device) and is deliberately not a registered
sub-module: Lightning never wraps, moves or trains it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter, TQDMProgressBar
from torch.utils.data import DataLoader

from framework.data.prompts import Prompt
from framework.driver import write_json
from framework.interfaces import REGISTRIES
from framework.models.loading import dtype_name, resolve_dtype
from framework.results.compare import Method, compare_methods, explain_with, warm_up
from framework.results.records import prompt_key
from framework.session.run_config import RunConfig
from framework.session.session import Session, provenance

__all__ = [
    "DecodeModule",
    "PlainProgress",
    "ResultsWriter",
    "SpeedupProgressBar",
    "append_records",
    "progress_line",
    "prompt_key",
]


def _identity(x: Any) -> Any:
    return x


class DecodeModule(pl.LightningModule):
    """Decodes prompts with vanilla and speculative decoding; one predict step per prompt.

    Args:
        cfg: the run configuration.
        prompts: the prompts still to decode (already filtered by ``--resume``).
        out_path: the results JSONL; its stem names the artefacts (skip sets, run directory).
        meta: the run's metadata, written next to the results by rank 0 once the model is loaded
            and the strategies are prepared (nothing is written before validation passes).
        model, tokenizer: an already loaded model (tests, sweeps); loaded in ``setup`` otherwise.
        log: where progress lines go when no progress bar is shown.
        experiment: a `Session` built before the trainer (a single-process run validates and
            prepares everything before any logger or file exists); built in ``setup`` otherwise.
    """

    def __init__(
        self,
        cfg: RunConfig,
        prompts: list[Prompt],
        out_path: Path,
        meta: dict[str, Any],
        model: Any = None,
        tokenizer: Any = None,
        log: Callable[[str], None] = print,
        experiment: Session | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.prompts = prompts
        self.out_path = out_path
        self.meta = meta
        self.log_fn = log
        # Kept out of nn.Module registration: Lightning must not move or wrap the HF model.
        self.__dict__["_given"] = (model, tokenizer)
        self.exp: Session | None = experiment
        self.methods: list[Method] = []
        self.done = 0
        self.tok_s: dict[str, list[float]] = {}

    # ---- set-up ----------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        cfg = self.cfg
        world = self.trainer.world_size
        if not cfg.runner.threads and world > 1 and self.trainer.strategy.root_device.type == "cpu":
            # Several ranks on one machine's cores: split them instead of oversubscribing.
            per_node = max(1, world // max(1, self.trainer.num_nodes))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
        model, tokenizer = self.__dict__["_given"]
        if model is None and self.exp is None:
            # Each rank on its own device (``cuda:r`` from the trainer; the user's flag was
            # validated already), ``--dtype auto`` resolved for it.
            root = self.trainer.strategy.root_device
            cfg = cfg.for_rank(str(root), dtype_name(resolve_dtype(cfg.model.dtype, root)))
        mine = self.shard()
        if self.exp is None:
            self.exp = Session(
                cfg,
                model,
                tokenizer,
                artifact_stem=self.out_path.with_suffix(""),
                log=self.log_fn,
                prompts=self.prompts,
            )
        self.methods = self._methods()
        self.model_dtype = dtype_name(self.exp.adapter.arch.dtype)  # the resolved dtype (``--dtype auto``)
        self.meta.setdefault("dtype_resolved", self.model_dtype)
        if "provenance" not in self.meta:  # one process per device: each rank loaded its own model
            self.meta["provenance"] = provenance(cfg.model.name_or_path, self.exp)
        if self.trainer.global_rank == 0:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            meta_path = self.out_path.with_suffix(".meta.json")
            if not (cfg.runner.resume and meta_path.exists()):  # a resumed run keeps its original metadata
                write_json(meta_path, self.meta)
                # `run.py --config <stem>.config.yaml` reproduces the run.
                self.cfg.save(self.out_path.with_suffix(".config.yaml"))
            exp = self.exp
            self.log_fn(
                f"[selfspec] {len(self.prompts)} prompts to decode on {world} process(es), {len(mine)} here | "
                f"model {exp.adapter.arch.info().name} ({self.model_dtype}, {exp.adapter.arch.device}) | {cfg.method.label}: "
                + " ".join(f"{k}={getattr(cfg.method, k).name}" for k in REGISTRIES)
                + f" | max_new_tokens={cfg.generation.max_new_tokens} | output {self.out_path}"
            )

    def _methods(self) -> list[Method]:
        """Vanilla decoding (the baseline), then the configured method unless ``baseline_only``."""
        greedy = self.exp.spec.verifier.lossless == "greedy"
        base = [Method("vanilla", self.exp.vanilla, "baseline", greedy)]
        return (
            base
            if self.cfg.method.baseline_only
            else base + [Method(self.cfg.method.label, self.exp.spec, "method", greedy)]
        )

    def shard(self) -> list[Prompt]:
        """This rank's prompts: every ``world``-th one, starting at the rank."""
        t = self.trainer
        return self.prompts[t.global_rank :: t.world_size]

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # a Prompt (text); the decoders put token ids on the model's device

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.shard(), batch_size=None, collate_fn=_identity, num_workers=0)

    def on_predict_start(self) -> None:
        """Warm-up decodes (short), then fresh strategy instances, so that timing starts warm."""
        cfg, exp = self.cfg, self.exp
        if not self.prompts:
            return
        n, seconds = exp.prepare_graphs(self.shard() or self.prompts)
        if n:
            self.log_fn(f"[selfspec] CUDA graphs: {n} recorded before timing ({seconds:.1f} s)")
        first, short = self.prompts[0], min(16, cfg.generation.max_new_tokens)
        warm_up(
            [m.decoder for m in self.methods],
            lambda dec: exp.decode_prompt(dec, first, max_new_tokens=short),
            repeats=cfg.runner.warmup,
        )
        if cfg.runner.warmup:
            exp.rebuild()
            self.methods = self._methods()
        self.t_start = time.perf_counter()

    # ---- one prompt --------------------------------------------------------------------------
    def predict_step(self, prompt: Prompt, batch_idx: int) -> list[dict[str, Any]]:
        exp, cfg, rank = self.exp, self.cfg, self.trainer.global_rank
        # Rotate which method goes first (the global prompt index over this rank's share), so
        # slow drift on a shared machine hits every method alike.
        turn = batch_idx * self.trainer.world_size + rank
        cmp = next(
            compare_methods(
                self.methods,
                [prompt],
                lambda m, p: exp.decode_prompt(m.decoder, p),
                explain=explain_with(exp),
                start_turn=turn,
            )
        )
        strategies = {kind: getattr(cfg.method, kind).describe() for kind in REGISTRIES}
        recs = [
            cmp.record(m.label, rank=rank, **({} if m.kind == "baseline" else {"strategies": strategies}))
            for m in self.methods
        ]
        for rec in recs:
            self.tok_s.setdefault(rec["method"], []).append(rec["new_tokens"] / max(rec["wall_time"], 1e-9))
        self.done += 1
        return recs

    def running_speedup(self) -> float | None:
        """Mean tokens/s of the method over mean tokens/s of vanilla, prompts done on this rank."""
        van = self.tok_s.get("vanilla")
        spec = self.tok_s.get(self.cfg.method.label)
        if not van or not spec or self.cfg.method.baseline_only:
            return None
        return (sum(spec) / len(spec)) / (sum(van) / len(van))


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append one prompt's records as JSON lines in a single locked, flushed write."""
    data = "".join(json.dumps(r) + "\n" for r in records)
    with path.open("a", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            fh.write(data)
            fh.flush()
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class ResultsWriter(BasePredictionWriter):
    """Appends each prompt's records to the results JSONL as soon as the prompt is done."""

    def __init__(self, path: Path) -> None:
        super().__init__(write_interval="batch")
        self.path = path

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        append_records(self.path, prediction)


def progress_line(i: int, n: int, prompt: Prompt, recs: list[dict[str, Any]]) -> str:
    parts = []
    for r in recs:
        part = f"{r['method']} {r['new_tokens'] / max(r['wall_time'], 1e-9):.1f} tok/s"
        if r["method"] != "vanilla":
            m = sum(r["accept_lengths"]) / max(1, len(r["accept_lengths"]))
            ok = "yes" if r["lossless"] else "NO"
            if r["lossless"] is None:
                ok = (
                    "n/a (synthetic: not the model's)"
                    if r.get("synthetic_acceptance") is not None
                    else "n/a (sampling)"
                )
            part += f", M {m:.2f}, lossless {ok}"
        parts.append(part)
    return f"[{i}/{n}] {prompt.category:<14} q{prompt.question_id}: " + ", ".join(parts)


class SpeedupProgressBar(TQDMProgressBar):
    """Lightning's bar with the method's tokens/s and the running speedup, plus one line per prompt."""

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        bar = self.predict_progress_bar
        if bar is None:
            return
        spec = outputs[-1]
        post = {"tok/s": f"{spec['new_tokens'] / max(spec['wall_time'], 1e-9):.1f}"}
        speed = pl_module.running_speedup()
        if speed is not None:
            post["speedup"] = f"{speed:.3f}x"
        bar.set_postfix(post, refresh=False)
        bar.write(progress_line(pl_module.done, len(pl_module.shard()), batch, outputs))


class PlainProgress(pl.Callback):
    """One line per prompt through the run's ``log`` function (no terminal, or tests)."""

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        line = progress_line(pl_module.done, len(pl_module.shard()), batch, outputs)
        speed = pl_module.running_speedup()
        if speed is not None:
            line += f" | running speedup {speed:.3f}x"
        pl_module.log_fn(line)
