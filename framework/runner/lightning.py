"""The run as a PyTorch Lightning predict loop: one predict step per prompt (and repeat).

`DecodeModule.predict_step` decodes one prompt with every method of the run in rotated order
(`framework.results.compare.compare_methods`: slow drift on a shared machine hits every method
alike), checks each against vanilla and returns the prompt's records. Lightning supplies the device
placement, the process group when ``--devices``/``--num-nodes`` > 1 (each rank decodes its own
share: ``prompts[rank::world]``), the progress bar and the loggers; the callbacks here write and
log the records as they come:

- `ResultsWriter` appends each prompt's records to the JSONL results (one locked, flushed write per
  prompt: several ranks share one file, and an interruption loses nothing);
- `SpeedupProgressBar` / `PlainProgress` show one line per prompt and the running speedup;
- `framework.runner.tracking.TrackingCallback` sends per-prompt metrics to the logger.

The model is loaded in ``setup`` on each rank's own device (or given) and is deliberately not a
registered sub-module: Lightning never wraps, moves or trains it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter, TQDMProgressBar
from torch.utils.data import DataLoader

from framework.benchmark.hf import HFGenerateDecoder
from framework.benchmark.load import LoadMonitor
from framework.data.prompts import Prompt
from framework.engine.context import PreparedCache
from framework.engine.decoding import SpeculativeDecoder
from framework.interfaces import REGISTRIES
from framework.models.loading import DEFAULT_MODEL, dtype_name, load_model, resolve_dtype
from framework.results.compare import Method, compare_methods, explain_with, warm_up
from framework.results.metrics import speedup
from framework.session.methods import BASELINE, MethodSpec, preset_run_config
from framework.session.run_config import RunConfig
from framework.session.session import Session
from framework.testing.host_work import HostWorkReport, counted

#: Warm-up generations are this many tokens long (at most ``max_new_tokens``).
WARMUP_TOKENS = 16


@dataclass
class Methods:
    """Every method of a run, loaded: each one's session and decoder. A preset's decoder is
    rebuilt for every repeat; an HF method that fails is left out from then on (``errors``)."""

    specs: list[MethodSpec]
    #: the session of the baseline, the HF and the custom methods (run.py: the method's own)
    base: Session
    sessions: dict[str, Session]
    decoders: dict[str, Any]
    log: Callable[[str], None]
    errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(
        cls,
        cfg: RunConfig,
        specs: list[MethodSpec],
        model: Any,
        tokenizer: Any,
        *,
        stem: Callable[[str], Path],
        log: Callable[[str], None],
        prompts: list[Prompt],
        custom: dict[str, Any] | None = None,
    ) -> Methods:
        """Load the model (unless given) and build every method's session and decoder, sharing one
        preparation cache (an offline search, the cost model and the token ranking, once).
        ``stem(label)``: where a method keeps its artefacts (a search's skip set)."""
        if model is None:
            m = cfg.model
            log(
                f"[selfspec] loading {m.name_or_path or DEFAULT_MODEL} (dtype {m.dtype}, device {m.device}) ..."
            )
            model, tokenizer = load_model(m.name_or_path, m.dtype, m.device, m.device_map)
        prepared = PreparedCache()
        alone = not cfg.compare.methods  # run.py: the method's session decodes vanilla too
        base_cfg = cfg if alone else cfg.replace(baseline_only=True)
        stem0 = stem(cfg.method.label) if alone else None
        base = Session(
            base_cfg, model, tokenizer, artifact_stem=stem0, log=log, prompts=prompts, prepared=prepared
        )
        out = cls(specs, base, {}, {}, log)
        cmp = cfg.compare
        for s in specs:
            out.sessions[s.label] = base
            if s.kind == "baseline":
                out.decoders[s.label] = base.vanilla
            elif s.kind == "hf":
                out.decoders[s.label] = HFGenerateDecoder(
                    model,
                    s.label,
                    prompt_lookup_num_tokens=cmp.prompt_lookup_num_tokens,
                    max_matching_ngram_size=cmp.max_matching_ngram_size,
                    early_exit_layer=cmp.early_exit_layer,
                    kernels=cmp.hf_kernels,
                )
            elif s.kind == "custom":
                out.decoders[s.label] = (custom or {})[s.label]
            elif alone:
                out.decoders[s.label] = base.spec
            else:
                log(f"[selfspec] preparing {s.label} ...")
                session = Session(
                    preset_run_config(s, cfg),
                    model,
                    tokenizer,
                    artifact_stem=stem(s.label),
                    log=log,
                    prepared=prepared,
                )
                out.sessions[s.label], out.decoders[s.label] = session, session.spec
        return out

    @property
    def model(self) -> Any:
        return self.base.model

    @property
    def prepared(self) -> PreparedCache:
        return self.base.prepare_ctx.prepared

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
            self.log(f"[selfspec] {s.label} failed and is left out from now on: {self.errors[s.label]}")
            return None

    def rebuild(self) -> None:
        """Fresh strategy state for every preset method (an offline search is reused)."""
        for s in self.specs:
            if s.kind == "preset":
                session = self.sessions[s.label]
                session.rebuild()
                self.decoders[s.label] = session.spec
        self.decoders[BASELINE] = self.base.vanilla  # rebuilt with its session (run.py's: the method's)

    def unique_sessions(self) -> list[Session]:
        return list({id(e): e for e in self.sessions.values()}.values())

    def notes(self) -> dict[str, list[str]]:
        """What each method cannot do as configured (`Session.notes`), by label."""
        return {label: e.notes for label, e in self.sessions.items() if e.notes and label != BASELINE}

    def settings(self) -> dict[str, Any]:
        """Each method's resolved strategies and gate, and the HF methods' settings."""
        out: dict[str, Any] = {}
        for s in self.specs:
            if s.kind == "hf":
                out[s.label] = self.decoders[s.label].describe()
            elif s.kind != "custom":
                session = self.sessions[s.label]
                out[s.label] = (
                    {"baseline_only": True} if s.kind == "baseline" else session.cfg.method.settings()
                )
        return out


def _identity(x: Any) -> Any:
    return x


class DecodeModule(pl.LightningModule):
    """Decodes each prompt with every method of the run; one predict step per prompt and repeat.

    Args:
        cfg: the run configuration.
        specs: the run's methods, vanilla first.
        items: ``(repeat, prompt)`` still to decode (``--resume`` left out the finished ones).
        stem: where each method keeps its artefacts, by label.
        log: where progress lines go when no progress bar is shown.
        methods: the methods, loaded before the trainer (one process); loaded in ``setup`` otherwise.
        model: given to `Methods.load` in ``setup``.
        tokenizer: given to `Methods.load` in ``setup``.
        custom: given to `Methods.load` in ``setup``.
        on_setup: called on every rank once its methods are loaded (rank 0 writes the metadata).
    """

    def __init__(
        self,
        cfg: RunConfig,
        specs: list[MethodSpec],
        items: list[tuple[int, Prompt]],
        stem: Callable[[str], Path],
        log: Callable[[str], None] = print,
        methods: Methods | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        custom: dict[str, Any] | None = None,
        on_setup: Callable[[DecodeModule], None] | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.specs, self.items, self.stem, self.log_fn = cfg, specs, items, stem, log
        # Kept out of nn.Module registration: Lightning must not move or wrap the HF model.
        self.__dict__["_given"] = (model, tokenizer, custom or {}, on_setup)
        self.__dict__["methods"] = methods
        self.done, self.repeat = 0, -1
        self.tok_s: dict[str, list[float]] = {}
        self.load: dict[str, Any] = {}
        self.reported: set[str] = set()  # the failed HF methods whose error is recorded
        self.graphs: tuple[int, float] | None = None
        self.elapsed = 0.0
        #: each speculative method's host work a round, counted in its first warm-up decode
        self.host_work: dict[str, HostWorkReport] = {}

    @property
    def prompts(self) -> list[Prompt]:
        seen: dict[tuple[str, str], Prompt] = {}
        for _, p in self.items:
            seen.setdefault((p.category, str(p.question_id)), p)
        return list(seen.values())

    def setup(self, stage: str) -> None:
        cfg, world = self.cfg, self.trainer.world_size
        model, tokenizer, custom, on_setup = self.__dict__["_given"]
        if not cfg.runner.threads and world > 1 and self.trainer.strategy.root_device.type == "cpu":
            # Several ranks on one machine's cores: split them instead of oversubscribing.
            per_node = max(1, world // max(1, self.trainer.num_nodes))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
        if self.methods is None:
            if model is None:  # each rank on its own device, ``--dtype auto`` resolved for it
                root = self.trainer.strategy.root_device
                cfg = cfg.for_rank(str(root), dtype_name(resolve_dtype(cfg.model.dtype, root)))
            self.__dict__["methods"] = Methods.load(
                cfg,
                self.specs,
                model,
                tokenizer,
                stem=self.stem,
                log=self.log_fn,
                prompts=self.prompts,
                custom=custom,
            )
        if on_setup is not None:
            on_setup(self)

    @property
    def methods(self) -> Methods:
        return self.__dict__["methods"]

    def shard(self) -> list[tuple[int, Prompt]]:
        """This rank's items: every ``world``-th one, starting at the rank."""
        t = self.trainer
        return self.items[t.global_rank :: t.world_size]

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch  # (repeat, Prompt); the decoders put token ids on the model's device

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.shard(), batch_size=None, collate_fn=_identity, num_workers=0)

    def on_predict_start(self) -> None:
        """Record the CUDA graphs, warm every method up (short decodes), then start the load monitor."""
        if not self.items:
            return
        ms, prompts = self.methods, self.prompts
        recorded = (
            [e.prepare_graphs(prompts) for e in ms.unique_sessions()] if self.cfg.model.cuda_graphs else []
        )
        self.graphs = (sum(n for n, _ in recorded), sum(t for _, t in recorded)) if recorded else None
        if self.graphs and self.graphs[0]:
            self.log_fn(
                f"[selfspec] CUDA graphs: {self.graphs[0]} recorded before timing ({self.graphs[1]:.1f} s)"
            )
        short = min(WARMUP_TOKENS, self.cfg.generation.max_new_tokens)
        if self.cfg.runner.warmup:
            self.log_fn(
                f"[selfspec] warming up {len(ms.specs)} method(s): {self.cfg.runner.warmup} generation(s) of "
                f"{short} tokens each, not timed ..."
            )
        warm_up(
            ms.specs, self._counted_once(lambda s: ms.decode(s, prompts[0], short)), self.cfg.runner.warmup
        )
        self.log_fn(f"[selfspec] decoding {len(self.shard())} prompt(s), timed; a line per prompt ...")
        self.monitor = LoadMonitor().start()  # what other processes did to the machine while timed
        self.t_start = time.perf_counter()

    def _counted_once(self, decode: Callable[[MethodSpec], Any]) -> Callable[[MethodSpec], Any]:
        """``decode``, with the host work of each speculative method's first warm-up decode counted
        into `host_work` (the counting slows what it counts, so nothing timed is counted)."""

        def call(s: MethodSpec) -> Any:
            if s.label in self.host_work or not isinstance(
                self.methods.decoders[s.label], SpeculativeDecoder
            ):
                return decode(s)
            out, self.host_work[s.label] = counted(lambda: decode(s))
            return out

        return call

    def on_predict_end(self) -> None:
        if self.items:
            self.load = self.monitor.stop()
            self.elapsed = time.perf_counter() - self.t_start

    def predict_step(self, item: tuple[int, Prompt], batch_idx: int) -> list[dict[str, Any]]:
        rep, prompt = item
        ms, rank = self.methods, self.trainer.global_rank
        if rep != self.repeat:  # every repeat (the first after the warm-up) starts from fresh strategies
            ms.rebuild()
            self.repeat = rep
        by_label = {s.label: s for s in ms.specs}
        greedy = ms.base.spec.verifier.lossless == "greedy"
        cmp = next(
            compare_methods(
                [Method(s.label, ms.decoders[s.label], s.kind, greedy) for s in ms.specs],
                [prompt],
                lambda m, p: ms.decode(by_label[m.label], p),
                explain=explain_with(ms.base),
                start_turn=batch_idx * self.trainer.world_size + rank,
                baseline=BASELINE,
            )
        )
        recs = []
        for s in ms.specs:
            if s.label in cmp.results:
                extra = {"strategies": _strategies(ms.sessions[s.label])} if s.kind == "preset" else {}
                recs.append(cmp.record(s.label, repeat=rep, kind=s.kind, rank=rank, **extra))
            elif s.label in ms.errors and s.label not in self.reported:  # an HF method's failure, once
                self.reported.add(s.label)
                error = {"repeat": rep, "question_id": prompt.question_id, "category": prompt.category}
                recs.append({**error, "method": s.label, "error": ms.errors[s.label]})
        for rec in recs:
            if not rec.get("error"):
                self.tok_s.setdefault(rec["method"], []).append(
                    rec["new_tokens"] / max(rec["wall_time"], 1e-9)
                )
        self.done += 1
        return recs

    def running_speedup(self) -> float | None:
        """Mean tokens/s of the (first) method over mean tokens/s of vanilla, on this rank."""
        van = self.tok_s.get(BASELINE)
        spec = next((self.tok_s.get(s.label) for s in self.specs if s.kind != "baseline"), None)
        if not van or not spec:
            return None
        return speedup(spec, van)


def _strategies(session: Session) -> dict[str, Any]:
    return {kind: getattr(session.cfg.method, kind).describe() for kind in REGISTRIES}


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append one prompt's records as JSON lines in a single locked, flushed write."""
    data = "".join(json.dumps(r, default=str) + "\n" for r in records)
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


def progress_line(
    i: int, n: int, item: tuple[int, Prompt], recs: list[dict[str, Any]], repeats: int = 1
) -> str:
    """One prompt's line: each method's tokens/s, and for the speculative ones M and the check."""
    rep, prompt = item
    parts = []
    for r in recs:
        if r.get("error"):
            parts.append(f"{r['method']} failed")
            continue
        part = f"{r['method']} {r['new_tokens'] / max(r['wall_time'], 1e-9):.1f} tok/s"
        if r["method"] != BASELINE and r.get("kind") != "hf":
            m = sum(r["accept_lengths"]) / max(1, len(r["accept_lengths"]))
            ok = "yes" if r["lossless"] else "NO"
            if r["lossless"] is None:
                synthetic = r.get("synthetic_acceptance") is not None
                ok = "n/a (synthetic: not the model's)" if synthetic else "n/a (sampling)"
            part += f", M {m:.2f}, lossless {ok}"
        elif r.get("lossless") is False:
            part += " MISMATCH"
        parts.append(part)
    rtag = f" r{rep + 1}" if repeats > 1 else ""
    return f"[{i}/{n}{rtag}] {prompt.category:<14} q{prompt.question_id}: " + ", ".join(parts)


class SpeedupProgressBar(TQDMProgressBar):
    """Lightning's bar with the method's tokens/s and the running speedup, plus one line per prompt."""

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        bar = self.predict_progress_bar
        if bar is None:
            return
        speed = pl_module.running_speedup()
        if speed is not None:
            bar.set_postfix({"speedup": f"{speed:.3f}x"}, refresh=False)
        reps = pl_module.cfg.compare.repeats
        bar.write(progress_line(pl_module.done, len(pl_module.shard()), batch, outputs, reps))


class PlainProgress(pl.Callback):
    """One line per prompt through the run's ``log`` function (no terminal, or tests)."""

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        reps = pl_module.cfg.compare.repeats
        line = progress_line(pl_module.done, len(pl_module.shard()), batch, outputs, reps)
        speed = pl_module.running_speedup()
        if speed is not None:
            line += f" | running speedup {speed:.3f}x"
        pl_module.log_fn(line)


__all__ = [
    "DecodeModule",
    "Methods",
    "PlainProgress",
    "ResultsWriter",
    "SpeedupProgressBar",
    "append_records",
    "progress_line",
]
