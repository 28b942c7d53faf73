"""What a strategy may read and call: the typed, read-only views of a round and of a preparation.

Strategies see the engine through these protocols only. Every strategy method of a round (``plan``,
``length_hint``, ``max_length``, ``observe``) takes a `RoundView`: the tokens, the hidden states a
strategy asked for (its capability flags), the model's facts, the counters of the generation, its
device work and its read. A drafter's ``draft`` takes a `DraftView`, the round view with the draft
forwards and the draft's bookkeeping; a verifier's ``verify`` takes a `VerifyView`, the round view
with the verification forward. The KV-cache bookkeeping of every forward is the engine's. The one-time
``prepare`` takes a `framework.interfaces.PrepareView` (declared beside the strategies it hands
to: the model's facts, prompts to calibrate on, the measured cost model, and
`PrepareView.evaluate`, the search service that decodes prompts with a candidate plan; this module
holds what it returns, `PlanEvaluation`). Neither exposes the model adapter or the KV cache. The engine's objects implement them
(`framework.engine.state.DecodeState`, handed out as it is, and
`framework.engine.context.PrepareContext`); `tests/framework/test_layering.py` holds each strategy
function to the members of the view its ``state`` is annotated with.

Shape notation as in `framework.types`: ``B`` batch (1), ``T`` tokens in one forward, ``N``
committed tokens, ``V`` vocabulary, ``L`` blocks, ``d`` hidden size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from framework.types import (
    AcceptanceRule,
    DecodeStats,
    Draft,
    ForwardOutput,
    LayerPlan,
    ModelInfo,
    ReducedHead,
)


@runtime_checkable
class RoundView(Protocol):
    """One generation as a strategy sees it, between and during rounds.

    Invariant between rounds: every committed token but the last (`pending`) has KV in every
    layer; `pending` is the first input of the next draft and of the next verification.

    Attributes:
        info: the model's facts (blocks, hidden size, vocabulary, context, dtype, device).
        device: where the model runs.
        round: rounds committed so far in this generation.
        prompt_len: P, the prompt's tokens.
        num_tokens: N, the prompt and every committed new token (`pending` included).
        num_new: N - P.
        pending_position: the position of `pending`: the first KV slot not committed.
        draft_head: the generation's reduced draft head (``None``: the full LM head).
        last_hidden_states: FloatTensor (L+1, B, T, d) of the last verification (or the prefill),
            when `capture_hidden`; index 0 is the embedding.
        stats: the generation's counters (per-round records, phase timings, forward counts).
        layer_loads: blocks entered by the model's forwards so far, whatever their token count
            (DEL's "layers loaded" cost), counted over the model's lifetime: read differences.
    """

    info: ModelInfo
    device: torch.device
    round: int
    prompt_len: int
    num_tokens: int
    num_new: int
    pending_position: int
    draft_head: ReducedHead | None
    last_hidden_states: torch.Tensor | None
    stats: DecodeStats
    layer_loads: int

    @property
    def tokens(self) -> torch.Tensor:
        """LongTensor (B, N): the prompt and every committed new token."""

    @property
    def new_tokens(self) -> torch.Tensor:
        """LongTensor (B, N - P): the generated tokens so far."""

    @property
    def pending(self) -> torch.Tensor:
        """LongTensor (B, 1): the last committed token, whose KV is not cached yet."""

    def token_ids(self) -> Sequence[int]:
        """Batch row 0's committed tokens as Python ints (no device read for what commits already
        brought to the host), then the tokens `DraftView.force` drafted before the round's first
        draft step (the context a drafter continues). Read-only."""

    def prefix_plan(self, exit_layer: int) -> LayerPlan:
        """The plan that runs blocks ``0..exit_layer-1`` unchanged, then the LM head."""

    def forward_scratch(
        self,
        start: int,
        plan: LayerPlan | None,
        *,
        end: int | None = None,
        logits_at: str | torch.Tensor | None = "all",
    ) -> ForwardOutput:
        """Teacher-forced draft pass over committed tokens ``[start, end)`` that leaves the
        committed cache untouched (SWIFT's candidate scoring)."""

    def top1_from_hidden(
        self, hidden: torch.Tensor, *, draft_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy token and its probability for pre-norm residuals (..., d) through the final
        norm and the LM head (DEL's shadow tokens): the full head, or with ``draft_head`` the
        generation's `draft_head` (the full head when there is none)."""

    def compute(self, fn: Callable[..., Any], *inputs: torch.Tensor | None, **params: Any) -> Any:
        """Hand the engine your per-round device work: ``fn(ops, *inputs, **params)``, where
        ``ops`` is the engine's `DeviceOps` (the LM head, random numbers), ``inputs`` tensors and
        ``params`` plain values (numbers, strings, dtypes, tuples and frozen dataclasses of them,
        module-level functions). Returns what ``fn`` returns (tensors: a dict, tuple or one).

        Write ``fn`` as a module-level function of its arguments: the engine keys it by its name,
        its bound values and the inputs' shapes and dtypes, and runs it as one CUDA graph where
        forwards run as one (`framework.engine.execution.work`). A closure, a lambda, a bound method or a
        value that is not plain runs eagerly instead, with one warning naming your line."""

    def compute_at(
        self, position: int, fn: Callable[..., Any], *inputs: torch.Tensor | None, **params: Any
    ) -> Any:
        """`compute`, with ``ops.block(b, states (n, d))``: decoder block b on n candidate states
        of the committed ``position`` (each attends to the context before it and to itself; the
        cache is untouched): CLaSp's dynamic programme."""

    def read(self, **values: torch.Tensor) -> dict[str, list[Any]]:
        """The round's one device-to-host read, for verifiers: each value by name, flattened into
        Python numbers (ints for an integer tensor). What the strategies' ``reads`` asked for
        travels in the same transfer; what the engine already knows on the host (a stop rule's
        confidences, what was read or uploaded this round, views of them) is not read again."""

    def tensor(self, values: Sequence[Any], dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host ``values`` (numbers, or equal-length lists of them) on the device, without waiting
        for it; the engine knows them on the host (a verifier's committed tokens built on the host
        cost the commit no read)."""

    def constant(self, values: Any, dtype: torch.dtype = torch.long, *, key: Any = None) -> torch.Tensor:
        """``values`` on the device once per model, shared (index tables, tree shapes, masks);
        ``key`` names them instead of their values, and ``values`` may then be a function called
        the first time only. Do not modify the tensor."""

    def values_for(self, strategy: Any) -> Mapping[str, list[Any]]:
        """What ``strategy.reads`` asked for, read by name: the prompt's until the first round
        commits, then each round's (read with the verifier's read, or by the engine at the commit
        when the verifier read nothing it could join). Empty when it asked for nothing."""


@runtime_checkable
class DraftView(RoundView, Protocol):
    """The round as a drafter's ``draft`` sees it: the `RoundView`, the draft forwards and the
    draft's bookkeeping (the engine chooses each token the way the verifier wants it and keeps what
    the other strategies asked for).

    Attributes:
        compressed_drafts: draft passes run a compressed copy of the weights (no early-exit KV
            reuse then).
        grammar: the generation's grammar matcher (`framework.engine.grammar.GrammarState`;
            ``forced(generated, limit)``: the tokens it forces next), or ``None`` without a grammar.
    """

    compressed_drafts: bool
    grammar: Any

    def draft_step(
        self, input_ids: torch.Tensor, plan: LayerPlan | None, *, reusable: bool = False
    ) -> tuple[torch.Tensor, float | None]:
        """Feed the next draft input(s) (B, T) through the draft ``plan`` and let the engine
        choose the next token from the last row, as the verifier wants it (sampled, or the
        argmax), keeping what the other strategies asked for. ``reusable``: ``plan`` is a pure
        prefix whose blocks the verification may keep (early exit). Returns ``(token (B,),
        confidence)``: row 0's top-1 draft probability, ``None`` unless a length controller asked
        for it."""

    def drop_draft_step(self, confidence: float | None = None) -> None:
        """Forget the last draft token (a drafter that stops before keeping it, as DEL does);
        ``confidence``: what `draft_step` returned for it."""

    def drafted(self, plan: LayerPlan) -> Draft:
        """The round's `Draft` of the tokens `draft_step` chose (possibly none), with ``plan``."""

    def copied_draft(self, tokens: Sequence[int], plan: LayerPlan, confidence: float) -> Draft:
        """A draft of ``tokens`` copied from the context (no forward), each with ``confidence``,
        with the extras the other strategies asked for (a one-hot draft distribution), after the
        tokens `force` drafted."""

    def force(
        self, tokens: Sequence[int], *, after: Callable[[list[int]], Sequence[int]] | None = None
    ) -> None:
        """Draft ``tokens`` with no forward of their own, as known tokens (confidence 1, a one-hot
        draft distribution), for a drafter that wraps another (``grammar_forced``): they come first
        in the round's `Draft` (`drafted`, `copied_draft`), `token_ids` ends with them, and they
        ride along after the input of the next `draft_step`. ``after``: called with the tokens fed
        to each later `draft_step` (those the drafter drafted, as ints); the tokens it returns are
        drafted after them the same way and ride along in that forward."""

    def forward_draft(
        self,
        input_ids: torch.Tensor,
        plan: LayerPlan | None,
        *,
        logits_at: str | torch.Tensor | None = "last",
        reusable: bool = False,
    ) -> ForwardOutput:
        """Feed draft token(s) (B, T) through the draft ``plan`` and return its logits, for a
        drafter that chooses tokens its own way (`draft_step` chooses them for you; see
        `framework.engine.state.DecodeState.forward_draft`)."""

    def discard_draft(self) -> None:
        """Forget the current round's draft KV (a drafter that gives up)."""


@runtime_checkable
class VerifyView(RoundView, Protocol):
    """The round as a verifier's ``verify`` sees it: the `RoundView` and the verification forward."""

    def forward_verify(
        self,
        input_ids: torch.Tensor,
        *,
        logits_at: str | torch.Tensor | None = "all",
        position_ids: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        rule: AcceptanceRule | None = None,
        rule_inputs: Sequence[torch.Tensor | None] = (),
    ) -> ForwardOutput:
        """Full-model forward over a block (B, T) starting at `pending_position`, the draft's KV
        discarded first (see `framework.engine.state.DecodeState.forward_verify`). ``rule``: the
        verifier's acceptance rule, ``rule(ops, ids, logits, *rule_inputs) -> dict of tensors``
        (`framework.types.AcceptanceRule`), which the engine folds into the forward (inside its
        one graph on a GPU) and whose outputs come back by name in ``ForwardOutput.ruled``."""


class DeviceOps(Protocol):
    """What a device function handed to `RoundView.compute` may ask of the engine (its first
    argument). Everything here runs inside the function's graph where there is one."""

    def top1(self, hidden: torch.Tensor, *, draft_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy token (LongTensor) and its top-1 probability (float32) of pre-norm
        residuals (..., d) through the final norm and the LM head, or with ``draft_head`` the
        generation's reduced draft head (the full head when there is none): DEL's shadow tokens."""

    def block(self, b: int, states: torch.Tensor) -> torch.Tensor:
        """Decoder block ``b`` on candidate states (n, d) of `RoundView.compute_at`'s position."""

    def uniform(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Uniform numbers in [0, 1) from the generation's random stream (the verifier's)."""

    def exponential(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exp(1) numbers from the generation's random stream."""


@dataclass(frozen=True)
class PlanEvaluation:
    """What `PrepareView.evaluate` measured for one plan over a set of prompts.

    Attributes:
        tokens: new tokens decoded in total (each prompt's first comes from its prefill).
        prompts: prompts decoded.
        wall_time: seconds, prefills included.
        draft_lengths: tokens drafted per round, over every prompt in order.
        drafted: draft tokens proposed.
        accepted: draft tokens accepted.
        rounds: verification rounds.
    """

    tokens: int
    prompts: int
    wall_time: float
    draft_lengths: tuple[int, ...]
    drafted: int
    accepted: int
    rounds: int

    @property
    def alpha(self) -> float:
        """Accepted / drafted draft tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """M: tokens committed per round, the prefills' tokens not counted."""
        return (self.tokens - self.prompts) / self.rounds if self.rounds else 0.0
