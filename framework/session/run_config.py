"""The configuration of a run: `RunConfig`, the single source of truth, in five sections.

- `ModelConfig` (``cfg.model``): which model, in what dtype, on what device, and how it executes
  (CPU kernels, CUDA graphs, phase timing);
- `MethodConfig` (``cfg.method``): the four strategies, the draft gate, the method's name;
- `DataConfig` (``cfg.data``): the prompts;
- `GenerationConfig` (``cfg.generation``): what one generation may do (token budget, stop
  strings, seed);
- `RunnerConfig` (``cfg.runner``): how the runner executes and records a run (output, W&B,
  warm-up, threads, processes, ``--resume``).

`selfspec.Decoder` takes the model, method and generation sections only; the benchmark shares
one run's sections with every method and swaps the method section per method.

Every way of configuring a run ends in one frozen `RunConfig`: Python code
(``RunConfig.from_preset("swift", max_new_tokens=64)``), a preset YAML, a saved config
(``RunConfig.load``), and the command line, whose flags are generated from the sections' fields
(``framework.session.flags``; one flag per field, the sections do not show on the command line)
and applied with the same override rules.

Override keys (`RunConfig.from_preset`, `RunConfig.replace`, `RunConfig.of`) come in two
spellings, the same for flags, presets, sweeps and Python:

- a flat name, the flag without dashes: ``max_new_tokens=64``, ``model="tiny-random"``,
  ``data="q.jsonl"``, ``categories="qa,rag"``, ``stop=("###",)``; a strategy kind names its
  strategy: ``selector="static"`` (its fields are reset to the strategy's defaults unless the
  name is the current one);
- a dotted key, ``<section>.<field>`` or ``<kind>.<field>``: ``**{"generation.max_new_tokens":
  64}``, ``**{"selector.skip_ratio": 0.3}``, ``**{"gate.enabled": True}``,
  ``**{"length.name": "fixed"}``.

A whole section, a strategy or the gate given as a mapping or an object (``gate={"enabled":
True}``, ``selector=StaticSelectorConfig(...)``, ``generation=GenerationConfig(...)``) is refused
with an error that spells it in dotted keys. Code that holds a section object swaps it in with
``dataclasses.replace(cfg, method=...)``.

Strings are parsed with the field's type, as on the command line (``"64"``, ``"true"``,
``"3,5"``); typed values are coerced (`framework.config_fields.coerce_value`: lists to tuples, YAML's
``8.0`` to an int), never spelled back as text. Every error is a `ConfigError` that names the key
as its flag: ``--selector.skip_ratio must be in [0, 1), got 1.5``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from framework.config_fields import ConfigError, check_range, param
from framework.drafting.gate import GateConfig
from framework.engine.grammar import Grammar
from framework.engine.placement import BlockPlacement
from framework.engine.synthetic import synthetic_label
from framework.interfaces import REGISTRIES
from framework.registry import UnknownNameError
from framework.session.methods import CompareConfig
from framework.session.plugins import recorded_imports
from framework.session.presets import PRESET_DIR, load_preset, preset_path, yaml_problem

if TYPE_CHECKING:
    import torch

#: Values of ``--logger``.
LOGGERS = ("wandb", "csv", "none")
#: Values of ``--phase-timing`` (``auto``: on for a CPU, off for CUDA).
PHASE_TIMING = ("auto", "on", "off")
#: Values of ``--dtype`` (``framework.models.loading.DTYPES`` maps them to torch dtypes).
#: ``auto`` is resolved where the device is (`framework.models.loading.resolve_dtype`): bfloat16 on
#: CUDA, float32 on CPU.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "auto")


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy name and its (validated) config object (``None``: its defaults)."""

    name: str
    config: Any = None

    def build(self, kind: str):
        """A fresh instance of the strategy, from the ``kind`` registry."""
        cls = REGISTRIES[kind].get(self.name)
        return cls(self.config if self.config is not None else cls.Config())

    def describe(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config) if self.config is not None else {}
        return {"name": self.name, "config": cfg}


class UnknownStrategyError(ConfigError, UnknownNameError):
    """A strategy name that is not registered (``--selector statik``); the message lists the
    registered names and a close match. Both a `ConfigError` and the registry's
    `UnknownNameError`."""

    def __init__(self, flag: str, value: str, lookup: UnknownNameError) -> None:
        ConfigError.__init__(self, flag, value, "a registered name")
        self.args = (f"{flag}: {lookup}",)

    def __str__(self) -> str:
        return str(self.args[0])


def strategy_field(
    kind: str,
    default_name: str,
    help: str = "",  # noqa: A002
    field_aliases: Mapping[str, str] | None = None,
) -> Any:
    """A `RunConfig` field holding the `StrategySpec` of ``kind`` (default: ``default_name`` with
    its default config); the flag generator turns it into ``--<kind>`` and ``--<kind>.<field>``.

    Args:
        kind: the registry (``selector``, ``length``, ``drafter``, ``verifier``).
        default_name: the registered name used when nothing else names one.
        help: the help of ``--<kind>``.
        field_aliases: short flags of strategy fields: ``{"--skip-set": "skip_set"}`` makes
            ``--skip-set F`` mean ``--<kind>.skip_set F``.
    """
    return field(
        default_factory=lambda: StrategySpec(default_name),
        metadata={
            "help": help,
            "strategy": kind,
            "default_name": default_name,
            "field_aliases": dict(field_aliases or {}),
        },
    )


def _check_bools(pairs: tuple[tuple[str, Any], ...]) -> None:
    for flag, value in pairs:
        if not isinstance(value, bool):
            raise ConfigError(flag, value, "a boolean (true/false)")


def _check_strings(flag: str, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(flag, value, "a tuple of strings")


@dataclass(frozen=True)
class ModelConfig:
    """Which model, in what dtype, on what device, and how it executes."""

    name_or_path: str | None = param(
        None,
        help="a named model (smollm2-135m-instruct, qwen2.5-coder-0.5b: see --list), a local .gguf file, an "
        "HF model directory or hub id; tiny-random: a tiny random Llama (smoke runs); default: "
        "smollm2-135m-instruct",
        flag="--model",
        metavar="MODEL",
    )
    dtype: Literal["float32", "float16", "bfloat16", "float64", "auto"] = param(
        "auto",
        help="auto (bfloat16 on CUDA, where greedy outputs may differ from plain decoding at near-ties; "
        "float32 on CPU, exact), float32, float16, bfloat16 or float64",
    )
    device: str = param("auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    device_map: str = param(
        "",
        help="split one model across devices, for a model larger than one GPU: auto (accelerate's "
        "balanced placement over the GPUs, then the CPU) or DEVICE[=BLOCKS],... (cuda:0=20,cuda:1: 20 "
        "blocks on cuda:0, the rest on cuda:1; no counts: an even split). Each block's KV cache lives "
        "with it. Default: the whole model on --device",
        metavar="MAP",
    )
    kernels: bool = param(
        True, help="the batch-invariant CPU kernels (framework.kernels.cpu) for float32 on CPU"
    )
    exact: bool | None = param(
        None,
        help="exact mode (--exact, --no-exact; unset: auto, on for a CPU with the kernels, off for CUDA): "
        "plain steps and verifications compute every row the same way, so greedy speculative output "
        "equals our plain greedy output token for token in float32 and bfloat16. On a CPU it is the "
        "batch-invariant kernels (float32 runs them whatever this says; a bfloat16 model streams its "
        "weights through them and keeps its KV cache in float32); float16 has none. On CUDA every "
        "attention runs SDPA's memory-efficient backend, which cost 7.8% a step of SmolLM2 on an "
        "H200 (docs/performance.md)",
    )
    phase_timing: Literal["auto", "on", "off"] = param(
        "auto",
        help="time each phase of a round and the LM head in the records: on, off, or auto (on for a CPU; "
        "off for CUDA, where every phase boundary waits for the device, about ten times a round)",
    )
    cuda_graphs: bool = param(
        False,
        help="run every forward of up to 64 tokens after the prefill (draft steps, plain steps, chain "
        "and tree verifications) through CUDA graphs of each attention and MLP branch "
        "(framework.engine.execution.branches; CUDA only): about 2x faster plain decoding on a 7B model at "
        "batch 1 (docs/performance.md)",
    )

    cuda_graph_route: Literal["forward", "branch"] = param(
        "forward",
        help="what one CUDA graph holds with --cuda-graphs: forward (one graph per whole forward, "
        "embedding to LM head, framework.engine.execution.forward_graph; forwards it cannot take, such as scratch "
        "passes, use branches) or branch (one graph per attention or MLP branch, "
        "framework.engine.execution.branches). On an H200 one graph of a SmolLM2-shaped step took 3.20 ms where "
        "per-block graphs took 3.80 (docs/performance.md)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError("--dtype", self.dtype, f"one of {', '.join(DTYPE_NAMES)}")
        if self.phase_timing not in PHASE_TIMING:
            raise ConfigError("--phase-timing", self.phase_timing, f"one of {', '.join(PHASE_TIMING)}")
        if self.cuda_graph_route not in ("forward", "branch"):
            raise ConfigError("--cuda-graph-route", self.cuda_graph_route, "forward or branch")
        if self.exact is not None:
            _check_bools((("--exact", self.exact),))
        if self.exact and self.kernels is False:
            raise ConfigError(
                "--exact", True, "unset or off with --no-kernels (a CPU's exact mode is the kernels)"
            )
        if self.exact and self.device_map:
            raise ConfigError(
                "--exact", True, "unset or off with --device-map (exact mode serves one device)"
            )
        _check_bools((("--kernels", self.kernels), ("--cuda-graphs", self.cuda_graphs)))
        if not isinstance(self.device_map, str):
            raise ConfigError("--device-map", self.device_map, "auto or DEVICE[=BLOCKS],...")
        if self.device_map and self.device_map != "auto":
            try:  # the syntax now; the block counts once the model's depth is known
                BlockPlacement.parse(self.device_map, 1 << 20)
            except ValueError as err:
                raise ConfigError(
                    "--device-map", self.device_map, f"auto or DEVICE[=BLOCKS],... ({err})"
                ) from None
        if self.device_map and self.cuda_graphs:
            raise ConfigError("--cuda-graphs", True, "off with --device-map (CUDA graphs serve one device)")

    def exact_on(self, device: torch.device) -> bool:
        """Whether exact mode is on for a model on ``device``: ``--exact``; unset (auto), on a CPU
        with the kernels and the whole model on it."""
        if self.exact is None:
            return device.type == "cpu" and self.kernels and not self.device_map
        return self.exact

    @property
    def phase_timing_flag(self) -> bool | None:
        """``--phase-timing`` for the decoders and the adapter: ``None`` (auto), ``True`` or ``False``."""
        return {"auto": None, "on": True, "off": False}[self.phase_timing]


@dataclass(frozen=True)
class MethodConfig:
    """The method: the four strategies, the draft gate around the length controller, its name."""

    selector: StrategySpec = strategy_field(
        "selector",
        "static",
        help="the layer selector",
        field_aliases={
            "--skip-set": "skip_set",
            "--calib-data": "calib_data",
            "--calib-limit": "calib_limit",
        },
    )
    length: StrategySpec = strategy_field("length", "confidence", help="the draft-length controller")
    drafter: StrategySpec = strategy_field("drafter", "layer_skip", help="the drafter")
    verifier: StrategySpec = strategy_field("verifier", "greedy", help="the verifier")
    gate: GateConfig = field(
        default_factory=GateConfig,
        metadata={"help": "the draft gate around the length controller (framework.drafting.gate)"},
    )
    name: str | None = param(None, help="method name in the results (default <selector>+<length>)")
    baseline_only: bool = param(False, help="decode with the vanilla baseline only (the `vanilla` preset)")
    imports: tuple[str, ...] = param(
        (),
        help="a module that registers strategies of your own, imported before the configuration is read "
        "(repeatable); saved configurations and metadata record each with a hash of its source, and "
        "--config imports them again",
        flag="--import",
        metavar="MODULE",
        repeat=True,
    )
    synthetic_acceptance: float | None = param(
        None,
        help="measure the system, not the model: accept each draft token with probability P from a "
        "seeded stream, whatever the target says (framework.engine.synthetic). The output is NOT the "
        "model's: the label says @synthetic-P, records synthetic_acceptance, equality checks and "
        "Spec-Bench answer files are refused; a chain verifier (greedy, sampling) only",
        metavar="P",
    )

    def __post_init__(self) -> None:
        for kind in REGISTRIES:
            spec = getattr(self, kind)
            if not isinstance(spec, StrategySpec):
                raise ConfigError(f"--{kind}", spec, "a StrategySpec")
        if not isinstance(self.gate, GateConfig):
            raise ConfigError("--gate", self.gate, "a GateConfig")
        _check_bools((("--baseline-only", self.baseline_only),))
        _check_strings("--import", self.imports)
        if self.name == "vanilla" and not self.baseline_only:
            raise ConfigError("--name", self.name, "a name other than 'vanilla' (the baseline's name)")
        if self.synthetic_acceptance is not None:
            check_range("--synthetic-acceptance", self.synthetic_acceptance, 0.0, 1.0)
            if self.baseline_only:
                raise ConfigError(
                    "--synthetic-acceptance", self.synthetic_acceptance, "unset for the vanilla baseline"
                )
            if self.verifier.name == "tree":
                raise ConfigError(
                    "--synthetic-acceptance",
                    self.synthetic_acceptance,
                    "used with a chain verifier (greedy, sampling)",
                )

    @property
    def label(self) -> str:
        """The method's name in records and tables: ``vanilla`` for the baseline alone, ``name``,
        else ``<selector>+<length>``."""
        if self.baseline_only:
            return "vanilla"
        label = self.name or f"{self.selector.name}+{self.length.name}"
        if self.synthetic_acceptance is not None:
            return synthetic_label(label, self.synthetic_acceptance)
        return label

    def strategies(self) -> dict[str, StrategySpec]:
        """The four strategies by kind."""
        return {kind: getattr(self, kind) for kind in REGISTRIES}

    def settings(self) -> dict[str, Any]:
        """What the method runs, for a run's metadata: each strategy's name and config and the
        gate (``{"baseline_only": True}``: plain decoding)."""
        if self.baseline_only:
            return {"baseline_only": True}
        out: dict[str, Any] = {kind: spec.describe() for kind, spec in self.strategies().items()}
        out["gate"] = dataclasses.asdict(self.gate)
        return out


@dataclass(frozen=True)
class DataConfig:
    """The prompts."""

    path: str | None = param(
        None, help="Spec-Bench-format JSONL; default: the built-in suite", flag="--data", metavar="DATA"
    )
    categories: tuple[str, ...] = param((), help="comma-separated categories to keep (e.g. mt_bench,qa)")
    limit: int | None = param(
        None,
        help="at most N prompts per category (so --limit 1 decodes one prompt of each category: 7 on "
        "the built-in suite, 6 on Spec-Bench's question.jsonl, whose eight MT-Bench categories are one, "
        "mt_bench)",
    )
    offset: int = param(
        0,
        help="skip the first N prompts of each category (file order) before --limit counts: prompts "
        "a configuration was not tuned on",
    )

    def __post_init__(self) -> None:
        if self.limit is not None:
            check_range("--limit", self.limit, 1, integer=True)
        check_range("--offset", self.offset, 0, integer=True)
        _check_strings("--categories", self.categories)


@dataclass(frozen=True)
class GenerationConfig:
    """What one generation may do."""

    max_new_tokens: int = param(128, help="new tokens per turn; >= 1", metavar="N")
    stop_strings: tuple[str, ...] = param(
        (), help="an extra string that ends a turn", flag="--stop", metavar="STRING", repeat=True
    )
    seed: int = param(0, help="torch seed")
    repetition_penalty: float = param(
        1.0, help="transformers' repetition penalty on every token already in the context (1.0: off); > 0"
    )
    no_repeat_ngram_size: int = param(0, help="never repeat an n-gram of this size (0: off)", metavar="N")
    min_new_tokens: int = param(
        0, help="no end-of-sequence token before this many new tokens (0: off)", metavar="N"
    )
    bad_words: tuple[str, ...] = param(
        (),
        help="a word never generated (its tokens as a sequence)",
        flag="--bad-word",
        metavar="WORD",
        repeat=True,
    )
    suppress_tokens: tuple[int, ...] = param(
        (), help="comma-separated token ids never generated", metavar="IDS"
    )
    begin_suppress_tokens: tuple[int, ...] = param(
        (), help="comma-separated token ids never generated first", metavar="IDS"
    )
    eos_token_ids: tuple[int, ...] = param(
        (), help="comma-separated token ids that also end a turn (besides EOS and end-of-turn)", metavar="IDS"
    )
    json_schema: str | None = param(
        None,
        help="answers match this JSON schema (a file), through the grammar engine llguidance (the "
        "'grammar' extra); a prompt's own json_schema wins",
        metavar="FILE",
    )
    regex: str | None = param(
        None, help="answers match this regular expression (llguidance)", metavar="PATTERN"
    )
    grammar: str | None = param(
        None,
        help="answers match this grammar (a file in llguidance's Lark syntax, an EBNF; a .gbnf file is "
        "llama.cpp's GBNF, converted)",
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        check_range("--max-new-tokens", self.max_new_tokens, 1, integer=True)
        check_range("--seed", self.seed, integer=True)
        _check_strings("--stop", self.stop_strings)
        check_range("--repetition-penalty", self.repetition_penalty, 0.0, lo_open=True)
        check_range("--no-repeat-ngram-size", self.no_repeat_ngram_size, 0, integer=True)
        check_range("--min-new-tokens", self.min_new_tokens, 0, integer=True)
        _check_strings("--bad-word", self.bad_words)
        for flag in ("suppress_tokens", "begin_suppress_tokens", "eos_token_ids"):
            for t in getattr(self, flag):
                check_range("--" + flag.replace("_", "-"), t, 0, integer=True)
        given = [f for f in ("json_schema", "regex", "grammar") if getattr(self, f) is not None]
        if len(given) > 1:
            raise ConfigError(
                "--" + given[1].replace("_", "-"),
                getattr(self, given[1]),
                f"one grammar per run (--{given[0].replace('_', '-')} is given too)",
            )
        for f in ("json_schema", "grammar"):
            value = getattr(self, f)
            if value is not None and not Path(value).is_file():
                raise ConfigError("--" + f.replace("_", "-"), value, "an existing file")

    def grammar_spec(self) -> Any:
        """The run's `framework.engine.grammar.Grammar`, or ``None``."""
        if self.json_schema is not None:
            return Grammar.from_file(self.json_schema, "json_schema")
        if self.regex is not None:
            return Grammar.regex(self.regex)
        if self.grammar is not None:
            return Grammar.from_file(self.grammar, "lark")
        return None


@dataclass(frozen=True)
class RunnerConfig:
    """How the runner executes and records a run."""

    output: str | None = param(
        None,
        help="where the results go: run.py a JSONL file (appended; default runs/<method>-<time>.jsonl), "
        "bench.py a folder (default runs/bench-<time>)",
        aliases=("--out",),
        metavar="PATH",
    )
    specbench_answers: str = param(
        "",
        help="also write Spec-Bench answer files (one per method, vanilla.jsonl the baseline) into DIR at "
        "the end, for Spec-Bench's evaluation/speed.py and equal.py; default: off",
        metavar="DIR",
    )
    warmup: int = param(1, help="warm-up generations per method before timing")
    threads: int | None = param(None, help="torch CPU threads (default: torch's choice)")
    logger: Literal["wandb", "csv", "none"] = param(
        "wandb", help="wandb (offline without an API key; upload later with `wandb sync`), csv or none"
    )
    wandb_project: str = param("selfspec", help="W&B project of --logger wandb")
    plots: bool = param(True, help="save PNG plots in the run directory (and log them)")
    resume: bool = param(False, help="skip prompts already in --output (same configuration only)")
    devices: int = param(1, help="processes per node (GPUs, or CPU processes); > 1 splits the prompts (DDP)")
    num_nodes: int = param(1, help="nodes of a multi-node run (Lightning's DDP environment)")

    def __post_init__(self) -> None:
        if self.logger not in LOGGERS:
            raise ConfigError("--logger", self.logger, f"one of {', '.join(LOGGERS)}")
        check_range("--warmup", self.warmup, 0, integer=True)
        if self.threads is not None:
            check_range("--threads", self.threads, 1, integer=True)
        check_range("--devices", self.devices, 1, integer=True)
        check_range("--num-nodes", self.num_nodes, 1, integer=True)
        _check_bools((("--plots", self.plots), ("--resume", self.resume)))
        if not isinstance(self.specbench_answers, str) or (
            self.specbench_answers and not self.specbench_answers.strip()
        ):
            raise ConfigError("--specbench-answers", self.specbench_answers, "a directory path, or '' (off)")


#: The sections of a `RunConfig`, by field name.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "method": MethodConfig,
    "data": DataConfig,
    "generation": GenerationConfig,
    "runner": RunnerConfig,
    "compare": CompareConfig,
}


def _section(name: str, help: str) -> Any:  # noqa: A002
    return field(default_factory=SECTIONS[name], metadata={"help": help, "section": True})


@dataclass(frozen=True)
class RunConfig:
    """Everything one experiment needs, in five sections (see the module docstring for building
    one): ``model``, ``method``, ``data``, ``generation`` and ``runner``."""

    model: ModelConfig = _section("model", "the model and how it executes")
    method: MethodConfig = _section("method", "the four strategies and the draft gate")
    data: DataConfig = _section("data", "the prompts")
    generation: GenerationConfig = _section("generation", "one generation's budget and stops")
    runner: RunnerConfig = _section("runner", "how the runner executes and records the run")
    compare: CompareConfig = _section("compare", "the methods compared (bench.py) and their pricing")

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"--{name}", getattr(self, name), f"a {cls.__name__}")
        if self.model.device_map and self.runner.devices * self.runner.num_nodes > 1:
            raise ConfigError(
                "--device-map",
                self.model.device_map,
                "used with one process (--devices 1): it splits one model across devices; --devices N "
                "runs N whole copies",
            )
        if self.method.synthetic_acceptance is not None and self.runner.specbench_answers:
            raise ConfigError(
                "--specbench-answers",
                self.runner.specbench_answers,
                "off with --synthetic-acceptance (its output is not the model's: no answer files)",
            )
        if self.model.device.startswith("cuda:") and self.runner.devices * self.runner.num_nodes > 1:
            raise ConfigError(
                "--device",
                self.model.device,
                "auto or cuda with --devices > 1 (cuda:N names one GPU; --devices N uses GPUs 0..N-1)",
            )

    def for_rank(self, device: str, dtype: str | None = None) -> RunConfig:
        """This process's own configuration in a run of several (``--devices``/``--num-nodes``):
        the device the trainer gave the rank (``cuda:r``, or ``cpu``), one process, and the dtype
        ``auto`` resolved for that device (``dtype``, from
        `framework.models.loading.resolve_dtype`; ``None`` keeps the configured one).

        The user's ``--device cuda:N`` with ``--devices > 1`` is refused (one GPU cannot host
        several processes); a rank's ``cuda:r`` comes from the trainer, not from the user, and is
        valid because the rank's configuration describes that one process.
        """
        model = dataclasses.replace(self.model, device=device, dtype=dtype or self.model.dtype)
        runner = dataclasses.replace(self.runner, devices=1, num_nodes=1)
        return dataclasses.replace(self, model=model, runner=runner)

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name_or_path: str | None = None, /, **overrides: Any) -> RunConfig:
        """The config of a shipped preset (``"swift"``) or a preset YAML file, with overrides.

        Args:
            name_or_path: a preset name (``framework/session/assets/presets/<name>.yaml``), a
                YAML path, or ``None`` for the defaults.
            **overrides: flat names and dotted keys, see the module docstring
                (``max_new_tokens=64``, ``selector="static"``, ``**{"selector.skip_ratio": 0.3}``,
                ``**{"gate.enabled": True}``).

        Raises:
            ConfigError: a bad preset, an unknown key, a value that does not parse or is out of
                range, a strategy name that is not registered (the message names the flag).
        """
        draft = _ov().draft_of(cls())
        if name_or_path is not None:
            preset = load_preset(name_or_path)
            base: dict[str, Any] = {"name": preset["name"], "baseline_only": preset["baseline_only"]}
            for key in (*REGISTRIES, *_ov().NESTED):  # a preset file's blocks, as dotted keys
                base.update({f"{key}.{k}": v for k, v in preset.get(key, {}).items()})
            try:  # the preset alone first: an error in it names the file, not a flag
                _ov().apply(draft, base)
                _ov().build(draft)
            except ConfigError as err:
                where = preset_path(name_or_path)
                where_text = where.name if where.parent == PRESET_DIR else str(where)
                raise err.with_flag(f"{where_text}: {str(err.field).lstrip('-')}") from None
        _ov().apply(draft, overrides)
        return _ov().build(draft)

    @classmethod
    def of(cls, **overrides: Any) -> RunConfig:
        """The defaults with ``overrides`` (``RunConfig.of(max_new_tokens=32, dtype="float64")``)."""
        return cls.from_preset(None, **overrides)

    def replace(self, **overrides: Any) -> RunConfig:
        """A copy with ``overrides`` applied, with the rules of `from_preset`."""
        draft = _ov().draft_of(self)
        _ov().apply(draft, overrides)
        return _ov().build(draft)

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict by section (JSON/YAML-able): ``{"model": {...}, "method":
        {"selector": {"name": ..., <field>: <value>, ...}, ..., "gate": {...}, ...}, ...}``; tuples
        become lists. `from_dict` inverts it."""
        ov, out = _ov(), {}
        for name in SECTIONS:
            section = getattr(self, name)
            out[name] = {}
            for f in dataclasses.fields(section):
                value = getattr(section, f.name)
                if isinstance(value, StrategySpec):
                    fields = ov.fields_of(ov.config_of(f.name, value))
                    out[name][f.name] = {"name": value.name, **ov.plain(fields)}
                elif name == "method" and f.name == "imports":  # with the hash of each source
                    out[name][f.name] = recorded_imports(value)
                else:
                    out[name][f.name] = ov.plain(value)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """The config `to_dict` wrote (keys left out keep their defaults); a flat dict of override
        keys (a config saved before the sections) is read too.

        Raises:
            ConfigError: not a mapping, an unknown key, or an invalid value (named as its flag).
        """
        if not isinstance(data, Mapping):
            raise ConfigError("--config", data, "a mapping of RunConfig sections")
        keys: dict[str, Any] = {}
        for key, value in data.items():  # the file's nesting, as dotted keys
            block = key in SECTIONS or key in REGISTRIES or key in _ov().NESTED
            if block and isinstance(value, Mapping):
                for sub, v in value.items():
                    nested = (
                        key == "method" and sub in (*REGISTRIES, *_ov().NESTED) and isinstance(v, Mapping)
                    )
                    keys.update({f"{sub}.{k}": x for k, x in v.items()} if nested else {f"{key}.{sub}": v})
            else:
                keys[key] = value
        return cls.from_preset(None, **keys)

    def save(self, path: str | Path) -> Path:
        """Write `to_dict` as YAML (JSON when ``path`` ends in ``.json``); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        if path.suffix == ".json":
            path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        else:
            path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """A config written by `save` (YAML or JSON).

        Raises:
            ConfigError: a missing or unreadable file, or invalid contents (named as their flags).
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", str(path), "a saved RunConfig file (YAML or JSON)")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ConfigError("--config", str(path), f"valid YAML or JSON ({yaml_problem(err)})") from None
        return cls.from_dict(data)

    # ---- reading ----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The run's metadata form (``.meta.json``, logger config, the ``--resume`` check): every
        field flat by its override key (``model``, ``max_new_tokens``, ...), each strategy as
        ``{"name", "config"}``, the gate as a dict."""
        out: dict[str, Any] = {}
        for key, (section, name) in _ov().FLAT_KEYS.items():
            value = getattr(getattr(self, section), name)
            out[key] = list(value) if isinstance(value, tuple) else value
        method = self.method
        out["imports"] = recorded_imports(method.imports)
        out.update({kind: spec.describe() for kind, spec in method.strategies().items()})
        out["gate"] = dataclasses.asdict(method.gate)
        return out


def _ov() -> Any:
    """The override rules (`framework.session.overrides`), imported when first used: that module
    builds on this one's sections."""
    from framework.session import overrides

    return overrides


def __getattr__(name: str) -> Any:  # FLAT_KEYS and section_of live with the override rules
    if name in ("FLAT_KEYS", "section_of"):
        return getattr(_ov(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DTYPE_NAMES",
    "LOGGERS",
    "SECTIONS",
    "DataConfig",
    "GenerationConfig",
    "MethodConfig",
    "ModelConfig",
    "RunConfig",
    "RunnerConfig",
    "StrategySpec",
    "UnknownStrategyError",
    "strategy_field",
]
