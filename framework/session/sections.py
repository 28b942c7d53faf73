"""The sections of a run's configuration (`framework.session.run_config.RunConfig` holds one of
each; the override rules and the file formats are there):

- `ModelConfig` (``cfg.model``): which model, in what dtype, on what device, and how it executes
  (CPU kernels, CUDA graphs, phase timing);
- `MethodConfig` (``cfg.method``): the four strategies, the draft gate, the method's name;
- `DataConfig` (``cfg.data``): the prompts;
- `GenerationConfig` (``cfg.generation``): what one generation may do (token budget, stop
  strings, seed);
- `RunnerConfig` (``cfg.runner``): how the runner executes and records a run (output, W&B,
  warm-up, threads, processes, ``--resume``);
- `CompareConfig` (``cfg.compare``): the methods a run compares (``bench.py``) and their pricing;
  how the names resolve is `framework.session.methods`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from framework.config_fields import ConfigError, check_range, check_types, literal_alias, param
from framework.drafting.gate import GateConfig
from framework.engine.grammar import Grammar
from framework.engine.placement import BlockPlacement
from framework.engine.synthetic import synthetic_label
from framework.interfaces import REGISTRIES
from framework.registry import UnknownNameError

if TYPE_CHECKING:
    import torch

#: Values of ``--logger``.
LOGGERS = ("wandb", "csv", "none")
#: Values of ``--dtype`` (``framework.models.loading.DTYPES`` maps them to torch dtypes).
#: ``auto`` is resolved where the device is (`framework.models.loading.resolve_dtype`): bfloat16 on
#: CUDA, float32 on CPU.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "auto")


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy name and its (validated) config object (``None``: its defaults)."""

    name: str
    config: Any = None

    def build(self, kind: str, seed: int = 0):
        """A fresh instance of the strategy, from the ``kind`` registry. ``seed`` (the run's
        ``--seed``) offsets the config's own ``seed`` where it has one (a sampling verifier's
        stream, a selector's search), so that ``--seed`` reaches every random stream of the run;
        ``0`` leaves the strategy's own seed as it is."""
        cls = REGISTRIES[kind].get(self.name)
        config = self.config if self.config is not None else cls.Config()
        seeded = dataclasses.is_dataclass(config) and "seed" in {f.name for f in dataclasses.fields(config)}
        if seed and seeded:
            own = config.seed
            try:
                config = dataclasses.replace(config, seed=own + seed)
            except ValueError as err:
                raise ConfigError(
                    "--seed", seed, f"a seed that {kind} {self.name}'s seed {own} admits ({err})"
                ) from None
        return cls(config)

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


def _check_nonempty(flag: str, value: tuple[str, ...]) -> None:
    for v in value:
        if not v:  # an empty stop string would end every turn at once; an empty word bans nothing
            raise ConfigError(flag, v, "a non-empty string")


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
        "float32 on CPU, exact), float32, float16, bfloat16 or float64 (bf16, fp16, fp32, fp64 too)",
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
        object.__setattr__(self, "dtype", literal_alias(self.dtype, DTYPE_NAMES))  # bf16: bfloat16
        check_types(self, flags=True)
        if self.exact and self.kernels is False:
            raise ConfigError(
                "--exact", True, "unset or off with --no-kernels (a CPU's exact mode is the kernels)"
            )
        if self.exact and self.device_map:
            raise ConfigError(
                "--exact", True, "unset or off with --device-map (exact mode serves one device)"
            )
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
        check_types(self, flags=True)
        _check_nonempty("--import", self.imports)
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
        check_types(self, flags=True)
        if self.limit is not None:
            check_range("--limit", self.limit, 1, integer=True)
        check_range("--offset", self.offset, 0, integer=True)
        _check_nonempty("--categories", self.categories)


@dataclass(frozen=True)
class GenerationConfig:
    """What one generation may do."""

    max_new_tokens: int = param(128, help="new tokens per turn; >= 1", metavar="N")
    stop_strings: tuple[str, ...] = param(
        (), help="an extra string that ends a turn", flag="--stop", metavar="STRING", repeat=True
    )
    seed: int = param(
        0,
        help="seeds Python's, NumPy's and torch's generators at the start and the synthetic acceptance, "
        "and is added to every strategy's own seed (a sampling verifier's stream, SWIFT's and "
        "Self-SD's searches); 0 leaves those at their defaults",
    )
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
        help="answers match this JSON schema (a file), through the grammar engine llguidance; a "
        "prompt's own json_schema wins",
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
        check_types(self, flags=True)
        check_range("--max-new-tokens", self.max_new_tokens, 1, integer=True)
        check_range("--seed", self.seed, integer=True)
        _check_nonempty("--stop", self.stop_strings)
        check_range("--repetition-penalty", self.repetition_penalty, 0.0, lo_open=True)
        check_range("--no-repeat-ngram-size", self.no_repeat_ngram_size, 0, integer=True)
        check_range("--min-new-tokens", self.min_new_tokens, 0, integer=True)
        _check_nonempty("--bad-word", self.bad_words)
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
        help="where the results go: run.py a JSONL file (default runs/<method>-<time>.jsonl), bench.py a "
        "folder (default runs/bench-<time>); one that already holds records needs --resume",
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
    threads: int | None = param(
        None,
        help="torch CPU threads (default: torch's choice, fewer when other processes keep cores busy: one "
        "thread per free core)",
    )
    logger: Literal["wandb", "csv", "none"] = param(
        "wandb", help="wandb (offline without an API key; upload later with `wandb sync`), csv or none"
    )
    wandb_project: str = param("selfspec", help="W&B project of --logger wandb")
    plots: bool = param(True, help="save PNG plots in the run directory (and log them)")
    resume: bool = param(False, help="skip prompts already in --output (same configuration only)")
    devices: int = param(1, help="processes per node (GPUs, or CPU processes); > 1 splits the prompts (DDP)")
    num_nodes: int = param(1, help="nodes of a multi-node run (Lightning's DDP environment)")

    def __post_init__(self) -> None:
        check_types(self, flags=True)
        check_range("--warmup", self.warmup, 0, integer=True)
        if self.threads is not None:
            check_range("--threads", self.threads, 1, integer=True)
        check_range("--devices", self.devices, 1, integer=True)
        check_range("--num-nodes", self.num_nodes, 1, integer=True)
        if self.specbench_answers and not self.specbench_answers.strip():
            raise ConfigError("--specbench-answers", self.specbench_answers, "a directory path, or '' (off)")


BASELINE = "vanilla"
#: The Hugging Face ``generate`` methods and what they run (`framework.benchmark.hf`).
HF_METHODS: dict[str, str] = {
    "hf_generate": "transformers model.generate, greedy",
    "hf_prompt_lookup": "model.generate with prompt_lookup_num_tokens (prompt lookup decoding)",
    "hf_early_exit": "model.generate with assistant_early_exit (the first E layers draft)",
}
#: What ``bench.py`` shows (README command 1): this framework's default layer-skip method with its
#: draft gate, the same with the gate off, and the hybrid drafter.
DEFAULT_METHODS = ("vanilla", "static_confidence", "static_confidence:raw", "hybrid")
#: The label suffix of a preset's gate-off companion (``--raw``).
RAW_SUFFIX = ":raw"


@dataclass(frozen=True)
class MethodSpec:
    """A method of a run: ``kind`` is ``baseline``, ``hf``, ``preset`` or ``custom``; ``source``
    the preset name or YAML path, or a method section (a `MethodConfig` given in Python); ``raw``:
    the gate-off companion of a gated preset."""

    label: str
    kind: str
    source: Any = ""
    raw: bool = False


@dataclass(frozen=True)
class CompareConfig:
    """The methods a run compares and what comparing them needs (``bench.py``'s options)."""

    methods: tuple[Any, ...] = param(
        (),
        help="comma-separated: vanilla, hf_generate, hf_prompt_lookup, hf_early_exit, any preset, a gated "
        "preset with ':raw' (its gate off), or preset YAML files; in Python also method sections "
        "(MethodConfig, named by their label); empty: vanilla and the method section (run.py)",
    )
    raw: bool = param(
        False,
        help="also run every preset whose draft gate is on with the gate off, as a '<method>:raw' row: "
        "the method's own alpha, M and speedup where the gate would decline",
    )
    repeats: int = param(1, help="repetitions of the whole interleaved run")
    preset_args: tuple[tuple[str, Any], ...] = param(
        (),
        help="(method, overrides) pairs: RunConfig overrides for one preset ({'selector.skip_ratio': 0.3}), "
        "or run.py flags, METHOD=FLAGS, e.g. 'swift=--selector.skip_ratio 0.3' (repeatable)",
    )
    skip_set: str | None = param(None, help="skip-set file for presets whose selector takes one (selfsd)")
    cost_model: str = param(
        "measure",
        help="'measure' (after the warm-up; saved as cost_model.json beside the results), 'none', or a "
        "CostModel / selfsd skip-set JSON file; prices each method's rounds in the report",
    )
    prompt_lookup_num_tokens: int = param(10, help="hf_prompt_lookup's candidate tokens per lookup")
    max_matching_ngram_size: int | None = param(None, help="hf_prompt_lookup's n-gram size (HF default 2)")
    early_exit_layer: int | None = param(None, help="hf_early_exit's layer E (default round(0.8 L))")
    hf_kernels: bool = param(
        False,
        help="run the HF methods with this framework's CPU kernels too (default: stock PyTorch, as users "
        "run them)",
    )
    synthetic: float | None = param(
        None,
        flag="--synthetic-acceptance",
        metavar="P",
        help="every preset method accepts each drafted token with probability P instead of the model's "
        "(run.py's --synthetic-acceptance, for all of them: their speed at one forced acceptance; their "
        "outputs are not the model's, so no equality check)",
    )
    command: str = param("", help="the command line, for the report")

    def __post_init__(self) -> None:
        check_types(self, flags=True)
        check_range("--repeats", self.repeats, 1, integer=True)
        if self.synthetic is not None:
            check_range("--synthetic-acceptance", self.synthetic, 0.0, 1.0)
        check_range("--prompt-lookup-num-tokens", self.prompt_lookup_num_tokens, 1, integer=True)
        for flag, val in (
            ("--max-matching-ngram-size", self.max_matching_ngram_size),
            ("--early-exit-layer", self.early_exit_layer),
        ):
            if val is not None:
                check_range(flag, val, 1, integer=True)
        if not self.methods and (self.raw or self.preset_args):
            raise ConfigError("--raw" if self.raw else "--preset-args", True, "used with --methods")


#: The sections of a `RunConfig`, by field name.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "method": MethodConfig,
    "data": DataConfig,
    "generation": GenerationConfig,
    "runner": RunnerConfig,
    "compare": CompareConfig,
}
