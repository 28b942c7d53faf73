"""Results records: the JSON lines a run (and a benchmark) writes, reading them back, and the
state a ``--resume`` continues from.

One record is one prompt decoded by one method (`prompt_record`, the one format of the runner
and the benchmark, with optional fields), with one `turn_record` per turn. Records are appended as soon as a prompt is done; `read_records` tolerates the torn last
line of a killed run and `resume_state` finds the prompts already complete in a file written by
the same configuration.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from framework.config_fields import ConfigError
from framework.data.prompts import Prompt
from framework.drafting.gate import GateConfig
from framework.engine.decoding import GenerationResult
from framework.session.run_config import RunConfig
from framework.session.sections import BASELINE

#: Fields a record carries only when its writer sets them (`prompt_record`): ``position`` (the
#: method's place in the prompt's rotated order), ``repeat`` and ``kind`` (the benchmark),
#: ``strategies`` (each strategy's name and config) and ``rank`` (the runner's process).
OPTIONAL_FIELDS = frozenset({"position", "repeat", "kind", "strategies", "rank"})

#: RunConfig fields that may differ between a run and its ``--resume``: they change how or where
#: prompts are decoded and logged, or which prompts are in the set, never a prompt's result.
RESUMABLE_FIELDS = frozenset(
    {
        "output",
        "specbench_answers",
        "resume",
        "warmup",
        "threads",
        "devices",
        "num_nodes",
        "logger",
        "plots",
        "wandb_project",
        "limit",
        "offset",
        "categories",
        "command",
        "cost_model",
    }
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
        "graph_captures": res.graph_captures,
        "capture_seconds": res.capture_seconds,
        "strategy_summary": res.strategy_summary,
        "prompt_tokens": res.prompt_tokens,
    }


def prompt_record(
    prompt: Prompt,
    name: str,
    results: list[tuple[GenerationResult, str]],
    lossless: bool | None,
    first_mismatch: dict[str, Any] | None = None,
    **optional: Any,
) -> dict[str, Any]:
    """The one results record (a JSONL line of a run and of a benchmark): ``prompt`` decoded by
    the method ``name`` (all turns, as ``(result, text)``).

    Args:
        prompt: the prompt.
        name: the method's label.
        results: its turns.
        lossless: the check against the baseline (``None`` where it does not apply: sampling).
        first_mismatch: where a greedy method first differs from the baseline, with the target's
            top-1/top-2 logit margin there (`framework.results.compare.mismatch_details`; ``None``:
            no mismatch).
        **optional: fields some writers add, in `OPTIONAL_FIELDS` (``position`` in the rotation,
            the benchmark's ``repeat`` and ``kind``, the runner's ``strategies`` and ``rank``).

    Raises:
        ValueError: an optional field that is not in `OPTIONAL_FIELDS`.
    """
    unknown = sorted(set(optional) - OPTIONAL_FIELDS)
    if unknown:
        raise ValueError(f"unknown record fields {unknown}; optional fields are {sorted(OPTIONAL_FIELDS)}")
    new_tokens = sum(r.new_tokens for r, _ in results)
    wall = sum(r.wall_time for r, _ in results)
    keys = sorted({k for r, _ in results for k in r.timings})
    return {
        "question_id": prompt.question_id,
        "category": prompt.category,
        "subcategory": prompt.subcategory,
        "method": name,
        **{k: optional[k] for k in ("repeat", "position", "kind") if k in optional},
        "turns": [turn_record(r, t) for r, t in results],
        "new_tokens": new_tokens,
        "wall_time": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
        "accept_lengths": [a for r, _ in results for a in r.accept_lengths],
        "drafted": sum(r.drafted for r, _ in results),
        "accepted": sum(r.accepted for r, _ in results),
        "timings": {k: sum(r.timings.get(k, 0.0) for r, _ in results) for k in keys},
        "lossless": lossless,
        "first_mismatch": first_mismatch,
        **({"synthetic_acceptance": synth} if (synth := _synthetic(results)) is not None else {}),
        **{k: optional[k] for k in ("strategies", "rank") if k in optional},
    }


def _synthetic(results: list[tuple[GenerationResult, str]]) -> float | None:
    """The forced acceptance of a synthetic-acceptance method's turns, or ``None``."""
    return next((r.synthetic for r, _ in results if getattr(r, "synthetic", None) is not None), None)


def prompt_key(rec_or_prompt: Prompt | dict[str, Any]) -> tuple[str, str]:
    """The identity of a prompt in a results file: ``(category, question_id)`` as strings."""
    if isinstance(rec_or_prompt, Prompt):
        return rec_or_prompt.category, str(rec_or_prompt.question_id)
    return rec_or_prompt["category"], str(rec_or_prompt["question_id"])


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a results JSONL, or of a run's folder (its ``records.jsonl``); a torn last
    line from a killed run is ignored. A record ``run.py`` wrote before the one pipeline (issue 48)
    reads with ``repeat`` 0 and its ``kind`` (``baseline`` for vanilla, else ``preset``).

    Raises:
        ConfigError: a line other than the last is not JSON (not a results file).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "records.jsonl"
    if not path.exists():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ConfigError("--output", str(path), f"a results JSONL (line {i + 1} is not JSON)") from None
        rec.setdefault("repeat", 0)
        rec.setdefault("kind", "baseline" if rec.get("method") == BASELINE else "preset")
        out.append(rec)
    return out


def repair_tail(path: Path, log: Callable[[str], None]) -> None:
    """Cut a torn last line (a run killed mid-write) so that appended records start on a fresh line."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    path.write_bytes(data[:cut])
    log(
        f"[selfspec] {path}: dropped an incomplete last line ({len(data) - cut} bytes) left by an interrupted run"
    )


#: Fields a results file written before them lacks, and the value that means what it did then.
_NEUTRAL_SINCE: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "min_new_tokens": 0,
    "bad_words": [],
    "suppress_tokens": [],
    "begin_suppress_tokens": [],
    "eos_token_ids": [],
    "json_schema": None,
    "regex": None,
    "grammar": None,
    "synthetic_acceptance": None,
    "imports": [],
    # the compare section (issue 48): a results file from before it compared vanilla and its method
    "methods": [],
    "raw": False,
    "repeats": 1,
    "preset_args": [],
    "skip_set": None,
    "prompt_lookup_num_tokens": 10,
    "max_matching_ngram_size": None,
    "early_exit_layer": None,
    "hf_kernels": False,
}


def config_differences(old: dict[str, Any], cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The fields (outside `RESUMABLE_FIELDS`) in which the metadata config ``old`` of a results
    file differs from ``cfg``, each with its value there and here. A file from before the draft
    gate existed had it off; one from before ``exact`` was a boolean wrote it as auto/on/off
    (unset, true, false); one from before the generation section's processors, grammars and
    synthetic acceptance (issue 47) or the recorded ``--import`` modules (issue 48) had them at
    their neutral values."""
    old = dict(old)
    old.setdefault("gate", dataclasses.asdict(GateConfig()))
    for key, neutral in _NEUTRAL_SINCE.items():
        old.setdefault(key, neutral)
    if isinstance(old.get("exact"), str):
        old["exact"] = {"auto": None, "on": True, "off": False}.get(old["exact"], old["exact"])
    new = json.loads(json.dumps(cfg.describe(), default=str))
    keys = sorted(k for k in set(old) | set(new) if k not in RESUMABLE_FIELDS and old.get(k) != new.get(k))
    return {k: (old.get(k), new.get(k)) for k in keys}


def resume_state(
    cfg: RunConfig,
    out_path: Path,
    methods: list[str],
    log: Callable[[str], None],
    meta_path: Path | None = None,
    *,
    repair: bool = True,
) -> set[tuple[int, str, str]]:
    """``(repeat, category, question_id)`` of the prompts already complete in ``out_path`` (every
    method recorded), after checking that the file was written by the same configuration (its
    metadata: ``meta_path``, default ``<output>.meta.json``). With ``repair`` (one process of a
    run: rank 0) the file loses a torn last line and the records of prompts that only some methods
    recorded (a kill in the middle of a prompt's write), which are decoded again.

    Raises:
        ConfigError: no ``--output``, no metadata next to the file, or a different configuration.
    """
    if cfg.runner.output is None:
        raise ConfigError("--output", None, "the run folder to continue when --resume is given")
    if not out_path.exists():
        return set()
    meta_path = meta_path or out_path.with_suffix(".meta.json")
    if not meta_path.exists():
        raise ConfigError(
            "--resume",
            str(out_path),
            f"a run folder written by run.py or bench.py (its metadata {meta_path.name} is missing)",
        )
    old = json.loads(meta_path.read_text()).get("config", {})
    diff = config_differences(old, cfg)
    if diff:
        detail = "; ".join(f"{k}: file {was!r}, now {now!r}" for k, (was, now) in diff.items())
        raise ConfigError(
            "--resume",
            str(out_path),
            f"a results file from the same configuration (it differs in {detail}); "
            "resume with the original flags or write to a new --output",
        )
    if repair:
        repair_tail(out_path, log)
    records = read_records(out_path)
    seen: dict[tuple[int, str, str], set[str]] = {}
    for rec in records:
        seen.setdefault(_item_key(rec), set()).add(rec["method"])
    done = {k for k, got in seen.items() if set(methods) <= got}
    partial = [rec for rec in records if _item_key(rec) not in done]
    if partial and repair:  # decoded again with every method: their earlier records would count twice
        drop_records(out_path, lambda rec: _item_key(rec) not in done)
        log(
            f"[selfspec] {out_path}: dropped {len(partial)} record(s) of "
            f"{len({_item_key(r) for r in partial})} prompt(s) that only some methods recorded "
            "(a run stopped mid-write); they are decoded again"
        )
    return done


def _item_key(rec: dict[str, Any]) -> tuple[int, str, str]:
    """``(repeat, category, question_id)``: one decoded item of a results file."""
    return (rec.get("repeat", 0), *prompt_key(rec))


def drop_records(path: Path, drop: Callable[[dict[str, Any]], bool]) -> None:
    """Rewrite a results JSONL without the records ``drop`` names (the lines kept byte for byte;
    the new file replaces the old one whole, so an interruption leaves one or the other)."""
    path = Path(path)
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            kept.append(line)
            continue
        rec.setdefault("repeat", 0)
        if not drop(rec):
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
