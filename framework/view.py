"""What a strategy may read and call: the typed, read-only views of a round and of a preparation.

Strategies see the engine through these protocols only. Every strategy method of a round (``plan``,
``length_hint``, ``max_length``, ``draft``, ``verify``, ``observe``) takes a `RoundView`: the
tokens, the hidden states a strategy asked for (its capability flags), the model's facts, the
counters of the generation and the forwards whose KV-cache bookkeeping the engine owns. The one-time
``prepare`` takes a `framework.interfaces.PrepareView` (declared beside the strategies it hands
to: the model's facts, prompts to calibrate on, the measured cost model, and
`PrepareView.evaluate`, the search service that decodes prompts with a candidate plan; this module
holds what it returns, `PlanEvaluation`). Neither exposes the model adapter or the KV cache. The engine's objects implement them
(`framework.engine.state.DecodeState`, handed out as it is, and
`framework.engine.context.PrepareContext`); `tests/framework/test_layering.py` holds strategies to
the views' members.

Shape notation as in `framework.types`: ``B`` batch (1), ``T`` tokens in one forward, ``N``
committed tokens, ``V`` vocabulary, ``L`` blocks, ``d`` hidden size.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from framework.types import (
    DecodeStats,
    ForwardOutput,
    LayerPlan,
    ModelInfo,
    ReducedHead,
    Ride,
    TokenPick,
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
        need_confidence: drafters compute each step's top-1 probability (some length controller
            asked for it).
        need_draft_probs: drafters keep their full distributions (the verifier asked).
        draft_top_k: top candidates per draft step the drafter keeps (0: none).
        draft_sampler: how drafters pick a token (``None``: argmax; else ``logits (B, V) ->
            (tokens (B,), probs (B, V))``, the verifier's warped sampler).
        capture_hidden: verifications return every layer's hidden states (the selector asked).
        compressed_drafts: draft passes run a compressed copy of the weights (no early-exit KV
            reuse then).
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
    need_confidence: bool
    need_draft_probs: bool
    draft_top_k: int
    draft_sampler: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
    capture_hidden: bool
    compressed_drafts: bool
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

    def host_tokens(self) -> Sequence[int]:
        """Batch row 0's committed tokens as Python ints (no device read for what commits already
        brought to the host). Read-only."""

    def prefix_plan(self, exit_layer: int) -> LayerPlan:
        """The plan that runs blocks ``0..exit_layer-1`` unchanged, then the LM head."""

    def forward_draft(
        self,
        input_ids: torch.Tensor,
        plan: LayerPlan | None,
        *,
        logits_at: str | torch.Tensor | None = "last",
        reusable: bool = False,
        pick: TokenPick | None = None,
    ) -> ForwardOutput:
        """Feed the next draft token(s) (B, T) through the draft ``plan`` (see
        `framework.engine.state.DecodeState.forward_draft`); ``pick``: choose the next token inside
        the forward (``ForwardOutput.picked``; `framework.drafting.builder.DraftBuilder.pick`)."""

    def forward_verify(
        self,
        input_ids: torch.Tensor,
        *,
        logits_at: str | torch.Tensor | None = "all",
        position_ids: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        check: bool = False,
    ) -> ForwardOutput:
        """Full-model forward over a block (B, T) starting at `pending_position`, the draft's KV
        discarded first (see `framework.engine.state.DecodeState.forward_verify`); ``check``: the
        greedy verification of the block's own tokens inside the forward
        (``ForwardOutput.checked``, `framework.types.greedy_check`)."""

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

    def forward_block(self, block: int, states: torch.Tensor, *, position: int) -> torch.Tensor:
        """Decoder block ``block`` on n candidate states (n, d) of the committed ``position``,
        the committed cache untouched (CLaSp's dynamic programme)."""

    def discard_draft(self) -> None:
        """Forget the current round's draft KV (a drafter that gives up)."""

    def top1_from_hidden(
        self, hidden: torch.Tensor, *, draft_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy token and its probability for pre-norm residuals (..., d) through the final
        norm and the LM head (DEL's shadow tokens): the full head, or with ``draft_head`` the
        generation's `draft_head` (the full head when there is none)."""

    def run_static(
        self, key: Hashable, fn: Callable[..., dict[str, torch.Tensor]], *inputs: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Run your own per-round device work ``fn(*inputs)`` as forwards run: one CUDA graph on
        the ``forward`` route (keyed by ``key`` and the inputs' shapes), eagerly otherwise
        (`framework.engine.adapter.ModelAdapter.run_static`: what ``fn`` may do)."""

    def run_with_blocks(
        self,
        key: Hashable,
        fn: Callable[..., dict[str, torch.Tensor]],
        *inputs: torch.Tensor,
        position: int,
        rows: int,
    ) -> dict[str, torch.Tensor]:
        """``fn(*inputs, run_block)``, whose model calls are ``run_block(b, states (n, d))`` (as
        `forward_block` at the committed ``position``, n <= ``rows``): one CUDA graph on the
        ``forward`` route, eagerly otherwise (CLaSp's dynamic programme)."""

    def ride(self, compute: Callable[[torch.Tensor], torch.Tensor | None]) -> Ride:
        """Have ``compute`` (``hidden (L+1, B, T, d) -> values or None``) run on this round's
        verified chain and its values read with the verifier's read (`Ride`); register it in
        ``plan``. ``Ride.values`` stays ``None`` when it could not ride: read by yourself then."""

    def read(self, values: torch.Tensor) -> list[Any]:
        """The round's one device-to-host read, for verifiers: ``values`` flattened, as Python
        numbers (ints for an integer tensor), with this round's rides in the same transfer."""


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
