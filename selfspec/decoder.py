"""`Decoder`: self-speculative decoding from Python, without the command line.

The CLI (``experiments/run.py``), the benchmark and sweeps build the same objects this class
builds: a `RunConfig` (from a preset and overrides), an `Experiment` (the model, its tokenizer and
both decoders) and, for a comparison, the interleaved timing protocol of
`framework.results.compare`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.config import ConfigError
from framework.data.prompts import encode_chat
from framework.engine.decoding import GenerationResult
from framework.interfaces import Strategy
from framework.results.compare import Method, compare_methods, warm_up
from framework.session.config import GenerationConfig, MethodConfig, ModelConfig, RunConfig, section_of
from framework.session.experiment import Experiment
from framework.types import LayerPlan

#: The `RunConfig` sections a `Decoder` takes.
DECODER_SECTIONS = ("model", "method", "generation")

#: What a prompt may be: a user message, a chat (a list of ``{"role", "content"}`` messages), or
#: the token ids of an already formatted prompt.
PromptLike = str | Sequence[Mapping[str, str]] | Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class GenerationStats:
    """What one generation did, in the papers' terms.

    Attributes:
        new_tokens: tokens generated.
        wall_time: seconds, prefill included.
        tokens_per_s: ``new_tokens / wall_time``.
        mean_accepted_length: M, tokens committed per target forward (bonus included).
        acceptance_rate: alpha, accepted draft tokens / drafted tokens.
        rounds: verification rounds.
        drafted: draft tokens proposed; ``accepted`` of them were accepted.
        phase_times: seconds per phase (prefill, select, draft, verify, length, commit, lm_head).
        plans: per drafting round, the `LayerPlan` the draft ran.
        draft_lengths: tokens drafted per round (0: the round declined to draft).
        accept_lengths: tokens committed per round.
        stop_reason: ``"eos"``, ``"stop_string"`` or ``"max_new_tokens"``.
        strategies: each strategy's own summary (``Strategy.summary()``), by kind.
    """

    new_tokens: int
    wall_time: float
    tokens_per_s: float
    mean_accepted_length: float
    acceptance_rate: float
    rounds: int
    drafted: int
    accepted: int
    phase_times: dict[str, float]
    plans: tuple[LayerPlan, ...]
    draft_lengths: tuple[int, ...]
    accept_lengths: tuple[int, ...]
    stop_reason: str
    strategies: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, res: GenerationResult) -> GenerationStats:
        codes: dict[str, LayerPlan] = {}
        plans = tuple(codes.setdefault(c, LayerPlan.from_code(c)) for c in res.plans)
        return cls(
            new_tokens=res.new_tokens,
            wall_time=res.wall_time,
            tokens_per_s=res.tokens_per_second,
            mean_accepted_length=res.mean_accepted_length,
            acceptance_rate=res.acceptance_rate,
            rounds=len(res.accept_lengths),
            drafted=res.drafted,
            accepted=res.accepted,
            phase_times=dict(res.timings),
            plans=plans,
            draft_lengths=tuple(res.draft_lengths),
            accept_lengths=tuple(res.accept_lengths),
            stop_reason=res.stop_reason,
            strategies=dict(res.strategy_summary),
        )


@dataclass(frozen=True)
class Generation:
    """The output of `Decoder.generate`.

    Attributes:
        text: the decoded new text (special tokens removed).
        tokens: the new token ids.
        stats: what the decode did (`GenerationStats`).
        result: the engine's raw `GenerationResult`.
    """

    text: str
    tokens: list[int]
    stats: GenerationStats
    result: GenerationResult


@dataclass(frozen=True)
class Comparison:
    """The output of `Decoder.compare`: one prompt through vanilla decoding and the method.

    Attributes:
        vanilla: the baseline's generation (the last repeat).
        method: the method's generation (the last repeat).
        speedup: mean tokens/s of the method over mean tokens/s of vanilla, over the repeats
            (Spec-Bench's ratio of means).
        lossless: the method's tokens equal vanilla's in every repeat (greedy verifiers), or
            ``None`` for a verifier that is lossless in distribution only (sampling).
        first_mismatch: where the tokens first differed (``{"turn", "position"}``), or ``None``.
        repeats: timed repeats, interleaved.
    """

    vanilla: Generation
    method: Generation
    speedup: float
    lossless: bool | None
    first_mismatch: dict[str, int] | None
    repeats: int

    def __str__(self) -> str:
        m, v = self.method.stats, self.vanilla.stats
        ok = {True: "token-identical", False: "MISMATCH", None: "sampling"}[self.lossless]
        return (
            f"speedup {self.speedup:.3f}x ({m.tokens_per_s:.1f} vs {v.tokens_per_s:.1f} tok/s), "
            f"M {m.mean_accepted_length:.2f}, alpha {m.acceptance_rate:.3f}, {ok}"
        )


StrategyLike = str | type[Strategy] | Strategy


class Decoder:
    """A loaded model and a self-speculative method, ready to generate.

    Build one from a preset (`from_preset`), from strategy names, classes or instances
    (`from_strategies`), or from the three sections of a `RunConfig` it uses: the model, the
    method and the generation (the data and the runner sections are the command line's, not a
    decoder's). Pass ``hf_model`` and ``tokenizer`` to use an already loaded Hugging Face model
    instead of loading ``model.name_or_path``.

    Example:
        >>> import selfspec
        >>> dec = selfspec.Decoder.from_preset("swift", max_new_tokens=64)   # doctest: +SKIP
        >>> out = dec.generate("Explain KV caches in one paragraph.")        # doctest: +SKIP
        >>> out.text, out.stats.mean_accepted_length, out.stats.acceptance_rate  # doctest: +SKIP
        >>> print(dec.compare("Explain KV caches in one paragraph."))        # doctest: +SKIP

    Args:
        model: the model section (which model, dtype, device, kernels, CUDA graphs).
        method: the method section (the four strategies, the gate, the name).
        generation: the generation section (token budget, stop strings, seed).
        hf_model: an already loaded HF causal LM (with ``tokenizer``; both or neither).
        tokenizer: its tokenizer.
        strategies: per kind (``"selector"``, ``"length"``, ``"drafter"``, ``"verifier"``), a
            strategy instance or class to use instead of the config's (a researcher's own
            subclass, registered or not).
        log: progress messages (``None``: silent).
    """

    def __init__(
        self,
        model: ModelConfig | None = None,
        method: MethodConfig | None = None,
        generation: GenerationConfig | None = None,
        *,
        hf_model: Any = None,
        tokenizer: Any = None,
        strategies: Mapping[str, type[Strategy] | Strategy] | None = None,
        log: Any = print,
    ) -> None:
        if (hf_model is None) != (tokenizer is None):
            raise ValueError("pass both hf_model and tokenizer (an already loaded model), or neither")
        cfg = RunConfig(
            model=model or ModelConfig(),
            method=method or MethodConfig(),
            generation=generation or GenerationConfig(),
        )
        self.model_config, self.method, self.generation = cfg.model, cfg.method, cfg.generation
        self.experiment = Experiment(
            cfg, hf_model, tokenizer, log=log or (lambda _msg: None), strategies=strategies
        )

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_preset(
        cls,
        preset: str | None = None,
        /,
        *,
        model: Any = None,
        tokenizer: Any = None,
        strategies: Mapping[str, type[Strategy] | Strategy] | None = None,
        log: Any = print,
        **overrides: Any,
    ) -> Decoder:
        """A published method by its preset name (``"swift"``, ``"clasp"``, ...; see
        ``experiments/run.py --list``) or a preset YAML path, with config overrides.

        Args:
            preset: the preset (``None``: the framework's defaults).
            model: a model name or path (``"smollm2-135m-instruct"``, an HF directory or hub id),
                or an already loaded HF model (then pass ``tokenizer`` too).
            tokenizer: the loaded model's tokenizer.
            strategies: strategy instances or classes that replace the preset's (see `Decoder`).
            log: progress messages (``None``: silent).
            **overrides: `RunConfig.from_preset` overrides of the model, method and generation
                sections: their fields (``max_new_tokens=64``, ``dtype="bfloat16"``), strategies by
                name (``selector="static"``), strategy fields (``selector={"skip_ratio": 0.3}`` or
                ``**{"length.threshold": 0.7}``), the gate (``gate={"enabled": False}``).

        Raises:
            ConfigError: an option of another section (``logger``, ``resume``, ``limit``: a
                decoder neither reads data nor writes or logs a run), or an invalid value.
        """
        for key in overrides:
            section = section_of(key)
            if section not in DECODER_SECTIONS:
                where = f"the {section} section's" if section else "no"
                raise ConfigError(
                    key,
                    overrides[key],
                    f"an option of the model, method or generation sections (it is {where} option; a "
                    "Decoder does not read, write or log a run: experiments/run.py does)",
                )
        loaded = model is not None and not isinstance(model, str)
        if model is not None and not loaded:
            overrides["model"] = model
        cfg = RunConfig.from_preset(preset, **overrides)
        return cls(
            cfg.model,
            cfg.method,
            cfg.generation,
            hf_model=model if loaded else None,
            tokenizer=tokenizer,
            strategies=strategies,
            log=log,
        )

    @classmethod
    def from_strategies(
        cls,
        selector: StrategyLike = "static",
        length: StrategyLike = "confidence",
        drafter: StrategyLike = "layer_skip",
        verifier: StrategyLike = "greedy",
        *,
        model: Any = None,
        tokenizer: Any = None,
        log: Any = print,
        **overrides: Any,
    ) -> Decoder:
        """A method composed of four strategies, each a registered name, a class or an instance.

        Names go into the config (and their fields can be overridden as in `from_preset`:
        ``**{"selector.skip_ratio": 0.3}``); classes are instantiated with their default config;
        instances are used as they are.
        """
        named, given = {}, {}
        for kind, s in (
            ("selector", selector),
            ("length", length),
            ("drafter", drafter),
            ("verifier", verifier),
        ):
            if isinstance(s, str):
                named[kind] = s
            else:
                given[kind] = s
        return cls.from_preset(
            None, model=model, tokenizer=tokenizer, strategies=given or None, log=log, **named, **overrides
        )

    # ---- use ----------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        return self.experiment.model

    @property
    def tokenizer(self) -> Any:
        return self.experiment.tokenizer

    @property
    def strategies(self) -> dict[str, Strategy]:
        """The four strategy instances in use, by kind."""
        return self.experiment.spec.strategies()

    def encode(self, prompt: PromptLike) -> torch.Tensor:
        """LongTensor (1, T) of prompt ids: a user message or a chat goes through the tokenizer's
        chat template; token ids are taken as they are."""
        if isinstance(prompt, torch.Tensor):
            ids = prompt.reshape(1, -1).tolist()[0]
        elif isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt: an empty prompt has nothing to continue")
            ids = encode_chat(self.tokenizer, [{"role": "user", "content": prompt}])
        elif prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)  # type: ignore[arg-type]
        elif prompt and all(isinstance(m, Mapping) for m in prompt):
            ids = encode_chat(self.tokenizer, [dict(m) for m in prompt])  # type: ignore[misc]
        else:
            raise ValueError(
                "prompt must be a non-empty string, a list of {'role', 'content'} messages or a list of "
                f"token ids, got {type(prompt).__name__}"
            )
        return torch.tensor([ids], dtype=torch.long, device=self.experiment.adapter.device)

    def _run(self, decoder: Any, ids: torch.Tensor, max_new_tokens: int | None) -> Generation:
        res = decoder.generate(ids, self.experiment.stop(max_new_tokens))
        return self._generation(res, self.experiment.text(res.tokens))

    @staticmethod
    def _generation(res: GenerationResult, text: str) -> Generation:
        return Generation(text, list(res.tokens), GenerationStats.of(res), res)

    def generate(self, prompt: PromptLike, max_new_tokens: int | None = None) -> Generation:
        """Generate with the method (self-speculative decoding).

        Args:
            prompt: a user message, a chat, or prompt token ids.
            max_new_tokens: the budget (default: the config's ``max_new_tokens``).
        """
        return self._run(self.experiment.spec, self.encode(prompt), max_new_tokens)

    def generate_vanilla(self, prompt: PromptLike, max_new_tokens: int | None = None) -> Generation:
        """Generate with plain autoregressive decoding through the same adapter and cache (the
        baseline every speedup is measured against)."""
        return self._run(self.experiment.vanilla, self.encode(prompt), max_new_tokens)

    def compare(
        self, prompt: PromptLike, max_new_tokens: int | None = None, *, repeats: int = 1, warmup: bool = True
    ) -> Comparison:
        """The same prompt through vanilla decoding and the method, interleaved (the order rotates
        every repeat), after a short warm-up: speedup, and whether the tokens are identical.

        Args:
            prompt: a user message, a chat, or prompt token ids.
            max_new_tokens: the budget (default: the config's).
            repeats: timed repeats (>= 1); the speedup is the ratio of mean tokens/s.
            warmup: decode a few tokens with both first (kernels compiled, caches sized).
        """
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        ids = self.encode(prompt)
        exp = self.experiment
        greedy = exp.spec.verifier.lossless == "greedy"
        methods = [
            Method("vanilla", exp.vanilla, "baseline", greedy),
            Method("method", exp.spec, "method", greedy),
        ]
        if warmup:
            warm_up(methods, lambda m: self._run(m.decoder, ids, min(16, max_new_tokens or 16)))

        def decode(m: Method, ids: torch.Tensor) -> list[tuple[GenerationResult, str]]:
            res = m.decoder.generate(ids, exp.stop(max_new_tokens))
            return [(res, exp.text(res.tokens))]

        tok_s: dict[str, list[float]] = {"vanilla": [], "method": []}
        mismatch = None
        for cmp in compare_methods(methods, [ids] * repeats, decode):
            for name, turns in cmp.results.items():
                tok_s[name].append(turns[0][0].tokens_per_second)
            mismatch = mismatch or cmp.mismatches.get("method")
        runs = {name: self._generation(*turns[0]) for name, turns in cmp.results.items()}
        mean = {k: sum(v) / len(v) for k, v in tok_s.items()}
        return Comparison(
            vanilla=runs["vanilla"],
            method=runs["method"],
            speedup=mean["method"] / mean["vanilla"] if mean["vanilla"] > 0 else float("nan"),
            lossless=(mismatch is None) if greedy else None,
            first_mismatch=mismatch if greedy else None,
            repeats=repeats,
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={s.name or type(s).__name__}" for k, s in self.strategies.items())
        model = self.experiment.adapter.info().name or self.model_config.name_or_path or "(a loaded model)"
        return f"Decoder({self.method.label}: {parts}; model {model})"
