"""``grammar_forced``: draft the tokens a grammar forces (no forward), then let another drafter go on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
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
from framework.config_fields import ConfigError, build_config, check_range, param
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


def _ids(state: RoundView, tokens: list[int]) -> torch.Tensor:
    """LongTensor (B, len(tokens)): ``tokens`` on the state's device for every batch row (no wait)."""
    b = state.pending.shape[0]
    return state.tensor([tokens] * b).reshape(b, len(tokens))


class _Forcing:
    """The round as the ``then`` drafter sees it.

    The leading forced run is drafted already: `pending` is its last token, and the first draft
    forward feeds the run too (one forward for the run and the first step, as a prefill of the
    run). Each later draft forward feeds the token the ``then`` drafter just drafted; when the
    grammar forces tokens after it, they are fed in the same forward (no step of their own) and
    recorded in `inserted`, so that the next token drafted follows them. `length` stops the
    ``then`` drafter once the round holds ``cap`` tokens, forced ones included."""

    def __init__(
        self, state: DraftView, lead: list[int], generated: list[int], grammar: Any, cap: int, max_forced: int
    ) -> None:
        self._state, self._grammar = state, grammar
        self._generated = generated  # committed new tokens (host)
        self.lead = lead
        self.seq: list[int] = list(lead)  # the round's draft so far (host): forced and drafted
        self.inserted: list[tuple[int, list[int]]] = []  # (drafted tokens before it, the forced run)
        self._drafted = 0  # tokens of the ``then`` drafter fed so far
        self._cap, self._max_forced = cap, max_forced
        self._started = False
        self._lead_ids = _ids(state, lead) if lead else None
        f = len(lead)
        self.num_tokens = state.num_tokens + f
        self.num_new = state.num_new + f
        self.pending_position = state.pending_position + f

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    @property
    def pending(self) -> torch.Tensor:
        return self._state.pending if self._lead_ids is None else self._lead_ids[:, -1:]

    @property
    def tokens(self) -> torch.Tensor:
        t = self._state.tokens
        return t if self._lead_ids is None else torch.cat([t, self._lead_ids], dim=1)

    @property
    def new_tokens(self) -> torch.Tensor:
        t = self._state.new_tokens
        return t if self._lead_ids is None else torch.cat([t, self._lead_ids], dim=1)

    def token_ids(self) -> list[int]:
        return [*self._state.token_ids(), *self.lead]

    def draft_step(self, input_ids: torch.Tensor, plan: LayerPlan | None, **kw: Any) -> Any:
        if not self._started:  # the first input is `pending`: the lead's inputs go first
            self._started = True
            if self._lead_ids is not None:
                input_ids = torch.cat([self._state.pending, self._lead_ids[:, :-1], input_ids], dim=1)
        else:  # tokens the ``then`` drafter drafted: a forced run after them rides along
            self.seq.extend(int(t) for t in input_ids[0].tolist())
            self._drafted += int(input_ids.shape[1])
            room = min(self._max_forced, self._cap - len(self.seq) - 1)  # one drafted token must follow
            run = self._grammar.forced([*self._generated, *self.seq], room) if room > 0 else []
            if run:
                self.inserted.append((self._drafted, run))
                self.seq.extend(run)
                input_ids = torch.cat([input_ids, _ids(self._state, run)], dim=1)
        return self._state.draft_step(input_ids, plan, **kw)

    def full(self) -> bool:
        """The round holds ``cap`` tokens, with the one the ``then`` drafter just drafted."""
        return len(self.seq) + 1 >= self._cap


class _Capped:
    """A length controller that also stops the ``then`` drafter once the round is full."""

    def __init__(self, length: LengthController, view: _Forcing) -> None:
        self._length, self._view = length, view

    def __getattr__(self, name: str) -> Any:
        return getattr(self._length, name)

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        return not self._view.full() and self._length.should_continue(drafted, confidence)


@register_drafter("grammar_forced", config=GrammarForcedDrafterConfig)
class GrammarForcedDrafter(Drafter):
    """Where the grammar admits one continuation only, draft it without a forward; then another drafter.

    With a grammar (``--json-schema``, ``--regex``, ``--grammar``), the keys, separators and
    closing brackets of a JSON object are often the only continuation the grammar admits
    (llguidance's fast-forward tokens, `framework.engine.grammar.GrammarState.forced`). Each
    round this drafter asks the generation's matcher for that forced run after the committed
    tokens, at most ``max_forced`` tokens and at most the round's cap, and drafts it with no
    forward pass (confidence 1, a one-hot draft distribution under speculative sampling, as a
    copied token's). Then the drafter named by ``then`` drafts the rest of the round's cap from
    the last forced token: its first draft forward feeds the run's tokens too, so a layer-skip
    draft costs the same number of forwards with or without the run. Inside that draft, after
    each token it feeds, a run the grammar forces rides along in the same draft forward and is
    spliced into the draft after that token (`_Forcing`); the round stops at its cap, forced
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
        grammar = getattr(state, "grammar", None)
        if grammar is None:  # no grammar: the ``then`` drafter alone
            if self.then is None:
                return Draft.empty(state.pending.shape[0], plan, state.device)
            return self.then.draft(state, plan, length, max_tokens)
        generated = list(state.token_ids())[state.prompt_len :]
        lead = grammar.forced(generated, min(max_tokens, self.config.max_forced))
        rest, inserted = None, []
        if self.then is not None and max_tokens > len(lead):
            view = _Forcing(state, lead, generated, grammar, max_tokens, self.config.max_forced)
            rest = self.then.draft(view, plan, _Capped(length, view), max_tokens - len(lead))  # type: ignore[arg-type]
            inserted = view.inserted
        draft, self._forced_at = _join(state, lead, rest, inserted, plan)
        forced = len(self._forced_at)
        self._counts["forced"] += forced
        self._counts["forced_rounds"] += bool(forced)
        self._counts["inserted_runs"] += len(inserted)
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


def _join(
    state: DraftView,
    lead: list[int],
    rest: Draft | None,
    inserted: list[tuple[int, list[int]]],
    plan: LayerPlan,
) -> tuple[Draft, list[int]]:
    """The round's draft: the forced ``lead``, then ``rest``'s tokens with each forced run of
    ``inserted`` after the drafted tokens it followed; forced tokens with confidence 1 and a
    one-hot draft distribution where the round keeps them. Returns the draft and the positions
    of its forced tokens."""
    batch, dev = state.pending.shape[0], state.device
    drafted = 0 if rest is None else rest.length
    if drafted:
        plan = rest.plan  # type: ignore[union-attr]
    pieces: list[tuple[bool, Any]] = []  # (forced, host tokens) or (drafted, (start, end))
    if lead:
        pieces.append((True, lead))
    at = 0
    for after, run in inserted:
        if after > drafted:
            break
        if after > at:
            pieces.append((False, (at, after)))
        pieces.append((True, run))
        at = after
    if drafted > at:
        pieces.append((False, (at, drafted)))
    if not any(forced for forced, _ in pieces):  # nothing forced: the drafter's own draft
        return (rest if rest is not None else Draft.empty(batch, plan, dev)), []
    parts: list[Draft] = []
    forced_at, n = [], 0
    for forced, part in pieces:
        if forced:  # a copied draft's extras: confidence 1, a one-hot q
            parts.append(state.copied_draft(part, plan, 1.0))
            forced_at.extend(range(n, n + len(part)))
            n += len(part)
        else:
            a, b = part
            parts.append(_slice(rest, a, b))  # type: ignore[arg-type]
            n += b - a
    sources = "forced" if not drafted else f"forced+{rest.source or 'then'}"  # type: ignore[union-attr]
    out = Draft(tokens=torch.cat([d.tokens for d in parts], dim=1), plan=plan, source=sources)
    for name in ("confidences", "probs"):
        got = [getattr(d, name) for d in parts]
        if all(g is not None for g in got):
            setattr(out, name, torch.cat([g.float() for g in got], dim=1))
    return out, forced_at


def _slice(draft: Draft, a: int, b: int) -> Draft:
    """Draft tokens ``a .. b-1`` of ``draft``, with their confidences and distributions."""
    cut = lambda t: None if t is None else t[:, a:b]  # noqa: E731
    return Draft(draft.tokens[:, a:b], draft.plan, cut(draft.confidences), cut(draft.probs))
