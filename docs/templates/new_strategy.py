"""``my_length``: one line saying what the strategy does (this line is the module summary).

A copyable skeleton for a new strategy. Copy it to ``strategies/<kind>/<name>.py`` (or into your
own package and load it with ``--import``), then replace every ``my_length`` / ``MyLength`` and
each TODO. It is written as a length controller; for another kind, swap the base class, the
decorator and the methods as listed below.

- selector: base ``LayerSelector``, decorator ``register_selector``; implement
  ``plan(state) -> LayerPlan``; optional ``observe(state, draft, result)``.
- length: base ``LengthController``, decorator ``register_length``; implement
  ``max_length(state, hint) -> int`` (``hint``: the selector's `LengthHint` or ``None``; ignore it
  unless you use it); optional ``should_continue(drafted, confidence)`` and
  ``observe(state, draft, result)`` (the same signature on all four interfaces).
- drafter: base ``Drafter``, decorator ``register_drafter``; implement
  ``draft(state, plan, length, max_tokens) -> Draft``.
- verifier: base ``Verifier``, decorator ``register_verifier``; implement
  ``verify(state, draft) -> Verification``; optional ``choose(logits)``.

Every kind may also override ``setup(info)`` (once, with the model's facts), ``reset()`` (before
each generation) and ``summary()`` (a dict logged per generation).

Checklist (details in CONTRIBUTING.md):

1. the import line in ``strategies/<kind>/__init__.py``;
2. contract tests: a class inheriting ``framework.testing.<Kind>Contract`` with ``make()``;
3. a docs page ``docs/strategies/<dir>/<name>.md`` that names every config field;
4. a benchmark result against vanilla, with the command that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework import Draft, LengthController, LengthHint, ModelInfo, RoundView, Verification, register_length
from framework.config_fields import check_range, check_types, param


@dataclass(frozen=True)
class MyLengthConfig:
    # One field per hyper-parameter: a default and a one-line help with the allowed range. The
    # field name is the CLI flag (--length.start) and appears in `run.py --list`.
    start: int = param(4, help="draft length of the first round; >= 1")
    max_length: int = param(12, help="upper bound on the draft length of one round; >= 1")

    def __post_init__(self) -> None:
        # Validate every field: check_types checks each against its annotation (booleans, Literal
        # choices, strings), check_range the ranges; each raises ConfigError naming the field, the
        # value and what is allowed. Never use assert for user input.
        check_types(self)
        check_range("start", self.start, 1)
        check_range("max_length", self.max_length, 1)


@register_length("my_length", config=MyLengthConfig)
class MyLength(LengthController):
    """One line for ``--list``: what the strategy does.

    TODO: cite the paper it implements, and the section or equation, e.g.
    "The draft-exit rule of Draft & Verify (Zhang et al., ACL 2024), Section 3.4." Say where the
    implementation departs from the paper or its released code, and why.
    """

    # Capability flags (ClassVars) tell the engine what to compute; leave them False unless needed.
    # needs_confidence = True          # LengthController: draft top-1 probabilities
    # needs_hidden_states = True       # LayerSelector: per-layer hidden states of the verify pass
    # needs_draft_probs = True         # Verifier: full draft distributions

    def setup(self, info: ModelInfo) -> None:
        # Called once with the model's facts; check the config against the model here.
        self._cap = self.config.max_length

    def reset(self) -> None:
        # Called before each generation; reset per-generation state here.
        self._k = min(self.config.start, self._cap)

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        # TODO: the draft length bound of the next round (0 declines to draft this round).
        return self._k

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        # TODO: update after each verification. Example: grow after a fully accepted draft,
        # shrink otherwise, within [1, max_length].
        if draft.length == 0:
            return
        if result.accepted == draft.length:
            self._k = min(self._k + 1, self._cap)
        else:
            self._k = max(self._k - 1, 1)

    def summary(self) -> dict:
        # Per-generation statistics written to the results file (strategy_summary).
        return {"final_k": self._k}


# Contract tests: put this in tests/strategies/<kind>/test_<name>.py (or run this file with
# `python -m pytest -q path/to/this_file.py` after uncommenting).
#
# from framework.testing import LengthControllerContract
#
# class TestMyLength(LengthControllerContract):
#     def make(self):
#         return MyLength(MyLengthConfig(start=2))
