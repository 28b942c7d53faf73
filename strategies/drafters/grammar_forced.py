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
    ForwardSizes,
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
from framework.utils import upload

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


class _AfterForced:
    """A round view in which the forced tokens are already committed: the drafter after the run
    drafts from the last forced token, and its first draft forward feeds the run too (one forward
    for the run and the first step, as a prefill of the run)."""

    def __init__(self, state: RoundView, forced: list[int]) -> None:
        self._state = state
        self._forced = upload([forced] * state.pending.shape[0], state.device, torch.long).reshape(
            state.pending.shape[0], len(forced)
        )
        self._host = forced
        self._fed = False
        self.num_tokens = state.num_tokens + len(forced)
        self.num_new = state.num_new + len(forced)
        self.pending_position = state.pending_position + len(forced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    @property
    def pending(self) -> torch.Tensor:
        return self._forced[:, -1:]

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([self._state.tokens, self._forced], dim=1)

    @property
    def new_tokens(self) -> torch.Tensor:
        return torch.cat([self._state.new_tokens, self._forced], dim=1)

    def host_tokens(self) -> list[int]:
        return [*self._state.host_tokens(), *self._host]

    def forward_draft(self, input_ids: torch.Tensor, plan: LayerPlan | None, **kw: Any) -> Any:
        if not self._fed:  # the run's inputs first: [pending, forced[:-1], input_ids]
            self._fed = True
            input_ids = torch.cat([self._state.pending, self._forced[:, :-1], input_ids], dim=1)
        return self._state.forward_draft(input_ids, plan, **kw)


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
    draft costs the same number of forwards with or without the run. ``then: none`` drafts the
    forced runs only.

    Lossless: the target still verifies every token, and the verification's rows are masked by the
    same grammar, so a forced token is the only token its row allows and is always accepted.

    Without a grammar the forced run is always empty and the drafter is the ``then`` drafter.
    The length controller and the selector see each round whole (the forced tokens are drafted
    and accepted tokens of the round); ``summary()`` reports ``forced`` (tokens drafted by the
    grammar), ``forced_rounds``, ``rounds`` and the ``then`` drafter's summary under its name.
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

    def forward_sizes(self, max_draft: int) -> ForwardSizes:
        if self.then is None:
            return ForwardSizes()
        # a forced run of f tokens makes the first step a forward of f + 1 tokens
        return self.then.forward_sizes(max_draft) | ForwardSizes.of(chain=range(2, max_draft + 1))

    def run_notes(self, max_new_tokens: int) -> list[str]:
        return [] if self.then is None else self.then.run_notes(max_new_tokens)

    def reset(self) -> None:
        if self.then is not None:
            self.then.reset()
        self._counts = {"rounds": 0, "forced_rounds": 0, "forced": 0, "forced_accepted": 0}
        self._last_forced = 0

    def forced_run(self, state: RoundView, max_tokens: int) -> list[int]:
        """The tokens the grammar forces after the committed tokens (none without a grammar)."""
        grammar = getattr(state, "grammar", None)
        if grammar is None:
            return []
        generated = list(state.host_tokens())[state.prompt_len :]
        return grammar.forced(generated, min(max_tokens, self.config.max_forced))

    def draft(self, state: RoundView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        forced = self.forced_run(state, max_tokens)
        f = len(forced)
        self._counts["rounds"] += 1
        self._last_forced = f
        if not f:
            if self.then is None:
                return Draft.empty(state.pending.shape[0], plan, state.device)
            return self.then.draft(state, plan, length, max_tokens)
        self._counts["forced_rounds"] += 1
        self._counts["forced"] += f
        rest = None
        if self.then is not None and max_tokens > f:
            rest = self.then.draft(_AfterForced(state, forced), plan, length, max_tokens - f)  # type: ignore[arg-type]
        return _join(state, forced, rest, plan)

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        self._counts["forced_accepted"] += min(self._last_forced, result.accepted)
        self._last_forced = 0
        if self.then is not None:
            self.then.observe(state, draft, result)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._counts)
        if self.then is not None:
            inner = self.then.summary()
            if inner:
                out[self.config.then] = inner
        return out


def _join(state: RoundView, forced: list[int], rest: Draft | None, plan: LayerPlan) -> Draft:
    """The forced run followed by ``rest``'s tokens, with one-hot distributions and confidence 1
    for the forced tokens where the round keeps them."""
    batch, f, dev = state.pending.shape[0], len(forced), state.device
    tokens = upload([forced] * batch, dev, torch.long).reshape(batch, f)
    source = "forced" if rest is None or not rest.length else f"forced+{rest.source or 'then'}"
    if rest is not None and rest.length:
        plan = rest.plan
        tokens = torch.cat([tokens, rest.tokens], dim=1)
    out = Draft(tokens=tokens, plan=plan, source=source)
    want_conf = state.need_confidence or state.need_draft_probs or state.draft_top_k > 0
    more_conf = None if rest is None or not rest.length else rest.confidences
    if want_conf and (more_conf is not None or rest is None or not rest.length):
        conf = torch.ones(batch, f, device=dev)
        out.confidences = conf if more_conf is None else torch.cat([conf, more_conf.to(conf.dtype)], dim=1)
    if state.need_draft_probs:
        one_hot = torch.zeros(batch, f, state.info.vocab_size, device=dev).scatter_(
            -1, tokens[:, :f, None], 1.0
        )
        more = None if rest is None or not rest.length else rest.probs
        out.probs = one_hot if more is None else torch.cat([one_hot, more.to(one_hot.dtype)], dim=1)
    if rest is not None and rest.length and rest.host_top1 is not None:
        out.host_top1 = (1.0,) * f + tuple(rest.host_top1)
    return out
