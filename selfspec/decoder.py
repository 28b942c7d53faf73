"""`Decoder`: self-speculative decoding from Python, without the command line.

The CLI (``experiments/run.py``), the benchmark and sweeps build the same objects this class
builds: a `RunConfig` (from a preset and overrides) and a `Session` (the model, its tokenizer and
both decoders). `Decoder.benchmark` runs the pipeline behind ``run.py`` and ``bench.py``
(`framework.runner.pipeline.run`) on a prompt file; `Decoder.compare` times one prompt in memory
with the protocol that pipeline runs per prompt (`framework.results.compare`), writing nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.config_fields import ConfigError
from framework.data.prompts import encode_chat
from framework.engine.batch.decoding import BatchDecoder
from framework.engine.decoding import GenerationResult
from framework.engine.grammar import FLAGS as GRAMMAR_FLAGS
from framework.engine.grammar import Grammar, GrammarError
from framework.interfaces import Strategy
from framework.results.compare import Method, compare_methods, warm_up
from framework.results.metrics import speedup
from framework.runner.pipeline import run as run_pipeline
from framework.session.run_config import GenerationConfig, MethodConfig, ModelConfig, RunConfig, section_of
from framework.session.session import Session
from framework.types import LayerPlan

#: The `RunConfig` sections a `Decoder` takes.
DECODER_SECTIONS = ("model", "method", "generation")

#: What a prompt may be: a user message, a chat (a list of ``{"role", "content"}`` messages), the
#: token ids of an already formatted prompt, or what a tokenizer's ``apply_chat_template`` returns
#: (a ``BatchEncoding`` or a dict with ``input_ids``).
PromptLike = str | Sequence[Mapping[str, str]] | Sequence[int] | torch.Tensor | Mapping[str, Any]


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
        stop_reason: ``"eos"``, ``"stop_string"``, ``"stopping_criteria"`` or ``"max_new_tokens"``.
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
        self.experiment = Session(
            cfg,
            hf_model,
            tokenizer,
            log=log or (lambda _msg: None),
            strategies=strategies,
            progress=log is not None,
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
                sections, in the two spellings of every override: flat names
                (``max_new_tokens=64``, ``dtype="bfloat16"``, a strategy by name:
                ``selector="static"``) and dotted keys (``**{"length.threshold": 0.7,
                "gate.enabled": False}``).

        Raises:
            ConfigError: an option of another section (``logger``, ``resume``, ``limit``: a
                decoder neither reads data nor writes or logs a run), or an invalid value.
        """
        for key in overrides:
            section = section_of(key)
            if section not in DECODER_SECTIONS:
                where = f"the {section} section's" if section else "no"
                close = difflib.get_close_matches(key, decoder_options(), n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]!r}?" if close and not section else ""
                raise ConfigError(
                    key,
                    overrides[key],
                    f"an option of the model, method or generation sections (it is {where} option{hint}; a "
                    "Decoder does not read, write or log a run: experiments/run.py does)",
                )
        loaded = model is not None and not isinstance(model, str)
        if model is not None and not loaded:
            overrides["model"] = model
        try:
            cfg = RunConfig.from_preset(preset, **overrides)
        except ConfigError as err:
            raise pythonic(err) from None
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
        """The four strategy instances in use, by kind (none for the ``vanilla`` preset, which
        decodes plainly)."""
        if self.method.baseline_only:
            return {}
        return self.experiment.spec.strategies()

    def encode(self, prompt: PromptLike) -> torch.Tensor:
        """LongTensor (1, T) of prompt ids: a user message or a chat goes through the tokenizer's
        chat template; token ids are taken as they are, and so is what ``apply_chat_template``
        returns (a string of the formatted prompt, ids, a ``BatchEncoding`` or a dict with
        ``input_ids``, of one row)."""
        prompt = _input_ids(prompt)
        if isinstance(prompt, torch.Tensor):
            ids = prompt.reshape(1, -1).tolist()[0]
        elif isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt: an empty prompt has nothing to continue")
            if _formatted(prompt, self.tokenizer):  # apply_chat_template(..., tokenize=False)
                ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
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
        return torch.tensor([ids], dtype=torch.long, device=self.experiment.adapter.arch.device)

    def _run(
        self,
        decoder: Any,
        ids: torch.Tensor,
        max_new_tokens: int | None,
        streamer: Any = None,
        controls: Mapping[str, Any] | None = None,
    ) -> Generation:
        on_tokens = None
        if streamer is not None:
            streamer.put(ids.detach().cpu())  # as transformers' generate does: the prompt first
            on_tokens = lambda toks: streamer.put(torch.tensor([toks], dtype=torch.long))  # noqa: E731
        try:
            res = decoder.generate(ids, self.experiment.stop(max_new_tokens, on_tokens, **(controls or {})))
        finally:
            if streamer is not None:
                streamer.end()
        return self._generation(res, self.experiment.text(res.tokens))

    @staticmethod
    def _generation(res: GenerationResult, text: str) -> Generation:
        return Generation(text, list(res.tokens), GenerationStats.of(res), res)

    def generate(
        self,
        prompt: PromptLike | Sequence[PromptLike],
        max_new_tokens: int | None = None,
        *,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        generation_config: Any = None,
        streamer: Any = None,
        repetition_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        min_new_tokens: int | None = None,
        bad_words_ids: Sequence[Sequence[int]] | None = None,
        suppress_tokens: Sequence[int] | None = None,
        begin_suppress_tokens: Sequence[int] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        stop_strings: str | Sequence[str] | None = None,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        json_schema: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        batch_size: int = 1,
    ) -> Generation | list[Generation]:
        """Generate with the method (self-speculative decoding), shaped like transformers'
        ``model.generate``.

        Args:
            prompt: a user message, a chat (a list of ``{"role", "content"}`` messages) or prompt
                token ids; or a list of those, the results in the same order, decoded
                ``batch_size`` at a time.
            max_new_tokens: the budget, a positive int (default: the config's, or
                ``generation_config``'s).
            do_sample: sample (speculative sampling, lossless in distribution) instead of greedy
                decoding; default: as the method is configured.
            temperature: the sampling temperature (> 0); needs sampling.
            top_p: nucleus sampling's mass, in (0, 1]; needs sampling.
            top_k: keep the k most likely tokens (0: all); needs sampling.
            seed: seeds the sampler; the method's strategies start afresh too, so two calls with
                the same seed give the same tokens (without it, each call continues the sampler's
                stream).
            generation_config: a transformers ``GenerationConfig`` whose ``max_new_tokens``,
                ``do_sample``, ``temperature``, ``top_p``, ``top_k`` and the processors' settings
                below apply (explicit arguments win); settings this decoder cannot honour (beams,
                several sequences, contrastive search) raise.
            streamer: a transformers-compatible streamer (``put(ids)``, ``end()``; e.g.
                ``TextStreamer``): the prompt ids, then each round's committed tokens.
            repetition_penalty: as in ``generate``. This and the five settings below are built
                with transformers' own processor classes and applied, under speculation, to every
                verified and drafted row with its own prefix (`framework.engine.processing`):
                greedy output equals ``generate``'s with the same settings.
            no_repeat_ngram_size: as in ``generate``.
            min_new_tokens: as in ``generate``.
            bad_words_ids: as in ``generate``.
            suppress_tokens: as in ``generate``.
            begin_suppress_tokens: as in ``generate``.
            eos_token_id: further token id(s) that end the generation (besides EOS and the chat
                template's end-of-turn tokens).
            stop_strings: a string (or several) that ends the generation once it appears.
            logits_processor: a ``transformers.LogitsProcessorList`` applied after those.
            stopping_criteria: a ``transformers.StoppingCriteriaList``, checked token by token.
            json_schema: the output matches this JSON schema (a dict, or its JSON text), through the
                grammar engine llguidance (a base dependency); drafts and every
                verified row are masked with their own prefix, so greedy output equals constrained
                plain decoding (`framework.engine.grammar`).
            regex: the output matches this regular expression (llguidance).
            grammar: the output matches this grammar, in llguidance's Lark syntax (an EBNF).
            batch_size: for a list of prompts, how many decode together (each row's tokens are
                what it decodes alone, its forwards shared with the other rows';
                docs/batching.md). 1 (the default): one after another.

        Returns:
            One `Generation`, or a list of them for a list of prompts.

        Raises:
            TypeError, ValueError: an argument of the wrong type or out of range (the message names
                it), a batch with a streamer, or a sampling request to a method that verifies a
                token tree.
        """
        opts = call_options(max_new_tokens, do_sample, temperature, top_p, top_k, seed, generation_config)
        controls = self._controls(
            generation_config,
            repetition_penalty=repetition_penalty,
            no_repeat_ngram_size=no_repeat_ngram_size,
            min_new_tokens=min_new_tokens,
            bad_words_ids=bad_words_ids,
            suppress_tokens=suppress_tokens,
            begin_suppress_tokens=begin_suppress_tokens,
            eos_token_id=eos_token_id,
            stop_strings=stop_strings,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            json_schema=json_schema,
            regex=regex,
            grammar=grammar,
        )
        prompts = _as_batch(prompt)
        if prompts is not None and streamer is not None:
            raise ValueError("streamer: streaming takes one prompt at a time (a batch of prompts was given)")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self._use_sampling(opts.sampling, reseed=seed is not None)
        dec = self.experiment.decoder
        with python_names():
            if prompts is None:
                return self._run(dec, self.encode(prompt), opts.max_new_tokens, streamer, controls)  # type: ignore[arg-type]
            if batch_size > 1:
                return self._run_batches(
                    dec, [self.encode(p) for p in prompts], opts.max_new_tokens, controls, batch_size
                )
            return [self._run(dec, self.encode(p), opts.max_new_tokens, None, controls) for p in prompts]

    def _run_batches(
        self, decoder: Any, prompts: list[torch.Tensor], max_new_tokens: int | None, controls: Any, size: int
    ) -> list[Generation]:
        """``prompts`` decoded ``size`` at a time (`framework.engine.batch.decoding.BatchDecoder`)."""
        batch, out = BatchDecoder(decoder, size), []
        for lo in range(0, len(prompts), size):
            part = prompts[lo : lo + size]
            stops = [self.experiment.stop(max_new_tokens, None, **(controls or {})) for _ in part]
            for res in batch.generate(part, stops).rows:
                out.append(self._generation(res, self.experiment.text(res.tokens)))
        return out

    def _controls(self, generation_config: Any, **given: Any) -> dict[str, Any]:
        """`Session.stop`'s keywords for `generate`'s processing, stopping and grammar arguments (a
        ``generation_config``'s where an argument is not given), each checked with its name."""
        unknown = sorted(set(given) - set(CONTROLS))
        if unknown:
            close = difflib.get_close_matches(unknown[0], CONTROLS, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f" (it takes {', '.join(CONTROLS)})"
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}{hint}")
        given = {key: given.get(key) for key in CONTROLS}
        with python_names():
            grammar = _grammar(given.pop("json_schema"), given.pop("regex"), given.pop("grammar"))
        for key in list(given):
            if given[key] is None and generation_config is not None and key in _GC_CONTROLS:
                given[key] = getattr(generation_config, key, None)
        g = self.experiment.cfg.generation
        fields: dict[str, Any] = {}
        rp, ngram, min_new = (
            given["repetition_penalty"],
            given["no_repeat_ngram_size"],
            given["min_new_tokens"],
        )
        if rp is not None:
            _check_number("repetition_penalty", rp, integer=False, lo=0.0, lo_open=True)
            fields["repetition_penalty"] = float(rp)
        if ngram is not None:
            _check_number("no_repeat_ngram_size", ngram, integer=True, lo=0)
            fields["no_repeat_ngram_size"] = int(ngram)
        if min_new is not None:
            _check_number("min_new_tokens", min_new, integer=True, lo=0)
            fields["min_new_tokens"] = int(min_new)
        for key in ("suppress_tokens", "begin_suppress_tokens", "eos_token_id"):
            value = given[key]
            if value is not None:
                ids = [value] if isinstance(value, int) else list(value)
                for t in ids:
                    _check_number(key, t, integer=True, lo=0)
                fields["eos_token_ids" if key == "eos_token_id" else key] = tuple(int(t) for t in ids)
        stops = given["stop_strings"]
        if stops is not None:
            stops = (stops,) if isinstance(stops, str) else tuple(stops)
            if not all(isinstance(s, str) for s in stops):
                raise TypeError(f"stop_strings must be a string or strings, got {given['stop_strings']!r}")
            fields["stop_strings"] = g.stop_strings + stops
        bad = given["bad_words_ids"] or ()
        if not all(isinstance(w, Sequence) and w and all(isinstance(t, int) for t in w) for w in bad):
            raise TypeError(
                f"bad_words_ids must be non-empty lists of token ids, got {given['bad_words_ids']!r}"
            )
        processors = given["logits_processor"]
        with python_names():
            generation = dataclasses.replace(g, **fields) if fields else None
        return {
            "generation": generation,
            "processors": tuple(processors) if processors is not None else (),
            "criteria": given["stopping_criteria"],
            "bad_words_ids": tuple(tuple(w) for w in bad),
            "grammar": grammar,
        }

    def _use_sampling(self, sampling: dict[str, Any] | None, *, reseed: bool = False) -> None:
        """Decode with the verifier ``sampling`` asks for (``None``: as configured), rebuilding the
        decoders when it changes or when ``reseed`` (a ``seed=`` given: the sampler and every
        strategy start afresh, so the same seed gives the same tokens); a preparation already done
        is kept."""
        want = self.method if sampling is None else sampling_method(self.method, sampling)
        exp = self.experiment
        if exp.cfg.method == want and not reseed:
            return
        exp.cfg = dataclasses.replace(exp.cfg, method=want)
        exp.rebuild()

    def generate_vanilla(self, prompt: PromptLike, max_new_tokens: int | None = None) -> Generation:
        """Generate with plain autoregressive decoding through the same adapter and cache (the
        baseline every speedup is measured against)."""
        return self._run(self.experiment.vanilla, self.encode(prompt), max_new_tokens)

    def compare(
        self,
        prompt: PromptLike,
        max_new_tokens: int | None = None,
        *,
        repeats: int = 1,
        warmup: bool = True,
        generation_config: Any = None,
        **controls: Any,
    ) -> Comparison:
        """The same prompt through vanilla decoding and the method, interleaved (the order rotates
        every repeat), after a short warm-up: speedup, and whether the tokens are identical.

        Args:
            prompt: a user message, a chat, prompt token ids, or what ``apply_chat_template``
                returns (as `generate` takes it).
            max_new_tokens: the budget (default: the config's).
            repeats: timed repeats (>= 1); the speedup is the ratio of mean tokens/s.
            warmup: decode a few tokens with both first (kernels compiled, caches sized).
            generation_config: as in `generate` (its processors' settings apply to both).
            **controls: `generate`'s processing, stopping and grammar arguments
                (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``,
                ``bad_words_ids``, ``suppress_tokens``, ``begin_suppress_tokens``,
                ``eos_token_id``, ``stop_strings``, ``logits_processor``, ``stopping_criteria``,
                ``json_schema``, ``regex``, ``grammar``), applied to vanilla decoding and to the
                method alike, so that the lossless check holds under them.

        Raises:
            TypeError, ValueError: as `generate` (a keyword it does not take is named, with a
                did-you-mean).
        """
        if not isinstance(repeats, numbers.Integral) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
        keywords = self._controls(generation_config, **controls)
        with python_names():
            ids = self.encode(prompt)
        exp = self.experiment
        greedy = exp.spec.verifier.lossless == "greedy"
        methods = [
            Method("vanilla", exp.vanilla, "baseline", greedy),
            Method("method", exp.decoder, "method", greedy),
        ]
        if warmup:
            warm_up(
                methods, lambda m: self._run(m.decoder, ids, min(16, max_new_tokens or 16), None, keywords)
            )

        def decode(m: Method, ids: torch.Tensor) -> list[tuple[GenerationResult, str]]:
            res = m.decoder.generate(ids, exp.stop(max_new_tokens, **keywords))
            return [(res, exp.text(res.tokens))]

        tok_s: dict[str, list[float]] = {"vanilla": [], "method": []}
        mismatch = None
        with python_names():
            compared = list(compare_methods(methods, [ids] * repeats, decode))
        for cmp in compared:
            for name, turns in cmp.results.items():
                tok_s[name].append(turns[0][0].tokens_per_second)
            mismatch = mismatch or cmp.mismatches.get("method")
        runs = {name: self._generation(*turns[0]) for name, turns in cmp.results.items()}
        return Comparison(
            vanilla=runs["vanilla"],
            method=runs["method"],
            speedup=speedup(tok_s["method"], tok_s["vanilla"]),
            lossless=(mismatch is None) if greedy else None,
            first_mismatch=mismatch if greedy else None,
            repeats=repeats,
        )

    def benchmark(
        self,
        data: str | None = None,
        *,
        methods: Sequence[Any] = (),
        output: str | None = None,
        log: Any = print,
        **overrides: Any,
    ) -> dict[str, Any]:
        """This decoder's method against vanilla (and ``methods``) on a prompt file, through the
        pipeline of ``run.py`` and ``bench.py`` (`framework.runner.pipeline.run`): interleaved in
        rotated order, records written as each prompt finishes, the report, the plots, the tracker
        and the answer files, into the folder ``output`` (default ``runs/bench-<time>``).

        Args:
            data: a Spec-Bench ``question.jsonl`` (default: the built-in suite).
            methods: more methods to compare, as ``bench.py --methods`` names them (presets,
                ``hf_generate``, ``<preset>:raw``, `MethodConfig` sections).
            output: the results folder.
            log: progress lines (``None``: silent).
            **overrides: any other `RunConfig` override (``limit=5``, ``repeats=3``,
                ``logger="none"``, ``categories="qa,rag"``).

        Returns:
            What `framework.runner.pipeline.run` returns: the records, the summary, the report.
        """
        vanilla = RunConfig.from_preset("vanilla").method
        cfg = RunConfig(model=self.model_config, method=vanilla, generation=self.generation)
        cfg = cfg.replace(
            **{"data.path": data, "compare.methods": tuple(methods), "runner.output": output}, **overrides
        )
        own = {self.method.label: self.experiment.spec}  # the decoder itself, its own strategies included
        quiet = log or (lambda _m: None)
        return run_pipeline(cfg, quiet, self.model, self.tokenizer, custom=own)

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={s.name or type(s).__name__}" for k, s in self.strategies.items())
        parts = parts or "plain decoding"
        model = (
            self.experiment.adapter.arch.info().name or self.model_config.name_or_path or "(a loaded model)"
        )
        return f"Decoder({self.method.label}: {parts}; model {model})"


# ---- generate's arguments ----------------------------------------------------------------------
@dataclass(frozen=True)
class CallOptions:
    """`Decoder.generate`'s arguments, validated: the budget (``None``: the config's) and the
    sampling request (``None``: decode as the method is configured; else ``do_sample`` and the
    distribution's settings given)."""

    max_new_tokens: int | None
    sampling: dict[str, Any] | None


#: What `Decoder.generate` reads of a transformers ``GenerationConfig``, and the settings it cannot
#: honour with their neutral values.
_GC_UNSUPPORTED = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
}
#: `generate`'s processing, stopping and grammar arguments (`Decoder.compare` takes them too).
CONTROLS = (
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_new_tokens",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "eos_token_id",
    "stop_strings",
    "logits_processor",
    "stopping_criteria",
    "json_schema",
    "regex",
    "grammar",
)
#: The processing and stopping settings `Decoder.generate` takes from a ``GenerationConfig`` (its
#: own ``eos_token_id`` is the model's, and it holds no processors, criteria or grammars).
_GC_CONTROLS = tuple(
    c
    for c in CONTROLS
    if c not in ("eos_token_id", "logits_processor", "stopping_criteria", "json_schema", "regex", "grammar")
)


def _check_number(
    name: str, value: Any, *, integer: bool, lo: float, lo_open: bool = False, hi: float | None = None
) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(
            f"{name} must be {'an int' if integer else 'a number'}, got {type(value).__name__} {value!r}"
        )
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        span = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        raise ValueError(f"{name} must be {span}, got {value!r}")


def call_options(
    max_new_tokens: Any,
    do_sample: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    seed: Any,
    generation_config: Any,
) -> CallOptions:
    """Validate `Decoder.generate`'s arguments (a ``generation_config``'s fields first, explicit
    arguments over them) with Python-shaped messages.

    Raises:
        TypeError, ValueError: the argument named in the message.
    """
    if generation_config is not None:
        for key, neutral in _GC_UNSUPPORTED.items():
            value = getattr(generation_config, key, neutral)
            if value is not None and value != neutral:
                raise ValueError(
                    f"generation_config.{key}={value!r}: not supported (self-speculative decoding here "
                    f"decodes one sequence greedily or by speculative sampling); leave it at {neutral!r}"
                )
        gc_sample = bool(getattr(generation_config, "do_sample", False))
        max_new_tokens = (
            getattr(generation_config, "max_new_tokens", None) if max_new_tokens is None else max_new_tokens
        )
        do_sample = gc_sample if do_sample is None else do_sample
        if gc_sample:  # transformers applies these only when sampling
            temperature = (
                getattr(generation_config, "temperature", None) if temperature is None else temperature
            )
            top_p = getattr(generation_config, "top_p", None) if top_p is None else top_p
            top_k = getattr(generation_config, "top_k", None) if top_k is None else top_k
    if max_new_tokens is not None:
        _check_number("max_new_tokens", max_new_tokens, integer=True, lo=1)
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True, False or None, got {do_sample!r}")
    if temperature is not None:
        _check_number("temperature", temperature, integer=False, lo=0.0, lo_open=True)
    if top_p is not None:
        _check_number("top_p", top_p, integer=False, lo=0.0, lo_open=True, hi=1.0)
    if top_k is not None:
        _check_number("top_k", top_k, integer=True, lo=0)
    if seed is not None:
        _check_number("seed", seed, integer=True, lo=0)
    given = {
        k: v
        for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed))
        if v is not None
    }
    if do_sample is None and not given:
        return CallOptions(max_new_tokens, None)
    return CallOptions(max_new_tokens, {"do_sample": do_sample, **given})


def sampling_method(method: MethodConfig, sampling: Mapping[str, Any]) -> MethodConfig:
    """``method`` with the verifier ``sampling`` asks for: greedy for ``do_sample=False``, the
    ``sampling`` verifier (its current settings updated) for ``do_sample=True``; ``None`` keeps
    the configured kind and updates a sampling verifier's settings.

    Raises:
        ValueError: settings of the distribution without sampling, or sampling asked of a method
            that verifies a token tree.
    """
    samples = method.verifier.name == "sampling"
    do_sample = samples if sampling.get("do_sample") is None else bool(sampling["do_sample"])
    settings = {k: v for k, v in sampling.items() if k != "do_sample"}
    if not do_sample:
        if settings:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in settings.items())}: sampling settings need do_sample=True "
                "(as in transformers, they apply only when sampling)"
            )
        if not samples:
            return method
        return dataclasses.replace(method, verifier=RunConfig.of(verifier="greedy").method.verifier)
    if method.verifier.name == "tree":
        raise ValueError(
            "do_sample=True: this method verifies a token tree greedily ('tree'); speculative sampling "
            "verifies chains: build the decoder with verifier='sampling' (and a chain drafter)"
        )
    base = dataclasses.asdict(method.verifier.config) if samples else {}
    fields = {f"verifier.{k}": v for k, v in {**base, **settings}.items()}
    return dataclasses.replace(method, verifier=RunConfig.of(verifier="sampling", **fields).method.verifier)


def _formatted(text: str, tokenizer: Any) -> bool:
    """``text`` is an already formatted prompt (``apply_chat_template(..., tokenize=False)``):
    it holds the chat template's special tokens, which a user message does not."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", ()) if isinstance(t, str) and len(t) > 1]
    return any(t in text for t in specials)


def _input_ids(prompt: Any) -> Any:
    """The token ids of what a tokenizer returns (a ``BatchEncoding`` or a dict with
    ``input_ids``): one row (a batch of one is that row); anything else as it is."""
    if not isinstance(prompt, Mapping) or "input_ids" not in prompt:
        return prompt
    ids = prompt["input_ids"]
    rows = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    if isinstance(rows, Sequence) and rows and isinstance(rows[0], Sequence):
        if len(rows) != 1:
            raise ValueError(
                f"prompt: input_ids holds {len(rows)} rows; pass one row, or a list of prompts (a batch)"
            )
        rows = rows[0]
    if not isinstance(rows, Sequence) or not rows or not all(isinstance(t, numbers.Integral) for t in rows):
        raise ValueError(f"prompt: input_ids must be token ids, got {type(ids).__name__}")
    mask = prompt.get("attention_mask")
    if mask is not None:
        mask = mask.tolist() if isinstance(mask, torch.Tensor) else mask
        mask = mask[0] if mask and isinstance(mask[0], Sequence) else mask
        if len(mask) == len(rows) and not all(mask):
            rows = [t for t, keep in zip(rows, mask, strict=True) if keep]  # padding left out
    return [int(t) for t in rows]


def _as_batch(prompt: Any) -> list[Any] | None:
    """The prompts of a batch (a list of strings, chats or token-id lists, or a 2-D tensor of
    several rows), or ``None`` for one prompt."""
    if isinstance(prompt, Mapping) and "input_ids" in prompt:
        ids = prompt["input_ids"]
        n = len(ids) if isinstance(ids, Sequence) and ids and isinstance(ids[0], Sequence) else 1
        if isinstance(ids, torch.Tensor):
            n = ids.shape[0] if ids.dim() == 2 else 1
        if n <= 1:
            return None
        mask = prompt.get("attention_mask")
        return [
            {"input_ids": ids[i], **({"attention_mask": mask[i]} if mask is not None else {})}
            for i in range(n)
        ]
    if isinstance(prompt, torch.Tensor):
        return [row for row in prompt] if prompt.dim() == 2 and prompt.shape[0] > 1 else None
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
        return None
    if all(isinstance(p, numbers.Integral) for p in prompt) or all(isinstance(p, Mapping) for p in prompt):
        return None  # one prompt: token ids, or a chat
    if all(
        isinstance(p, (str, torch.Tensor)) or (isinstance(p, Sequence) and not isinstance(p, Mapping))
        for p in prompt
    ):
        return list(prompt)  # messages, chats and token-id lists, in any mix
    return None


@contextlib.contextmanager
def python_names() -> Iterator[None]:
    """Errors raised inside name the Python argument, not the command line's flag: a
    `ConfigError` (`pythonic`) and a grammar's error (``--json-schema: ...`` becomes
    ``json_schema: ...``)."""
    try:
        yield
    except ConfigError as err:
        raise pythonic(err) from None
    except GrammarError as err:
        text = str(err)
        for kind, flag in GRAMMAR_FLAGS.items():
            if text.startswith(flag):
                arg = "grammar" if kind == "lark" else kind
                raise GrammarError(arg + text[len(flag) :]) from None
        raise


def pythonic(err: ConfigError) -> ConfigError:
    """``err`` named as a Python keyword (``max_new_tokens``, ``length.threshold``,
    ``stop_strings`` for ``--stop``), not a flag."""
    name = err.field
    if name.startswith("--"):
        name = _FLAG_FIELDS().get(name) or name[2:]
        name = name if "." in name else name.replace("-", "_")
    return ConfigError(name, err.value, err.allowed, err.hint)


@functools.cache
def _FLAG_FIELDS() -> dict[str, str]:  # noqa: N802 - a constant, computed once
    """The Python name of each flag of a `Decoder`'s sections whose flag is not its field's name
    (``--stop``: ``stop_strings``); `generate`'s own spellings where they differ."""
    out = {}
    for section in (ModelConfig, MethodConfig, GenerationConfig):
        for f in dataclasses.fields(section):
            flag = f.metadata.get("flag")
            if flag and flag != "--model":  # from_preset takes model=
                out[flag] = f.name
    out["--eos-token-ids"] = "eos_token_id"
    return out


def decoder_options() -> list[str]:
    """The keyword names `Decoder.from_preset` takes (the model, method and generation sections'
    fields), for did-you-mean hints."""
    return [
        f.name
        for section in (ModelConfig, MethodConfig, GenerationConfig)
        for f in dataclasses.fields(section)
    ]


def _grammar(json_schema: Any, regex: Any, grammar: Any) -> Any:
    """The `framework.engine.grammar.Grammar` of `Decoder.generate`'s grammar arguments (one at
    most), or ``None``."""
    given = {
        k: v
        for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
        if v is not None
    }
    if len(given) > 1:
        raise ValueError(f"one grammar per generation: {', '.join(given)} were given")
    if "json_schema" in given:
        if not isinstance(json_schema, (str, Mapping)):
            raise TypeError(f"json_schema must be a dict or JSON text, got {type(json_schema).__name__}")
        return Grammar.json_schema(json_schema if isinstance(json_schema, str) else dict(json_schema))
    for key, make in (("regex", Grammar.regex), ("grammar", Grammar.lark)):
        if key in given:
            if not isinstance(given[key], str):
                raise TypeError(f"{key} must be a string, got {type(given[key]).__name__}")
            return make(given[key])
    return None
