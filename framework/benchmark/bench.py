"""A Spec-Bench-style benchmark: many methods, one model load, one interleaved run.

``python experiments/bench.py --methods vanilla,hf_generate,hf_prompt_lookup,hf_early_exit,clasp``

Protocol (after Spec-Bench, Xia et al., 2024): greedy decoding, batch size 1, the same prompts and
chat-template encoding for every method, warm-up generations before timing, and

- **speedup** of a method in a category = mean tokens/s of the method / mean tokens/s of the
  vanilla baseline over the category's prompts (ratio of means; tokens/s of a prompt = new tokens of
  all its turns / their wall time), and the same over all prompts for ``overall``;
- **M** (mean accepted tokens) = tokens committed per verification round, bonus token included;
- **mismatches** = prompts whose tokens differ from the vanilla greedy output in any turn.

Every prompt is decoded by every method back to back, the order of the methods rotating from one
prompt to the next, so that slow drift of a shared machine hits all of them alike. With
``--repeats N`` the whole run is repeated; each cell is then the mean over repeats of that repeat's
ratio of means, and the spread column gives the standard deviation and range of the overall speedup.

Methods:

- ``vanilla``: our autoregressive greedy baseline (always run; the denominator of every speedup);
- ``hf_generate``: Hugging Face ``model.generate`` greedy;
- ``hf_prompt_lookup``: ``generate`` with ``prompt_lookup_num_tokens`` (prompt lookup decoding);
- ``hf_early_exit``: ``generate`` with ``assistant_early_exit`` (HF's self-speculation: the first E
  layers of the model draft);
- any preset (``framework.experiment.presets.list_presets()``) or preset YAML file.

The Hugging Face methods get the same input ids (`framework.experiment.data.encode_chat`), ``max_new_tokens``
and EOS ids as our decoders, ``do_sample=False``, and a neutral generation config (no repetition
penalty, no n-gram blocking, no forced or suppressed tokens: the model's own
``generation_config`` is swapped out for the call). Their new tokens are cut by the same
`StopCondition` as ours. An error in a Hugging Face method is reported in its table row; the other
methods go on.

Outputs in ``--out DIR``: ``records.jsonl`` (one line per prompt, method and repeat, flushed as
soon as the prompt is done), ``bench.md`` (machine, versions, command and the tables), ``meta.json``,
``cost_model.json`` (reusable with ``--cost-model``) and PNG plots (`framework.experiment.plots`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from framework.config import ConfigError, check_range, param
from framework.engine.decoding import GenerationResult, StopCondition
from framework.experiment.data import Prompt, load_prompts
from framework.experiment.metrics import aggregate, cost_model_prediction, rounds_prediction
from framework.experiment.runner import turn_record
from framework.kernels import cpu as fast_kernels

BASELINE = "vanilla"
#: The Hugging Face ``generate`` methods and what they run.
HF_METHODS: dict[str, str] = {
    "hf_generate": "transformers model.generate, greedy",
    "hf_prompt_lookup": "model.generate with prompt_lookup_num_tokens (prompt lookup decoding)",
    "hf_early_exit": "model.generate with assistant_early_exit (the first E layers draft)",
}
DEFAULT_METHODS = ("vanilla", "hf_generate", "hf_prompt_lookup", "hf_early_exit", "static_confidence")
#: At most this many rounds (of the first repeat) are drawn per method in the skip / exit-layer plots.
MAX_TRACE_ROUNDS = 5000


def allowed_methods() -> list[str]:
    from framework.experiment.presets import list_presets

    return [BASELINE, *HF_METHODS, *(p for p in list_presets() if p != BASELINE)]


@dataclass(frozen=True)
class MethodSpec:
    """A method of the benchmark: ``kind`` is ``baseline``, ``hf``, ``preset`` or ``custom``."""

    label: str
    kind: str
    source: str = ""  # the preset name or YAML path


def parse_methods(methods: Sequence[str]) -> list[MethodSpec]:
    """Resolve method names; vanilla is added first when missing.

    Raises:
        ConfigError: an unknown name (the message lists the allowed ones), a duplicate, or a
            baseline-only preset file.
    """
    from framework.experiment.plugins import load_builtin_strategies
    from framework.experiment.presets import list_presets, load_preset

    load_builtin_strategies()
    shipped = set(list_presets())
    out: list[MethodSpec] = []
    for raw in methods:
        name = raw.strip()
        if not name:
            continue
        if name == BASELINE:
            spec = MethodSpec(BASELINE, "baseline")
        elif name in HF_METHODS:
            spec = MethodSpec(name, "hf")
        elif name in shipped:
            spec = MethodSpec(name, "preset", name)
        elif Path(name).suffix in (".yaml", ".yml") and Path(name).is_file():
            label = Path(name).stem
            if label == BASELINE or label in HF_METHODS:
                raise ConfigError("--methods", name, f"a preset file whose name is not {label!r} (reserved)")
            spec = MethodSpec(label, "preset", name)
            if load_preset(name)["baseline_only"]:
                raise ConfigError("--methods", name, "a preset with strategies (vanilla is always run)")
        else:
            raise ConfigError(
                "--methods",
                name,
                f"a comma-separated list of {', '.join(allowed_methods())}, or preset YAML files",
            )
        if any(s.label == spec.label for s in out):
            raise ConfigError("--methods", name, "each method once (two methods share the name)")
        out.append(spec)
    if not any(s.kind == "baseline" for s in out):
        out.insert(0, MethodSpec(BASELINE, "baseline"))
    if len(out) < 2:
        raise ConfigError("--methods", ",".join(methods), "at least one method besides vanilla")
    return out


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark needs (built by `main`, or directly in Python)."""

    methods: tuple[str, ...] = param(DEFAULT_METHODS, help="methods to compare")
    model: str | None = param(None, help="HF model directory; default: the embedded SmolLM2-135M-Instruct")
    dtype: str = param("float32", help="model dtype")
    device: str = param("auto", help="auto, cpu, cuda, cuda:N")
    data: str | None = param(None, help="Spec-Bench-format question.jsonl; default: the built-in suite")
    categories: tuple[str, ...] = param((), help="keep only these categories")
    limit: int | None = param(None, help="at most this many prompts per category")
    max_new_tokens: int = param(128, help="new tokens per turn")
    threads: int | None = param(None, help="torch CPU threads")
    warmup: int = param(1, help="warm-up generations per method (16 tokens each) before timing")
    repeats: int = param(1, help="repetitions of the whole interleaved run")
    out: str | None = param(None, help="output directory (default runs/bench-<time>)")
    seed: int = param(0, help="torch seed")
    prompt_lookup_num_tokens: int = param(10, help="hf_prompt_lookup: candidate tokens per lookup")
    max_matching_ngram_size: int | None = param(None, help="hf_prompt_lookup: n-gram size (HF default 2)")
    early_exit_layer: int | None = param(None, help="hf_early_exit: E (default round(0.8 L))")
    hf_kernels: bool = param(
        False,
        help="let the HF methods use this framework's CPU kernels too (default: stock PyTorch, as users run them)",
    )
    cost_model: str = param("measure", help="'measure', 'none', or a CostModel / skip-set JSON file")
    skip_set: str | None = param(None, help="--skip-set for presets whose selector takes one (selfsd)")
    preset_args: tuple[tuple[str, str], ...] = param((), help="(method, extra run.py flags) pairs")
    plots: bool = param(True, help="write PNG plots")
    command: str = param("", help="the command line, for the report")

    def __post_init__(self) -> None:
        check_range("--max-new-tokens", self.max_new_tokens, 1, integer=True)
        check_range("--warmup", self.warmup, 0, integer=True)
        check_range("--repeats", self.repeats, 1, integer=True)
        check_range("--prompt-lookup-num-tokens", self.prompt_lookup_num_tokens, 1, integer=True)
        for flag, val in (
            ("--limit", self.limit),
            ("--threads", self.threads),
            ("--max-matching-ngram-size", self.max_matching_ngram_size),
            ("--early-exit-layer", self.early_exit_layer),
        ):
            if val is not None:
                check_range(flag, val, 1, integer=True)
        specs = parse_methods(self.methods)
        labels = {s.label for s in specs}
        for method, _ in self.preset_args:
            spec = next((s for s in specs if s.label == method), None)
            if spec is None or spec.kind != "preset":
                raise ConfigError(
                    "--preset-args", method, f"a preset among --methods ({', '.join(sorted(labels))})"
                )

    @property
    def method_specs(self) -> list[MethodSpec]:
        return parse_methods(self.methods)

    def describe(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["methods"] = [s.label for s in self.method_specs]
        return d


# ---------------------------------------------------------------------------------------------
# Hugging Face generate as a decoder
# ---------------------------------------------------------------------------------------------


def neutral_generation_config(**overrides: Any) -> Any:
    """A `GenerationConfig` that adds nothing to greedy decoding: no repetition penalty, no n-gram
    blocking, no forced / suppressed / biased tokens. The minimum length is left unset (HF's global
    default, 0): set explicitly, HF's assistant for early exit warns on every round."""
    from transformers import GenerationConfig

    base = dict(
        do_sample=False,
        num_beams=1,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        bad_words_ids=None,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        sequence_bias=None,
        renormalize_logits=False,
        remove_invalid_values=False,
        use_cache=True,
        return_dict_in_generate=False,
    )
    base.update(overrides)
    return GenerationConfig(**base)


class HFGenerateDecoder:
    """Hugging Face ``model.generate`` behind the decoders' ``generate(prompt_ids, stop)`` API.

    Args:
        model: the shared Hugging Face causal LM.
        method: ``hf_generate``, ``hf_prompt_lookup`` or ``hf_early_exit``.
        prompt_lookup_num_tokens / max_matching_ngram_size: prompt lookup's settings.
        early_exit_layer: E of ``hf_early_exit``.
        kernels: run ``generate`` with this framework's CPU kernels in place (`framework.kernels.cpu`);
            by default they are taken out for the call, so that HF runs as users run it.

    The round statistics of the assisted methods (candidates proposed, matches per round) are read
    from HF's candidate generator, wrapped for the call. HF's first round is also the prefill; as
    in our decoders, the token the prefill yields is not counted in a round, so ``sum(accept
    lengths) = new tokens - 1``.
    """

    def __init__(
        self,
        model: Any,
        method: str,
        *,
        prompt_lookup_num_tokens: int = 10,
        max_matching_ngram_size: int | None = None,
        early_exit_layer: int | None = None,
        kernels: bool = False,
    ) -> None:
        if method not in HF_METHODS:
            raise ValueError(f"unknown HF method {method!r}; choose from {', '.join(HF_METHODS)}")
        self.model, self.name = model, method
        self.num_layers = int(model.config.num_hidden_layers)
        extra: dict[str, Any] = {}
        if method == "hf_prompt_lookup":
            extra["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
            if max_matching_ngram_size is not None:
                extra["max_matching_ngram_size"] = max_matching_ngram_size
        elif method == "hf_early_exit":
            e = early_exit_layer or max(1, min(self.num_layers - 1, round(0.8 * self.num_layers)))
            if not 1 <= e < self.num_layers:
                raise ConfigError(
                    "--early-exit-layer",
                    e,
                    f"in [1, {self.num_layers - 1}] (the model has {self.num_layers} layers)",
                )
            extra["assistant_early_exit"] = e
        self.extra = extra
        self.kernels = kernels

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.extra.items()) or "greedy"

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, stop: StopCondition) -> GenerationResult:
        if stop.stop_strings:
            raise ValueError("the HF methods of the benchmark support EOS ids only, not stop strings")
        model = self.model
        eos = sorted(stop.eos)
        gen_cfg = neutral_generation_config(
            max_new_tokens=stop.max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else None,
            **self.extra,
        )
        rounds: list[tuple[int, int]] = []  # (candidates proposed, matches) per round
        base_model = getattr(model, model.base_model_prefix, model)
        saved_layers = base_model.config.num_hidden_layers
        saved_gen_cfg = model.generation_config
        original = getattr(type(model), "_get_candidate_generator", None)
        if self.extra and original is not None:
            model._get_candidate_generator = _recording(original.__get__(model), rounds)
        model.generation_config = neutral_generation_config()
        sync = torch.cuda.synchronize if prompt_ids.device.type == "cuda" else (lambda: None)
        try:
            with contextlib.nullcontext() if self.kernels else fast_kernels.stock(model):
                sync()
                t0 = time.perf_counter()
                out = model.generate(
                    prompt_ids, attention_mask=torch.ones_like(prompt_ids), generation_config=gen_cfg
                )
                sync()
                wall = time.perf_counter() - t0
        finally:
            model.generation_config = saved_gen_cfg
            base_model.config.num_hidden_layers = saved_layers  # HF's early exit sets it per round
            model.__dict__.pop("_get_candidate_generator", None)
        new = out[0, prompt_ids.shape[1] :].tolist()
        cut = stop.find_cut(new, 0) or (len(new), "max_new_tokens")
        tokens = new[: cut[0]]
        if self.extra:
            accept = [m + 1 for _, m in rounds]
            if accept:
                accept[0] -= 1  # the prefill's token
                if accept[0] == 0:
                    accept.pop(0)
            drafted, accepted = sum(c for c, _ in rounds), sum(m for _, m in rounds)
        else:
            accept = [1] * (len(tokens) - 1)
            drafted = accepted = 0
        return GenerationResult(
            tokens=tokens,
            wall_time=wall,
            stop_reason=cut[1],
            accept_lengths=accept,
            draft_lengths=[c for c, _ in rounds],
            drafted=drafted,
            accepted=accepted,
        )


def _recording(get_generator: Callable[..., Any], rounds: list[tuple[int, int]]) -> Callable[..., Any]:
    """Wrap HF's ``_get_candidate_generator`` so that each round's candidates and matches land in
    ``rounds`` (pure bookkeeping: the calls and their results are unchanged)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        gen = get_generator(*args, **kwargs)
        get_candidates, update = gen.get_candidates, gen.update_candidate_strategy
        pending: list[int] = []

        def get_candidates_rec(input_ids: torch.Tensor, *a: Any, **k: Any) -> Any:
            out = get_candidates(input_ids, *a, **k)
            pending.append(int(out[0].shape[1] - input_ids.shape[1]))
            return out

        def update_rec(input_ids: torch.Tensor, scores: Any, num_matches: Any) -> Any:
            rounds.append((pending.pop() if pending else 0, int(num_matches)))
            return update(input_ids, scores, num_matches)

        gen.get_candidates, gen.update_candidate_strategy = get_candidates_rec, update_rec
        return gen

    return wrapped


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
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


def _preset_run_config(spec: MethodSpec, cfg: BenchConfig) -> Any:
    """The `RunConfig` of a preset, built by the run.py CLI (so every run.py flag works)."""
    from framework.experiment.cli import build_parser, config_from_args
    from framework.experiment.presets import load_preset
    from framework.interfaces import REGISTRIES

    argv = ["--method", spec.source, "--max-new-tokens", str(cfg.max_new_tokens), "--dtype", cfg.dtype]
    selector = load_preset(spec.source).get("selector", {}).get("name")
    if cfg.skip_set and selector in REGISTRIES["selector"]:
        fields = {f.name for f in dataclasses.fields(REGISTRIES["selector"].entry(selector).config)}
        if "skip_set" in fields:
            argv += ["--skip-set", cfg.skip_set]
    for method, flags in cfg.preset_args:
        if method == spec.label:
            argv += shlex.split(flags)
    parser = build_parser()
    parser.exit_on_error = False
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise ConfigError(
            f"--preset-args {spec.label}", " ".join(argv[6:]), f"valid run.py flags ({err})"
        ) from None
    if unknown:
        raise ConfigError(
            f"--preset-args {spec.label}", " ".join(unknown), "run.py flags (see run.py --help)"
        )
    run_cfg = dataclasses.replace(config_from_args(args), name=spec.label)
    verifier = REGISTRIES["verifier"].get(run_cfg.verifier.name)
    if getattr(verifier, "lossless", "greedy") != "greedy":
        raise ConfigError(
            "--methods",
            spec.source,
            f"a greedy preset (the benchmark is greedy; its verifier {run_cfg.verifier.name!r} samples)",
        )
    return run_cfg


def _first_mismatch(got: list[list[int]], want: list[list[int]]) -> dict[str, int] | None:
    for t, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return {"turn": t, "position": i}
    if len(got) != len(want):
        return {"turn": min(len(got), len(want)), "position": 0}
    return None


def _record(
    prompt: Prompt, spec: MethodSpec, repeat: int, position: int, turns: list[tuple[GenerationResult, str]]
) -> dict[str, Any]:
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


def _load_cost_model(spec: str) -> Any:
    from framework.engine.cost_model import CostModel

    try:
        data = json.loads(Path(spec).read_text())
        return CostModel.from_dict(data.get("cost_model", data))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise ConfigError(
            "--cost-model", spec, f"'measure', 'none' or a CostModel / skip-set JSON ({err})"
        ) from None


def run_benchmark(
    cfg: BenchConfig,
    model: Any = None,
    tokenizer: Any = None,
    *,
    log: Callable[[str], None] = print,
    custom: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"out", "report", "summary", "records", "plots"}``.

    Args:
        cfg: the configuration.
        model, tokenizer: an already loaded model (else ``cfg.model`` is loaded).
        custom: extra methods ``{label: decoder}``; a decoder has ``generate(prompt_ids, stop) ->
            GenerationResult`` (e.g. a modified decoder under test).

    Raises:
        ConfigError, DataError, ModelLoadError, UnknownNameError: bad input, before anything is
            written.
    """
    from framework.experiment.runner import Experiment, RunConfig

    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    specs = cfg.method_specs
    for label in custom or {}:
        if any(s.label == label for s in specs):
            raise ConfigError("custom", label, "a name not used by --methods")
        specs.append(MethodSpec(label, "custom"))
    prompts = load_prompts(cfg.data, cfg.categories or None, cfg.limit)
    out_dir = Path(cfg.out) if cfg.out else Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    records_path = out_dir / "records.jsonl"
    if records_path.exists() and records_path.stat().st_size:
        raise ConfigError("--out", str(out_dir), "a new or empty directory (records.jsonl exists)")
    preset_cfgs = {s.label: _preset_run_config(s, cfg) for s in specs if s.kind == "preset"}
    cost = _load_cost_model(cfg.cost_model) if cfg.cost_model not in ("none", "measure") else None

    if model is None:
        from framework.experiment.models import load_model

        model, tokenizer = load_model(cfg.model, cfg.dtype, cfg.device)
    base_cfg = RunConfig(
        model=cfg.model,
        dtype=cfg.dtype,
        device=cfg.device,
        max_new_tokens=cfg.max_new_tokens,
        baseline_only=True,
    )
    base = Experiment(base_cfg, model, tokenizer, log=log, prompts=prompts)
    exps: dict[str, Any] = {}
    decoders: dict[str, Any] = {}
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
                preset_cfgs[s.label], model, tokenizer, artifact_stem=out_dir / s.label, log=log
            )
            decoders[s.label] = exps[s.label].spec
    if cost is not None and cost.num_layers != base.adapter.info().num_layers:
        n = base.adapter.info().num_layers
        raise ConfigError(
            "--cost-model", cfg.cost_model, f"a cost model of a {n}-layer model, not {cost.num_layers}"
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    meta = {"config": cfg.describe(), "environment": env, "started": time.time(), "prompts": len(prompts)}
    meta["hf"] = {s.label: decoders[s.label].describe() for s in specs if s.kind == "hf"}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    info = base.adapter.info()
    log(
        f"[bench] {len(prompts)} prompts x {cfg.repeats} repeat(s) | model {info.name} ({cfg.dtype}, "
        f"{base.adapter.device}) | methods {', '.join(s.label for s in specs)} | output {out_dir}"
    )

    errors: dict[str, str] = {}

    def decode(s: MethodSpec, prompt: Prompt, max_new_tokens: int | None = None) -> Any:
        try:
            return exps[s.label].decode_prompt(decoders[s.label], prompt, max_new_tokens)
        except Exception as err:  # noqa: BLE001 - an HF method's failure is reported, not raised
            if s.kind != "hf":
                raise
            errors[s.label] = f"{type(err).__name__}: {err}".strip()
            log(f"[bench] {s.label} failed and is left out from now on: {errors[s.label]}")
            return None

    for _ in range(cfg.warmup):
        for s in specs:
            if s.label not in errors:
                decode(s, prompts[0], min(16, cfg.max_new_tokens))
    if cfg.cost_model == "measure":
        from framework.engine.cost_model import CostModel

        stored = [e.prepare_ctx.store.get("cost_model") for e in exps.values()]
        cost = next((c for c in stored if c is not None), None)
        if cost is None:
            log("[bench] measuring the cost model (draft and verification costs) ...")
            cost = CostModel.measure(base.adapter)
        # Reusable by a later run on the same machine: --cost-model <out>/cost_model.json
        (out_dir / "cost_model.json").write_text(json.dumps({"cost_model": cost.to_dict()}, indent=2))

    records: list[dict[str, Any]] = []
    turn = 0
    t_start = time.perf_counter()
    with records_path.open("a", encoding="utf-8") as fh:
        for rep in range(cfg.repeats):
            for s in specs:  # fresh strategy state for every repeat (an offline search is reused)
                if s.kind == "preset":
                    exps[s.label].rebuild()
                    decoders[s.label] = exps[s.label].spec
            for i, prompt in enumerate(prompts):
                active = [s for s in specs if s.label not in errors]
                k = turn % len(active)
                order = active[k:] + active[:k]
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
                    rec = _record(prompt, s, rep, order.index(s), results[s.label])
                    got = [t["tokens"] for t in rec["turns"]]
                    rec["first_mismatch"] = _first_mismatch(got, want)
                    rec["lossless"] = rec["first_mismatch"] is None
                    fh.write(json.dumps(rec, default=str) + "\n")
                    fh.flush()
                    records.append(rec)
                    mark = "" if rec["lossless"] else " MISMATCH"
                    line.append(f"{s.label} {rec['tokens_per_s']:.1f} tok/s{mark}")
                for label in errors:
                    if not any(r["method"] == label and r.get("error") for r in records):
                        err = {"repeat": rep, "question_id": prompt.question_id, "category": prompt.category}
                        err.update({"method": label, "error": errors[label]})
                        fh.write(json.dumps(err) + "\n")
                        fh.flush()
                        records.append(err)
                rtag = f" r{rep + 1}" if cfg.repeats > 1 else ""
                log(
                    f"[{i + 1}/{len(prompts)}{rtag}] {prompt.category:<14} q{prompt.question_id}: "
                    + ", ".join(line)
                )
    elapsed = time.perf_counter() - t_start

    labels = [s.label for s in specs]
    summary = summarize(records, labels, cost)
    plots = make_plots(out_dir, summary, records, info.num_layers) if cfg.plots else {}
    report = render_report(cfg, summary, env, len(prompts), elapsed, plots, meta["hf"], cost)
    (out_dir / "bench.md").write_text(report)
    log("\n" + report)
    return {"out": str(out_dir), "report": report, "summary": summary, "records": records, "plots": plots}


# ---------------------------------------------------------------------------------------------
# Aggregation and the report
# ---------------------------------------------------------------------------------------------


def _speedups(records: list[dict[str, Any]], method: str) -> dict[str, float]:
    """``{category: tok/s of method / tok/s of vanilla}`` (ratio of means) over ``records``."""
    out = {}
    for cat, by_method in aggregate(records).items():
        b, m = by_method.get(BASELINE), by_method.get(method)
        if b is None or m is None:
            continue
        out[cat] = m.mean_tokens_per_s / b.mean_tokens_per_s if b.mean_tokens_per_s else float("nan")
    return out


def summarize(records: list[dict[str, Any]], methods: Sequence[str], cost: Any = None) -> dict[str, Any]:
    """The numbers of the report, per method, from the JSONL records.

    Returns:
        ``{"categories": [...], "methods": {label: {...}}}`` where a method's entry has
        ``speedup`` ({category: mean over repeats of the ratio of means}), ``overall_by_repeat``,
        ``std`` / ``min`` / ``max`` of the overall speedup over repeats (None with one repeat),
        ``tokens_per_s`` ({category: mean tok/s over all repeats}), ``M``, ``alpha``,
        ``skip_ratio``, ``drafted``, ``prompts``, ``mismatches`` (distinct prompts that differ from
        vanilla in any repeat), ``mismatched`` (their ids), ``error`` and ``cost_model`` (the
        prediction at the measured alpha, for methods that drafted with our decoders).
    """
    ok = [r for r in records if not r.get("error")]
    errors = {r["method"]: r["error"] for r in records if r.get("error")}
    repeats = sorted({r["repeat"] for r in ok})
    agg = aggregate(ok)
    cats = list(agg)
    out: dict[str, Any] = {}
    for method in methods:
        per_rep = [_speedups([r for r in ok if r["repeat"] == rep], method) for rep in repeats]
        speed = {}
        for cat in cats:
            vals = [s[cat] for s in per_rep if cat in s]
            if vals:
                speed[cat] = sum(vals) / len(vals)
        overall = [s["overall"] for s in per_rep if "overall" in s]
        stats = agg.get("overall", {}).get(method)
        mine = [r for r in ok if r["method"] == method]
        bad = sorted({str(r["question_id"]) for r in mine if not r.get("lossless", True)})
        entry: dict[str, Any] = {
            "speedup": speed,
            "overall_by_repeat": overall,
            "std": statistics.stdev(overall) if len(overall) > 1 else None,
            "min": min(overall) if overall else None,
            "max": max(overall) if overall else None,
            "tokens_per_s": {c: agg[c][method].mean_tokens_per_s for c in cats if method in agg[c]},
            "M": stats.mean_accepted_length if stats else None,
            "alpha": stats.acceptance_rate if stats and stats.drafted else None,
            "skip_ratio": stats.skip_ratio if stats and stats.skip_rounds else None,
            "drafted": stats.drafted if stats else 0,
            "prompts": len({str(r["question_id"]) for r in mine}),
            "mismatches": len(bad),
            "mismatched": bad,
            "error": errors.get(method),
            "cost_model": None,
        }
        kind = mine[0].get("kind") if mine else None
        if cost is not None and stats and stats.drafted and kind == "preset":
            entry["cost_model"] = cost_model_prediction(
                cost, stats.acceptance_rate, stats.skip_ratio, stats.forwards_per_draft_token
            )
            entry["cost_model"]["rounds"] = rounds_prediction(cost, mine)
        out[method] = entry
    return {"categories": cats, "methods": out, "repeats": len(repeats)}


def _x(v: float | None) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}x"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def results_markdown(summary: dict[str, Any]) -> str:
    """The main table: per-category speedups, overall ± spread, tok/s, M, alpha, mismatches and the
    cost model's prediction."""
    cats = [c for c in summary["categories"] if c != "overall"]
    head = ["method", *cats, "**overall**", "spread (std; min-max)", "tok/s", "M", "alpha", "mismatches"] + [
        "cost model: ceiling / best drafting / its rounds"
    ]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for method, e in summary["methods"].items():
        if e["error"] and not e["prompts"]:
            cells = ["error"] * (len(cats) + 1) + [_cell(f"ERROR: {e['error'][:160]}")] + ["n/a"] * 5
            rows.append(f"| {method} | " + " | ".join(cells) + " |")
            continue
        cells = [_x(e["speedup"].get(c)) for c in cats] + [f"**{_x(e['speedup'].get('overall'))}**"]
        if method == BASELINE:
            cells.append("n/a (baseline)")
        elif e["std"] is not None:
            cells.append(f"± {e['std']:.3f} ({e['min']:.3f}-{e['max']:.3f})")
        else:
            cells.append("n/a (1 run)")
        if e["error"]:
            cells[-1] += _cell(f"; ERROR after {e['prompts']} prompts: {e['error'][:120]}")
        tps = e["tokens_per_s"].get("overall")
        cells.append(f"{tps:.2f}" if tps is not None else "n/a")
        cells.append(f"{e['M']:.2f}" if e["M"] is not None else "n/a")
        cells.append(f"{e['alpha']:.3f}" if e["alpha"] is not None else "n/a")
        cells.append("baseline" if method == BASELINE else f"{e['mismatches']}/{e['prompts']}")
        cm = e["cost_model"]
        if cm:
            rounds = cm.get("rounds")
            cells.append(
                f"{cm['ceiling']:.3f}x (k={cm['ceiling_k']}) / {cm['drafting']:.3f}x (k={cm['drafting_k']})"
                + (f" / {rounds:.3f}x" if rounds is not None else "")
            )
        else:
            cells.append("n/a")
        rows.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def tokens_per_s_markdown(summary: dict[str, Any]) -> str:
    cats = summary["categories"]
    rows = ["| method | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for method, e in summary["methods"].items():
        vals = [e["tokens_per_s"].get(c) for c in cats]
        rows.append(f"| {method} | " + " | ".join("n/a" if v is None else f"{v:.2f}" for v in vals) + " |")
    return "\n".join(rows)


def render_report(
    cfg: BenchConfig,
    summary: dict[str, Any],
    env: dict[str, Any],
    n_prompts: int,
    elapsed: float,
    plots: dict[str, str],
    hf: dict[str, str],
    cost: Any,
) -> str:
    gpu = f", GPU {env['cuda']}" if env.get("cuda") else ""
    lines = [
        "# Benchmark",
        "",
        f"- command: `{cfg.command or '(called from Python)'}`",
        f"- machine: {env['cpu']}, {env['cpu_count']} cores, torch threads {env['torch_threads']}{gpu}",
        f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
        f"- data: {cfg.data or 'built-in suite'}; {n_prompts} prompts"
        + (f" (at most {cfg.limit} per category)" if cfg.limit else "")
        + f"; max_new_tokens {cfg.max_new_tokens}; dtype {cfg.dtype}; greedy, batch 1; warm-up {cfg.warmup} "
        f"generation(s) per method; {cfg.repeats} repeat(s); {elapsed:.0f} s timed",
    ]
    if hf:
        lines.append("- HF methods: " + "; ".join(f"{k}: {v}" for k, v in hf.items()))
    if cost is not None:
        lines.append(f"- cost model ({cost.device}, context {cost.context}): {cost.describe()}")
    lines += [
        "",
        "Speedup = mean tokens/s of the method / mean tokens/s of our vanilla baseline (ratio of means), "
        "interleaved on the same prompts; with several repeats, the mean over repeats of each repeat's "
        "ratio. M = tokens per verification round, bonus included. Mismatches = prompts whose tokens "
        "differ from vanilla greedy decoding. The cost model column: the best speedup the measured cost "
        "model predicts at the method's measured alpha and skip ratio (ceiling over k = 0..16, and the "
        "best with drafting, k >= 1), then what it predicts for the rounds the method actually ran (its "
        "draft lengths, plans and verified blocks; measured / this = the engine's efficiency).",
        "",
        results_markdown(summary),
        "",
        "Tokens/s by category (mean over prompts and repeats):",
        "",
        tokens_per_s_markdown(summary),
    ]
    notes = []
    for method, e in summary["methods"].items():
        if e["error"]:
            notes.append(f"- **{method} failed**: `{_cell(e['error'])}`")
        if e["mismatches"] and method != BASELINE:
            ids = ", ".join(e["mismatched"][:20])
            notes.append(f"- {method}: {e['mismatches']} prompt(s) differ from vanilla (question ids {ids})")
    if notes:
        lines += ["", *notes]
    if plots:
        lines += ["", "Plots:", ""] + [f"![{name}]({Path(p).name})" for name, p in plots.items()]
    return "\n".join(lines) + "\n"


def make_plots(
    out_dir: Path, summary: dict[str, Any], records: list[dict[str, Any]], num_layers: int
) -> dict[str, str]:
    """The benchmark's PNGs: speedup by category, accepted tokens per round, and for our methods
    the draft's plan over the rounds of the first repeat (`GenerationResult.plans` /
    ``exit_layers``): the exit layer per round for early-exit drafting, else the skip set per round
    when it changes (dynamic selectors such as swift and clasp_dp)."""
    from framework.experiment import plots

    out: dict[str, str] = {}
    rows = {m: e["speedup"] for m, e in summary["methods"].items() if m != BASELINE and e["speedup"]}
    out["speedup by category"] = str(plots.speedup_by_category(rows, out_dir / "speedup_by_category.png"))
    lengths: dict[str, list[int]] = {}
    codes: dict[str, list[str]] = {}
    exits: dict[str, list[int | None]] = {}
    for r in records:
        if r.get("error"):
            continue
        if r.get("drafted"):
            lengths.setdefault(r["method"], []).extend(r["accept_lengths"])
        if r.get("kind") == "preset" and r["repeat"] == 0:
            for t in r["turns"]:
                codes.setdefault(r["method"], []).extend(t.get("plans") or [])
                exits.setdefault(r["method"], []).extend(t.get("exit_layers") or [])
    out["accepted tokens per round"] = str(
        plots.accept_length_histogram(lengths, out_dir / "accept_lengths.png")
    )
    for method, plan_codes in codes.items():
        if not plan_codes:
            continue
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in method)
        exit_layers = exits.get(method, [])[:MAX_TRACE_ROUNDS]
        if any(e is not None for e in exit_layers):
            p = plots.exit_layer_over_time(exit_layers, num_layers, out_dir / f"exit_layer_{safe}.png")
            out[f"{method}: exit layer per round"] = str(p)
        elif len(set(plan_codes)) > 1:
            rows_bits = [[int(c) for c in code] for code in plan_codes[:MAX_TRACE_ROUNDS]]
            p = plots.skip_heatmap(rows_bits, num_layers, out_dir / f"skip_{safe}.png", title=method)
            out[f"{method}: skip set per round"] = str(p)
    return out


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.py",
        description="Spec-Bench-style benchmark: our vanilla baseline, Hugging Face generate (greedy, prompt "
        "lookup, early exit) and any of our presets, interleaved on the same prompts with one model load.",
    )
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated: vanilla, hf_generate, hf_prompt_lookup, hf_early_exit, any preset ("
        + ", ".join(m for m in allowed_methods() if m != BASELINE and m not in HF_METHODS)
        + ") or preset YAML files (default %(default)s)",
    )
    p.add_argument("--data", default=None, help="Spec-Bench question.jsonl (default: the built-in suite)")
    p.add_argument("--categories", default="", help="comma-separated categories to keep")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per turn (default 128)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--warmup", type=int, default=1, help="warm-up generations per method (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="repeat the whole run N times (default 1)")
    p.add_argument("--out", default=None, help="output directory (default runs/bench-<time>)")
    p.add_argument(
        "--model", default=None, help="HF model directory (default: embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--dtype", default="float32", help="float32 (default), float16, bfloat16, float64")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=10,
        help="hf_prompt_lookup's candidate tokens (default 10)",
    )
    p.add_argument(
        "--max-matching-ngram-size",
        type=int,
        default=None,
        help="hf_prompt_lookup's n-gram size (HF default 2)",
    )
    p.add_argument(
        "--early-exit-layer", type=int, default=None, help="hf_early_exit's layer E (default round(0.8 L))"
    )
    p.add_argument(
        "--hf-kernels",
        action="store_true",
        help="run the HF methods with this framework's CPU kernels too (default: stock PyTorch, as users run them)",
    )
    p.add_argument(
        "--cost-model",
        default="measure",
        help="'measure' (default, ~15 s; saved as <out>/cost_model.json), 'none', or a CostModel / selfsd "
        "skip-set JSON file",
    )
    p.add_argument("--skip-set", default=None, help="skip-set file for presets that take one (selfsd)")
    p.add_argument(
        "--preset-args",
        action="append",
        default=[],
        metavar="METHOD=FLAGS",
        help="extra run.py flags for one preset, e.g. 'swift=--selector.skip_ratio 0.3' (repeatable)",
    )
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    return p


def config_from_args(args: argparse.Namespace, command: str = "") -> BenchConfig:
    from framework.experiment.models import DTYPES

    if args.dtype not in DTYPES:
        raise ConfigError("--dtype", args.dtype, f"one of {', '.join(DTYPES)}")
    pairs = []
    for item in args.preset_args:
        method, sep, flags = item.partition("=")
        if not sep or not method.strip():
            raise ConfigError("--preset-args", item, "METHOD=FLAGS, e.g. 'swift=--selector.skip_ratio 0.3'")
        pairs.append((method.strip(), flags))
    return BenchConfig(
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        data=args.data,
        categories=tuple(c.strip() for c in args.categories.split(",") if c.strip()),
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        threads=args.threads,
        warmup=args.warmup,
        repeats=args.repeats,
        out=args.out,
        seed=args.seed,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        max_matching_ngram_size=args.max_matching_ngram_size,
        early_exit_layer=args.early_exit_layer,
        hf_kernels=args.hf_kernels,
        cost_model=args.cost_model,
        skip_set=args.skip_set,
        preset_args=tuple(pairs),
        plots=not args.no_plots,
        command=command,
    )


def main(argv: Sequence[str] | None = None, *, model: Any = None, tokenizer: Any = None) -> int:
    """``experiments/bench.py``; returns the exit status (2 for bad input, 130 when interrupted)."""
    from framework.experiment.cli import guarded
    from framework.experiment.plugins import load_builtin_strategies

    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python experiments/bench.py " + shlex.join(argv)

    def body() -> int:
        load_builtin_strategies()
        cfg = config_from_args(build_parser().parse_args(argv), command.strip())
        run_benchmark(cfg, model, tokenizer)
        return 0

    return guarded(body, "every finished prompt is in <out>/records.jsonl")


__all__ = [
    "BASELINE",
    "HF_METHODS",
    "BenchConfig",
    "HFGenerateDecoder",
    "main",
    "parse_methods",
    "run_benchmark",
    "summarize",
]
