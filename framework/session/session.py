"""A loaded model with both decoders: what a run (and a benchmark, a test, the Python API) decodes
prompts with.

`build_decoder` turns a `RunConfig` into a `SpeculativeDecoder` (the four strategies, the length
controller wrapped in the draft gate when ``cfg.method.gate.enabled``); `Session` loads the model (or
takes one), prepares the strategies once and decodes prompts turn by turn with either decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from framework.config_fields import ConfigError
from framework.data.prompts import Prompt, calibration_texts, encode_chat, stop_token_ids
from framework.drafting.gate import gated
from framework.engine.adapter import ModelAdapter, adapter_for
from framework.engine.context import PrepareContext, PreparedCache
from framework.engine.decoding import GenerationResult, SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.grammar import CompiledGrammar, Grammar, GrammarError
from framework.engine.placement import BlockPlacement
from framework.engine.processing import GenerationControls
from framework.engine.synthetic import SyntheticAcceptance
from framework.interfaces import REGISTRIES, Strategy
from framework.models.loading import dtype_name, load_model
from framework.models.provenance import run_provenance
from framework.session.notes import run_notes
from framework.session.run_config import GenerationConfig, RunConfig

#: What may stand in for a configured strategy: an instance, or a class built with its default config.
StrategyOverrides = Mapping[str, "Strategy | type[Strategy]"]


def _strategy(kind: str, cfg: RunConfig, given: Any) -> Strategy:
    if given is None:
        return getattr(cfg.method, kind).build(kind, cfg.generation.seed)
    base = REGISTRIES[kind].base_cls
    if isinstance(given, type) and issubclass(given, base):
        return given()
    if isinstance(given, base):
        return given
    raise ConfigError(f"strategies[{kind!r}]", given, f"a {base.__name__} instance or subclass")


def build_strategies(cfg: RunConfig, strategies: StrategyOverrides | None = None) -> dict[str, Strategy]:
    """The four strategies of ``cfg`` by kind, fresh (each strategy's own ``seed`` offset by
    ``--seed``: `StrategySpec.build`), with ``strategies`` (see `build_decoder`) in their slots.

    Raises:
        ConfigError: an unknown kind, or an object that is not a strategy of its kind.
    """
    given = dict(strategies or {})
    unknown = sorted(set(given) - set(REGISTRIES))
    if unknown:
        raise ConfigError("strategies", unknown, f"kinds among {', '.join(REGISTRIES)}")
    return {kind: _strategy(kind, cfg, given.get(kind)) for kind in REGISTRIES}


def build_decoder(
    adapter: ModelAdapter, cfg: RunConfig, strategies: StrategyOverrides | None = None
) -> SpeculativeDecoder:
    """Instantiate the four strategies of ``cfg`` (the length controller inside the draft gate
    ``cfg.method.gate``) and the speculative decoder over ``adapter`` (runs every ``setup``).

    Args:
        adapter: the model adapter.
        cfg: the run configuration.
        strategies: per kind, a strategy instance (used as it is) or class (built with its default
            config) that replaces the configured one, e.g. a researcher's unregistered subclass.

    Raises:
        ConfigError: an unknown kind, or an object that is not a strategy of its kind.
    """
    parts = build_strategies(cfg, strategies)
    return SpeculativeDecoder(
        adapter,
        parts["selector"],
        gated(parts["length"], cfg.method.gate),
        parts["drafter"],
        parts["verifier"],
        phase_timing=cfg.model.phase_timing_flag,
        synthetic=None
        if cfg.method.synthetic_acceptance is None
        else SyntheticAcceptance(cfg.method.synthetic_acceptance, cfg.generation.seed),
    )


class Session:
    """A loaded model plus both decoders, ready to decode prompts (used by ``run``, benchmarks and
    tests).

    Args:
        cfg: the run configuration (model, dtype, device, strategies, gate, stop strings).
        model: an already loaded model; ``None`` loads ``cfg.model.name_or_path``.
        tokenizer: its tokenizer (with ``model``).
        artifact_stem: where strategies keep artefacts (an offline search's skip set).
        log: where preparation messages go.
        prompts: checked against the model's context before any (possibly long) preparation.
        strategies: strategy instances or classes that replace the configured ones (see
            `build_decoder`); an instance is reused by `rebuild`, a class is built afresh.
        prepared: the preparation cache (`PreparedCache`) to share with other experiments on
            the same model (a benchmark's methods: one offline search, one cost model, one token
            ranking for all); ``None``: this experiment's own.

    Raises:
        ConfigError: a prompt that does not fit, or a strategy config rejected by the model.
        ModelLoadError: ``cfg.model.name_or_path`` cannot be loaded.
    """

    def __init__(
        self,
        cfg: RunConfig,
        model: Any = None,
        tokenizer: Any = None,
        *,
        artifact_stem: Path | None = None,
        log: Callable[[str], None] = print,
        prompts: list[Prompt] | None = None,
        strategies: StrategyOverrides | None = None,
        prepared: PreparedCache | None = None,
        progress: bool = True,
    ) -> None:
        self.cfg = cfg
        self.strategies = dict(strategies or {})
        m = cfg.model
        if model is None:
            model, tokenizer = load_model(m.name_or_path, m.dtype, m.device, m.device_map)
        self.model, self.tokenizer = model, tokenizer
        self.adapter = adapter_for(model, fast_kernels=None if m.kernels else False)
        if m.device_map and m.device_map != "auto":  # where load_model put it, or a model given
            try:
                self.adapter.place(BlockPlacement.parse(m.device_map, self.adapter.arch.num_layers))
            except ValueError as err:
                raise ConfigError(
                    "--device-map", m.device_map, f"a split of {self.adapter.arch.num_layers} blocks ({err})"
                ) from None
        try:
            self.adapter.set_exact(m.exact_on(self.adapter.arch.device))
        except ValueError as err:  # unset (auto) where exact mode cannot run: off
            if m.exact:
                raise ConfigError("--exact", True, f"off ({err})") from None
            self.adapter.set_exact(False)
        a = self.adapter
        if (
            m.exact is not None
            and a.arch.device.type == "cpu"
            and a.arch.dtype is torch.float32
            and a.fast_kernels
        ):
            log(
                f"note: --{'' if m.exact else 'no-'}exact changes nothing here: a float32 model on a CPU "
                "with the kernels computes every row alike whatever it says (--no-kernels: the stock path)"
            )
        self.adapter.executor.time_lm_head = m.phase_timing_flag
        if cfg.model.cuda_graphs:  # before any preparation: what a search times is what decodes
            if self.adapter.arch.device.type != "cuda":
                raise ConfigError(
                    "--cuda-graphs",
                    True,
                    f"used with a CUDA device (the model is on {self.adapter.arch.device})",
                )
            self.adapter.executor.set_cuda_graphs(True, route=m.cuda_graph_route)
        self.eos = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.prepare_ctx = PrepareContext(
            adapter=self.adapter,
            encode=lambda text: encode_chat(self.tokenizer, [{"role": "user", "content": text}]),
            eos_token_ids=frozenset(self.eos),
            artifact_stem=artifact_stem,
            log=log,
            progress=progress,
            # --dtype auto resolved for the device (artefacts such as a saved skip set are keyed by it)
            dtype=dtype_name(self.adapter.arch.dtype) if cfg.model.dtype == "auto" else cfg.model.dtype,
            load_prompts=calibration_texts,
            prepared=PreparedCache() if prepared is None else prepared,
            label=cfg.method.label,
        )
        self.compiled(cfg.generation.grammar_spec())  # a bad grammar fails before any decoding
        if prompts is not None:  # before any (possibly long) preparation
            self.check_prompts(prompts)
        self.rebuild()
        #: what the run cannot do as configured (`framework.session.notes`), said once here
        self.notes = [] if cfg.method.baseline_only else run_notes(cfg, self.spec.strategies())
        for note in self.notes:
            log(f"note: {note}")

    def rebuild(self) -> None:
        """Fresh strategy instances (after warm-up, so that state a strategy carries across
        prompts, such as an adaptive threshold or a sampler's RNG, starts from its defaults).

        Each instance's `Strategy.prepare` runs with the experiment's context; work kept in
        ``prepare_ctx.prepared`` (an offline search) is not repeated.
        """
        self.spec = build_decoder(self.adapter, self.cfg, self.strategies)
        if not self.cfg.method.baseline_only:
            self.spec.prepare(self.prepare_ctx)
        # The baseline gets its own verifier instance (its own RNG stream when sampling).
        self.vanilla = VanillaDecoder(
            self.adapter, self.cfg.method.verifier.build("verifier", self.cfg.generation.seed)
        )

    def resolved(self) -> dict[str, Any]:
        """What the configuration left to the run, as the prepared drafter resolved it
        (``draft_weights: auto`` -> ``int8``, the reduced draft head's size; 0: the full head),
        for the metadata and the logger next to the configuration."""
        if self.cfg.method.baseline_only:
            return {}
        drafter = self.spec.drafter
        weights, head = drafter.draft_weights(), drafter.draft_head()
        return {
            "drafter.draft_weights": getattr(weights, "weights", None) or "float32 (the model's own)",
            "drafter.draft_vocab": int(getattr(head, "size", 0) or 0),
        }

    @property
    def decoder(self) -> SpeculativeDecoder | VanillaDecoder:
        """What the method decodes with: the speculative decoder, or for a ``baseline_only``
        method (the ``vanilla`` preset) the vanilla baseline itself, as ``run.py`` and
        ``bench.py`` decode it."""
        return self.vanilla if self.cfg.method.baseline_only else self.spec

    def stop(
        self,
        max_new_tokens: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        *,
        generation: GenerationConfig | None = None,
        processors: Sequence[Any] = (),
        criteria: Any = None,
        bad_words_ids: Sequence[Sequence[int]] = (),
        grammar: Grammar | None = None,
    ) -> StopCondition:
        """The stop condition of a turn: ``max_new_tokens`` (default ``cfg.generation.max_new_tokens``), EOS,
        the chat template's end-of-turn tokens and ``eos_token_ids``, the stop strings, and what
        the generation section applies to each next token's scores (``generation``: instead of
        ``cfg.generation``; ``processors``: further transformers logits processors; ``criteria``: a
        `transformers.StoppingCriteriaList`; ``bad_words_ids``: token sequences never generated,
        besides the section's words; ``grammar``: a `framework.engine.grammar.Grammar` the
        answer must match, instead of the section's); ``on_tokens`` receives the kept tokens as
        they are committed (a streamer)."""
        g = self.cfg.generation if generation is None else generation
        eos = (*self.eos, *(t for t in g.eos_token_ids if t not in self.eos))
        bad = tuple(tuple(self.tokenizer.encode(w, add_special_tokens=False)) for w in g.bad_words)
        bad += tuple(tuple(int(t) for t in w) for w in bad_words_ids)
        controls = GenerationControls(
            g.repetition_penalty,
            g.no_repeat_ngram_size,
            g.min_new_tokens,
            bad,
            g.suppress_tokens,
            g.begin_suppress_tokens,
            tuple(processors),
            eos,
            self.compiled(grammar if grammar is not None else g.grammar_spec()),
        )
        return StopCondition(
            g.max_new_tokens if max_new_tokens is None else max_new_tokens,
            eos,
            g.stop_strings,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
            on_tokens=on_tokens,
            criteria=criteria,
            controls=controls,
        )

    def compiled(self, grammar: Grammar | None) -> CompiledGrammar | None:
        """``grammar`` checked against this model's tokenizer (compiled once per grammar)."""
        if grammar is None:
            return None
        cache = self.__dict__.setdefault("_grammars", {})
        if grammar not in cache:
            cache[grammar] = CompiledGrammar(grammar, self.tokenizer, self.adapter.arch.config.vocab_size)
        return cache[grammar]

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages -> prompt token ids (the tokenizer's chat template)."""
        return encode_chat(self.tokenizer, messages)

    def text(self, tokens: list[int]) -> str:
        """The answer text of generated tokens (EOS and special tokens removed)."""
        return self.tokenizer.decode([t for t in tokens if t not in self.eos], skip_special_tokens=True)

    def prepare_graphs(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> tuple[int, float]:
        """With ``--cuda-graphs``, before anything is timed: size the graphs' KV pool for the
        longest of ``prompts`` (every turn, each answer ``max_new_tokens`` long), decode the first
        prompt briefly with each decoder (untimed, a warm-up: the runner starts the timed
        prompts from fresh strategies) so that the engine sees which forwards the method runs, and record every graph they can use (`Executor.prepare_graphs` with
        `SpeculativeDecoder.graph_sizes`), so that timed generations record none (their
        ``graph_captures``). No strategy declares its sizes.

        Returns:
            ``(graphs recorded, seconds)``; ``(0, 0.0)`` without graphs.
        """
        executor = self.adapter.executor
        if executor.graphs is None:
            return 0, 0.0
        budget = max_new_tokens or self.cfg.generation.max_new_tokens
        longest = 0
        for p in prompts:
            messages: list[dict[str, str]] = []
            for turn in p.turns:
                messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
            longest = max(longest, len(self.encode_messages(messages[:-1])) + len(p.turns) * (budget + 8))
        capacity = longest + self.spec.max_draft + 8
        n, seconds = executor.prepare_graphs(capacity)  # the pool first: what the decode records stays
        if prompts:
            n0, s0 = executor.graph_counts()
            decoders = [self.vanilla] if self.cfg.method.baseline_only else [self.vanilla, self.spec]
            first = Prompt(prompts[0].question_id, "", "", prompts[0].turns[:1])
            for decoder in decoders:  # a warm-up: the runner rebuilds the strategies before timing
                self.decode_prompt(decoder, first, 16)
            n1, s1 = executor.graph_counts()
            n, seconds = n + n1 - n0, seconds + s1 - s0
        sizes = self.spec.graph_sizes(executor.seen)
        hidden = not self.cfg.method.baseline_only and self.spec.selector.needs_hidden_states
        more = executor.prepare_graphs(
            capacity,
            chain=sizes.chain,
            tree=sizes.tree,
            mlp=sizes.scratch,
            hidden=hidden,
            checked=sizes.checked,
            rule=sizes.rule,
        )
        n, seconds = n + more[0], seconds + more[1]
        weights = self.spec.drafter.draft_weights() if not self.cfg.method.baseline_only else None
        if weights is not None and weights.weights != "float32":  # a draft's own graphs (low-bit)
            more = executor.prepare_graphs(capacity, chain=sizes.chain, mlp=sizes.scratch, weights=weights)
            n, seconds = n + more[0], seconds + more[1]
        return n, seconds

    def check_prompts(self, prompts: list[Prompt]) -> None:
        """Fail before any decoding if a first turn cannot fit in the context.

        Raises:
            ConfigError: names the prompt, its length and the model's context.
            GrammarError: a prompt's ``json_schema`` that does not compile for this tokenizer
                (the message names the prompt).
        """
        limit = self.adapter.arch.max_context
        for p in prompts:
            if p.json_schema is not None:
                try:
                    self.compiled(Grammar.json_schema(p.json_schema))
                except GrammarError as err:
                    why = str(err).replace("--json-schema:", "its json_schema", 1)
                    raise GrammarError(f"prompt {p.question_id} ({p.category}): {why}") from None
            n = len(encode_chat(self.tokenizer, [{"role": "user", "content": p.turns[0]}]))
            if n + self.cfg.generation.max_new_tokens > limit:
                raise ConfigError(
                    f"prompt {p.question_id} ({p.category})",
                    f"{n} tokens + --max-new-tokens {self.cfg.generation.max_new_tokens}",
                    f"at most the model's context of {limit} tokens",
                )

    def decode_prompt(
        self, decoder: Any, prompt: Prompt, max_new_tokens: int | None = None
    ) -> list[tuple[GenerationResult, str]]:
        """All turns of ``prompt``; each turn sees this decoder's own earlier answers."""
        messages: list[dict[str, str]] = []
        out = []
        schema = None if prompt.json_schema is None else Grammar.json_schema(prompt.json_schema)
        stop = self.stop(max_new_tokens, grammar=schema)
        for turn in prompt.turns:
            messages.append({"role": "user", "content": turn})
            ids = torch.tensor([self.encode_messages(messages)], device=self.adapter.arch.device)
            res = decoder.generate(ids, stop)
            text = self.text(res.tokens)
            messages.append({"role": "assistant", "content": text})
            out.append((res, text))
        return out


def provenance(configured: str | None, exp: Session) -> dict[str, Any]:
    """What produced a run of ``exp`` (`framework.models.provenance.run_provenance`): the model
    (``configured``: the ``--model`` value), the code, the device and the dtype resolved."""
    adapter = exp.adapter
    return run_provenance(
        configured, adapter.arch.model, device=adapter.arch.device, dtype=dtype_name(adapter.arch.dtype)
    )
