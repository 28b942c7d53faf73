"""The experiment runner: decode every prompt with vanilla and speculative decoding, interleaved.

``run(cfg)`` validates everything it can before writing anything (strategy configs, skip sets
against the model, the data, prompt lengths), warms both decoders up, then for each prompt decodes
all turns with both methods (alternating which goes first, so slow drift on a shared machine hits
both equally), checks the speculative tokens against vanilla, and appends one JSON line per prompt
and method to the output file, flushed at once: an interrupted run keeps every finished prompt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from framework.config import ConfigError, check_range, param
from framework.data import Prompt, encode_chat, load_prompts, stop_token_ids
from framework.decoding import GenerationResult, SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.interfaces import PrepareContext
from framework.metrics import results_table, time_breakdown
from framework.model_adapter import ModelAdapter, adapter_for
from framework.registry import REGISTRIES, load_builtin_strategies


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

    def __post_init__(self) -> None:
        check_range("--max-new-tokens", self.max_new_tokens, 1, integer=True)
        check_range("--warmup", self.warmup, 0, integer=True)
        if self.limit is not None:
            check_range("--limit", self.limit, 1, integer=True)
        if self.threads is not None:
            check_range("--threads", self.threads, 1, integer=True)
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


def _turn_record(res: GenerationResult, text: str) -> dict[str, Any]:
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
        "timings": res.timings,
        "target_forwards": res.target_forwards,
        "draft_forwards": res.draft_forwards,
        "strategy_summary": res.strategy_summary,
    }


def _prompt_record(prompt: Prompt, name: str, results: list, lossless: bool | None) -> dict[str, Any]:
    """One JSONL line: a prompt decoded by one method (all turns)."""
    return {
        "question_id": prompt.question_id,
        "category": prompt.category,
        "subcategory": prompt.subcategory,
        "method": name,
        "turns": [_turn_record(r, t) for r, t in results],
        "new_tokens": sum(r.new_tokens for r, _ in results),
        "wall_time": sum(r.wall_time for r, _ in results),
        "accept_lengths": [a for r, _ in results for a in r.accept_lengths],
        "drafted": sum(r.drafted for r, _ in results),
        "accepted": sum(r.accepted for r, _ in results),
        "timings": {k: sum(r.timings.get(k, 0.0) for r, _ in results) for k in results[0][0].timings},
        "lossless": lossless,
    }


def _progress_line(i: int, n: int, prompt: Prompt, recs: list[dict[str, Any]]) -> str:
    parts = []
    for r in recs:
        part = f"{r['method']} {r['new_tokens'] / r['wall_time']:.1f} tok/s"
        if r["method"] != "vanilla":
            m = sum(r["accept_lengths"]) / max(1, len(r["accept_lengths"]))
            ok = "n/a (sampling)" if r["lossless"] is None else "yes" if r["lossless"] else "NO"
            part += f", M {m:.2f}, lossless {ok}"
        parts.append(part)
    return f"[{i + 1}/{n}] {prompt.category:<14} q{prompt.question_id}: " + ", ".join(parts)


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
            from framework.models import load_model

            model, tokenizer = load_model(cfg.model, cfg.dtype, cfg.device)
        self.model, self.tokenizer = model, tokenizer
        self.adapter = adapter_for(model)
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


def run(
    cfg: RunConfig, log: Callable[[str], None] = print, model: Any = None, tokenizer: Any = None
) -> dict[str, Any]:
    """Run one experiment; returns ``{"output", "table", "breakdown", "records"}``.

    Raises:
        ConfigError, DataError, ModelLoadError, UnknownNameError: bad input, before anything is
            written.
    """
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    prompts = load_prompts(cfg.data, cfg.categories or None, cfg.limit)
    out_path = Path(cfg.output) if cfg.output else default_output(cfg)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    exp = Experiment(cfg, model, tokenizer, artifact_stem=out_path.with_suffix(""), log=log, prompts=prompts)
    method = cfg.method_name
    meta = {"config": cfg.describe(), "environment": environment(), "method": method, "started": time.time()}
    out_path.with_suffix(".meta.json").write_text(json.dumps(meta, indent=2, default=str))

    log(
        f"[selfspec] {len(prompts)} prompts | model {exp.adapter.info().name} ({cfg.dtype}, {exp.adapter.device}) | "
        f"{method}: selector={cfg.selector.name} length={cfg.length.name} drafter={cfg.drafter.name} "
        f"verifier={cfg.verifier.name} | max_new_tokens={cfg.max_new_tokens} | output {out_path}"
    )
    methods = [("vanilla", exp.vanilla)] + ([] if cfg.baseline_only else [(method, exp.spec)])
    for _ in range(cfg.warmup):
        for _name, dec in methods:
            exp.decode_prompt(dec, prompts[0], max_new_tokens=min(16, cfg.max_new_tokens))
    if cfg.warmup:
        exp.rebuild()
        methods = [("vanilla", exp.vanilla)] + ([] if cfg.baseline_only else [(method, exp.spec)])

    # Token equality is the lossless check for greedy verifiers only; speculative sampling is
    # lossless in distribution (tested statistically), so its records carry None.
    greedy = exp.spec.verifier.lossless == "greedy"
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with out_path.open("a", encoding="utf-8") as fh:
        for i, prompt in enumerate(prompts):
            order = methods if i % 2 == 0 else methods[::-1]
            turns = {name: exp.decode_prompt(dec, prompt) for name, dec in order}
            van_tokens = [r.tokens for r, _ in turns["vanilla"]]
            for name, _dec in methods:
                same = [r.tokens for r, _ in turns[name]] == van_tokens
                rec = _prompt_record(prompt, name, turns[name], same if greedy else None)
                if name != "vanilla":
                    rec["strategies"] = {kind: getattr(cfg, kind).describe() for kind in REGISTRIES}
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                records.append(rec)
            log(_progress_line(i, len(prompts), prompt, records[-len(methods) :]))
    table = results_table(records, method)
    breakdown = time_breakdown(records, [name for name, _ in methods])
    title = "vanilla (baseline only)" if cfg.baseline_only else f"{method} vs vanilla"
    report = (
        f"## {title}\n\n{table}\n\nWhere the time goes (share of wall time):\n\n{breakdown}\n\n"
        f"{len(prompts)} prompts in {time.perf_counter() - t_start:.0f} s; results: {out_path}\n"
    )
    out_path.with_suffix(".md").write_text(report)
    log("\n" + report)
    return {"output": str(out_path), "table": table, "breakdown": breakdown, "records": records}


def print_error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
