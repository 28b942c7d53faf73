"""``grammar_forced``: draft the tokens a grammar forces (no forward), then let another drafter go on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from framework import (
    REGISTRIES,
    Draft,
    Drafter,
    DraftView,
    LayerPlan,
    LengthController,
    ModelInfo,
    PrepareView,
    RoundView,
    Verification,
    register_drafter,
)
from framework.config_fields import ConfigError, build_config, check_range, check_types, param
from framework.registry import UnknownNameError
from framework.types import DraftWeights, ReducedHead

NONE = "none"


def _drafters() -> Any:
    return REGISTRIES["drafter"]


@dataclass(frozen=True)
class GrammarForcedDrafterConfig:
    then: str = param(
        "layer_skip",
        help="the registered drafter that drafts after the forced run (and in rounds with none): "
        "layer_skip, prompt_lookup, hybrid, cascade, early_exit, ...; 'none': forced runs only (a "
        "round without one is a plain step)",
    )
    then_config: Any = param(
        None,
        help="that drafter's options, a mapping (YAML: {skip_gate: true, draft_vocab: 16384}; on the "
        "command line the same inline YAML); default: its defaults",
    )
    max_forced: int = param(
        16,
        help="longest forced run drafted in one round; >= 1 (the round's draft cap, the length "
        "controller's, bounds it too)",
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_range("max_forced", self.max_forced, 1, integer=True)
        if self.then == "grammar_forced":
            raise ConfigError("then", self.then, "another drafter (grammar_forced does not nest)")
        if self.then != NONE:
            try:
                _drafters().entry(self.then)
            except (UnknownNameError, KeyError):
                names = ", ".join(n for n in _drafters().names() if n != "grammar_forced")
                raise ConfigError("then", self.then, f"'none' or a registered drafter ({names})") from None
        options = self.then_config
        if isinstance(options, str):
            try:
                options = yaml.safe_load(options) if options.strip() else None
            except yaml.YAMLError:
                raise ConfigError("then_config", self.then_config, "a mapping in YAML") from None
        if options is not None and not isinstance(options, dict):
            raise ConfigError("then_config", self.then_config, "a mapping of the drafter's options")
        if options and self.then == NONE:
            raise ConfigError("then_config", options, "empty with then: none")
        object.__setattr__(self, "then_config", dict(options) if options else None)
        self.inner_config()  # the inner drafter's own validation, now

    def inner_config(self) -> Any:
        """The config of the drafter named by ``then`` (``None`` for ``'none'``)."""
        if self.then == NONE:
            return None
        cls = _drafters().entry(self.then).config
        return build_config(cls, dict(self.then_config or {}), "then_config.")


class _Forcing:
    """What the grammar forces in one round: the leading run, and after each token the ``then``
    drafter feeds to its next draft forward the run that rides along (`DraftView.force`'s
    ``after``). Keeps the round's draft on the host (``seq``) and where its forced tokens stand."""

    def __init__(
        self, grammar: Any, generated: list[int], lead: list[int], cap: int, max_forced: int
    ) -> None:
        self._grammar, self._generated = grammar, generated  # committed new tokens (host)
        self.seq: list[int] = list(lead)  # the round's draft so far: forced and drafted
        self.forced_at: list[int] = list(range(len(lead)))
        self.inserted = 0  # forced runs inside the draft
        self._cap, self._max_forced = cap, max_forced

    def after(self, fed: list[int]) -> list[int]:
        self.seq.extend(fed)
        room = min(self._max_forced, self._cap - len(self.seq) - 1)  # one drafted token must follow
        run = self._grammar.forced([*self._generated, *self.seq], room) if room > 0 else []
        if run:
            self.inserted += 1
            self.forced_at.extend(range(len(self.seq), len(self.seq) + len(run)))
            self.seq.extend(run)
        return run

    def full(self) -> bool:
        """The round holds ``cap`` tokens, with the one the ``then`` drafter just drafted."""
        return len(self.seq) + 1 >= self._cap


class _Capped:
    """A length controller that also stops the ``then`` drafter once the round is full."""

    def __init__(self, length: LengthController, forcing: _Forcing) -> None:
        self._length, self._forcing = length, forcing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._length, name)

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        return not self._forcing.full() and self._length.should_continue(drafted, confidence)


@register_drafter("grammar_forced", config=GrammarForcedDrafterConfig)
class GrammarForcedDrafter(Drafter):
    """Where the grammar admits one continuation only, draft it without a forward; then another drafter.

    With a grammar (``--json-schema``, ``--regex``, ``--grammar``), the keys, separators and
    closing brackets of a JSON object are often the only continuation the grammar admits
    (llguidance's fast-forward tokens, `framework.engine.grammar.GrammarState.forced`). Each
    round this drafter asks the generation's matcher for that forced run after the committed
    tokens, at most ``max_forced`` tokens and at most the round's cap, and drafts it with no
    forward pass (confidence 1, a one-hot draft distribution under speculative sampling, as a
    copied token's) through the engine (`framework.view.DraftView.force`). Then the drafter named
    by ``then`` drafts the rest of the round's cap after the run, unchanged: the run is the end
    of the context it continues, and the engine feeds the run with its first draft forward, so a
    layer-skip draft costs the same number of forwards with or without the run. Inside that draft,
    after each token it feeds, a run the grammar forces rides along in the same draft forward
    and follows that token in the draft (`_Forcing.after`); the round stops at its cap, forced
    tokens included (`_Capped`). ``then: none`` drafts the leading forced runs only.

    Lossless: the target still verifies every token, and the verification's rows are masked by the
    same grammar, so a forced token is the only token its row allows: no verification refuses a
    forced token first.

    Without a grammar the drafter is the ``then`` drafter. The length controller and the
    selector see each round whole (the forced tokens are drafted and accepted tokens of the
    round); ``summary()`` reports ``forced`` (tokens drafted by the grammar), ``forced_accepted``,
    ``forced_refused`` (0 unless something is broken), ``forced_rounds``, ``inserted_runs`` (runs
    inside a draft), ``rounds`` and the ``then`` drafter's summary under its name.
    Known in serving stacks as jump-forward decoding (SGLang); here it is a draft, not a commit,
    so a tokenisation the model would not choose is still the target's to refuse.
    """

    def __init__(self, config: GrammarForcedDrafterConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        inner = c.inner_config()
        self.then: Drafter | None = None if inner is None else _drafters().get(c.then)(inner)
        self.reset()

    @property
    def needs_phase_timings(self) -> bool:  # type: ignore[override]
        return self.then is not None and bool(self.then.needs_phase_timings)

    def setup(self, info: ModelInfo) -> None:
        if self.then is not None:
            self.then.setup(info)

    def prepare(self, ctx: PrepareView) -> None:
        if self.then is not None:
            self.then.prepare(ctx)

    def draft_head(self) -> ReducedHead | None:
        return None if self.then is None else self.then.draft_head()

    def draft_weights(self) -> DraftWeights | None:
        return None if self.then is None else self.then.draft_weights()

    def run_notes(self, max_new_tokens: int) -> list[str]:
        return [] if self.then is None else self.then.run_notes(max_new_tokens)

    def reset(self) -> None:
        if self.then is not None:
            self.then.reset()
        self._counts = {
            "rounds": 0,
            "forced_rounds": 0,
            "forced": 0,
            "forced_accepted": 0,
            "forced_refused": 0,
            "inserted_runs": 0,
        }
        self._forced_at: list[int] = []  # positions of this round's forced tokens in its draft

    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        self._counts["rounds"] += 1
        self._forced_at = []
        grammar = state.grammar
        if grammar is None:  # no grammar: the ``then`` drafter alone
            if self.then is None:
                return Draft.empty(state.pending.shape[0], plan, state.device)
            return self.then.draft(state, plan, length, max_tokens)
        generated = list(state.token_ids())[state.prompt_len :]
        lead = grammar.forced(generated, min(max_tokens, self.config.max_forced))
        forcing = _Forcing(grammar, generated, lead, max_tokens, self.config.max_forced)
        state.force(lead, after=forcing.after)  # the engine feeds them with the next draft forward
        draft = None
        if self.then is not None and max_tokens > len(lead):
            draft = self.then.draft(state, plan, _Capped(length, forcing), max_tokens - len(lead))
        if draft is None or not draft.length:  # nothing drafted after the lead: the lead alone
            draft = state.drafted(plan)
        forced = len(forcing.forced_at)
        if forced:
            draft.source = "forced" if forced == draft.length else f"forced+{draft.source or 'then'}"
        self._forced_at = forcing.forced_at
        self._counts["forced"] += forced
        self._counts["forced_rounds"] += bool(forced)
        self._counts["inserted_runs"] += forcing.inserted
        return draft

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        self._counts["forced_accepted"] += sum(p < result.accepted for p in self._forced_at)
        # the first token refused is never a forced one: its row allows nothing else
        self._counts["forced_refused"] += (
            result.accepted < draft.length and result.accepted in self._forced_at
        )
        self._forced_at = []
        if self.then is not None:
            self.then.observe(state, draft, result)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._counts)
        if self.then is not None:
            inner = self.then.summary()
            if inner:
                out[self.config.then] = inner
        return out
