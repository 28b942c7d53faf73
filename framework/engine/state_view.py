"""`StateView`: the `framework.view.RoundView` strategies receive, over a `DecodeState`.

It forwards exactly the members of the protocol and nothing else, so that a strategy cannot reach
the model adapter or the KV cache behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from framework.engine.draft_head import DraftHead
from framework.engine.state import DecodeState
from framework.types import DecodeStats, ForwardOutput, LayerPlan, ModelInfo, TokenPick


class StateView:
    """The read-only view of one generation that every strategy method of a round receives
    (`framework.view.RoundView`; see there for each member)."""

    __slots__ = ("__state",)

    def __init__(self, state: DecodeState) -> None:
        self.__state = state

    # ---- facts and counters ---------------------------------------------------------------
    @property
    def info(self) -> ModelInfo:
        return self.__state.info

    @property
    def device(self) -> torch.device:
        return self.__state.device

    @property
    def round(self) -> int:
        return self.__state.round

    @property
    def prompt_len(self) -> int:
        return self.__state.prompt_len

    @property
    def num_tokens(self) -> int:
        return self.__state.num_tokens

    @property
    def num_new(self) -> int:
        return self.__state.num_new

    @property
    def pending_position(self) -> int:
        return self.__state.pending_position

    @property
    def stats(self) -> DecodeStats:
        return self.__state.stats

    @property
    def layer_loads(self) -> int:
        return self.__state.layer_loads

    # ---- what the strategies asked for ------------------------------------------------------
    @property
    def need_confidence(self) -> bool:
        return self.__state.need_confidence

    @property
    def need_draft_probs(self) -> bool:
        return self.__state.need_draft_probs

    @property
    def draft_top_k(self) -> int:
        return self.__state.draft_top_k

    @property
    def draft_sampler(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        return self.__state.draft_sampler

    @property
    def capture_hidden(self) -> bool:
        return self.__state.capture_hidden

    @property
    def compressed_drafts(self) -> bool:
        return self.__state.compressed_drafts

    @property
    def draft_head(self) -> DraftHead | None:
        return self.__state.draft_head

    @property
    def last_hidden_states(self) -> torch.Tensor | None:
        return self.__state.last_hidden_states

    # ---- tokens ------------------------------------------------------------------------------
    @property
    def tokens(self) -> torch.Tensor:
        return self.__state.tokens

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.__state.new_tokens

    @property
    def pending(self) -> torch.Tensor:
        return self.__state.pending

    def host_tokens(self) -> Sequence[int]:
        return self.__state.host_tokens()

    # ---- forwards ----------------------------------------------------------------------------
    def prefix_plan(self, exit_layer: int) -> LayerPlan:
        return self.__state.prefix_plan(exit_layer)

    def forward_draft(
        self,
        input_ids: torch.Tensor,
        plan: LayerPlan | None,
        *,
        logits_at: str | torch.Tensor | None = "last",
        reusable: bool = False,
        pick: TokenPick | None = None,
    ) -> ForwardOutput:
        return self.__state.forward_draft(input_ids, plan, logits_at=logits_at, reusable=reusable, pick=pick)

    def forward_verify(
        self,
        input_ids: torch.Tensor,
        *,
        logits_at: str | torch.Tensor | None = "all",
        position_ids: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        check: bool = False,
    ) -> ForwardOutput:
        return self.__state.forward_verify(
            input_ids, logits_at=logits_at, position_ids=position_ids, tree_mask=tree_mask, check=check
        )

    def forward_scratch(
        self,
        start: int,
        plan: LayerPlan | None,
        *,
        end: int | None = None,
        logits_at: str | torch.Tensor | None = "all",
    ) -> ForwardOutput:
        return self.__state.forward_scratch(start, plan, end=end, logits_at=logits_at)

    def forward_block(self, block: int, states: torch.Tensor, *, position: int) -> torch.Tensor:
        return self.__state.forward_block(block, states, position=position)

    def discard_draft(self) -> None:
        self.__state.discard_draft()

    def top1_from_hidden(
        self, hidden: torch.Tensor, *, draft_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__state.top1_from_hidden(hidden, draft_head=draft_head)
