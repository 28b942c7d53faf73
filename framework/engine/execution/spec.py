"""What one forward computes (`ForwardSpec`), passed whole from the caller to the route choice,
the block loop and the graph store; and `GraphKey`, the part of it that a whole-forward graph is
keyed by (derived here, never written twice)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from framework.kernels.protocols import DraftWeights
from framework.types import AcceptanceRule, LayerPlan, RandomStream, TokenPick

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead

#: What ``logits_at`` may be besides a LongTensor of positions.
LOGITS_AT = ("all", "last", None)


@dataclass(frozen=True, eq=False)
class ForwardSpec:
    """What one forward runs and returns (`framework.engine.execution.executor.Executor.run`).

    Attributes:
        plan: sub-layers to skip / the exit layer; ``None`` runs every sub-layer.
        start: the first block to run (``0 <= start <= stop``): residuals that went through blocks
            ``< start`` already (verification completing an early-exit draft's blocks).
        stop: one past the last block; ``None``: ``plan.blocks_run`` (L without a plan).
        logits_at: ``"all"``, ``"last"``, a LongTensor of positions in ``[0, T)``, or ``None``
            (no LM head at all).
        capture_hidden: also return the residual after each block run (index 0: the input).
        base, visible, tree_mask, persist: where the new tokens' KV goes and what they attend to
            (`framework.engine.kv_cache.KVCache.begin`): a scratch pass (``persist=False``) leaves
            the committed cache untouched; a ``tree_mask`` (T, T) verifies a token tree.
        head: a reduced draft head for the logits (``None``: the full LM head).
        weights: a draft's compressed copy of the weights (``ModelAdapter.draft_branches``: the
            fused branches' or the modules' low-bit linear layers) to run instead of the model's
            own (``None``: the model's weights).
        pick: choose a token from the last row's logits inside the forward
            (`framework.types.TokenPick`; part of its graph on the whole-forward route); ignored
            with a reduced ``head`` (its logits come after the graph: the caller chooses).
        rule: a verifier's acceptance rule run inside the forward (`RuleCall`); needs
            ``logits_at="all"``, the full LM head and token ids.
    """

    plan: LayerPlan | None = None
    start: int = 0
    stop: int | None = None
    logits_at: str | torch.Tensor | None = "all"
    capture_hidden: bool = False
    base: int | None = None
    visible: int | None = None
    tree_mask: torch.Tensor | None = None
    persist: bool = True
    head: DraftHead | None = None
    weights: DraftWeights | None = None
    pick: TokenPick | None = None
    rule: RuleCall | None = None

    def end(self, num_layers: int) -> int:
        """One past the last block this forward runs on a model of ``num_layers`` blocks."""
        if self.stop is not None:
            return self.stop
        return num_layers if self.plan is None else self.plan.blocks_run

    def validate(self, num_layers: int) -> None:
        """Raise a ValueError naming what is wrong: a plan of another depth, a block range outside
        ``[0, L]``, an unknown ``logits_at``, or a check without every row's full logits."""
        plan, n = self.plan, num_layers
        if plan is not None and plan.num_layers != n:
            raise ValueError(f"the plan has {plan.num_layers} blocks but the model has {n}")
        stop = self.end(n)
        if not 0 <= self.start <= stop <= n:
            raise ValueError(
                f"block range must satisfy 0 <= start <= stop <= {n}, got [{self.start}, {stop})"
            )
        at = self.logits_at
        if isinstance(at, str) and at not in LOGITS_AT or not isinstance(at, (str, torch.Tensor, type(None))):
            raise ValueError(f"logits_at must be 'all', 'last', a tensor or None, got {at!r}")
        if self.rule is not None and (not isinstance(at, str) or at != "all" or self.head is not None):
            raise ValueError("an acceptance rule needs logits_at='all' and the full LM head")

    def graph_key(
        self, rows: int, span: int, weights: str, rule: Hashable | None = None, head: Hashable | None = None
    ) -> GraphKey:
        """The key of this forward's whole graph over ``rows`` tokens reading ``span`` slots with
        ``weights`` (``"model"`` or a low-bit format), the acceptance ``rule``'s key inside it
        (``None``: none, or one that runs after the graph) and the reduced draft ``head``'s
        identity (``DraftHead.graph_key``; the graph holds its `DraftHead.fixed` form)."""
        if self.logits_at is None or (self.head is not None and head is None):
            logits = "none"
        else:
            logits = "all" if self.head is None else "head"
        return GraphKey(
            self.plan,
            rows,
            span,
            logits,
            self.capture_hidden,
            self.tree_mask is not None,
            weights,
            self.pick if logits != "none" else None,
            rule if logits == "all" else None,
            head if logits == "head" else None,
        )


@dataclass(frozen=True)
class GraphKey:
    """What a whole-forward graph computes (`ForwardSpec.graph_key`).

    Attributes:
        plan: the layer plan (``None``: every sub-layer).
        rows: T, the tokens of the forward.
        span: the attention span (slots read).
        logits: ``"all"`` (every row's; a caller's ``"last"`` or positions are taken from them
            after the graph), ``"head"`` (every row's through a reduced draft head that does not
            grow) or ``"none"`` (no LM head in the graph).
        hidden: return every block's residual (index 0: the embedding).
        tree: the rows form a token tree (a tree mask), else a causal chain.
        weights: ``"model"`` or a draft's low-bit format (`framework.kernels.lowbit`).
        pick: the token chosen from the last row's logits in the graph, or ``None``.
        rule: the acceptance rule run in the graph: its derived key and the draws it makes
            (`framework.engine.execution.work`), or ``None``.
        head: the reduced draft head in the graph (its key and size), or ``None``.
    """

    plan: LayerPlan | None
    rows: int
    span: int
    logits: str = "all"
    hidden: bool = False
    tree: bool = False
    weights: str = "model"
    pick: TokenPick | None = None
    rule: Hashable | None = None
    head: Hashable | None = None


@dataclass(frozen=True, eq=False)
class RuleCall:
    """A verifier's acceptance rule for one verify forward (`framework.types.AcceptanceRule`).

    Attributes:
        fn: ``fn(ops, ids, logits, *inputs) -> dict of tensors``.
        inputs: its tensors after the block's ids and logits (``None`` allowed).
        random: the generation's random stream its draws come from (``None``: it draws nothing).
        ids: the block's token ids, for a forward from residuals (a verification that reuses an
            early-exit draft's lower blocks; ``None``: the forward's own ids).
        fed: the inputs that draft fed (B, n), whose rows the forward reused: the rule sees ``-1``
            for the block's tokens from where it leaves them (`seen_ids`).
    """

    fn: AcceptanceRule
    inputs: tuple = ()
    random: RandomStream | None = None
    ids: torch.Tensor | None = None
    fed: torch.Tensor | None = None


def seen_ids(input_ids: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """A verified block ``input_ids`` (B, T) as the rows of a verification that reused an
    early-exit draft saw it, the draft having fed ``fed`` (B, n), ``n <= T``: from the first
    position where the block leaves what the draft fed, every token is ``-1``. Rows from there on
    saw the draft's inputs (attention is causal: rows before it did not), so an acceptance rule
    accepts none of them, and what it accepts is what the full forward accepts."""
    n = fed.shape[1]
    same = (input_ids[:, :n] == fed).cumprod(dim=1).bool()  # (B, n)
    tail = same[:, -1:].expand(-1, input_ids.shape[1] - n)
    return torch.where(torch.cat([same, tail], dim=1), input_ids, -1)
