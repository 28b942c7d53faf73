"""The token counts of the forwards a model ran after its prefills (`ForwardSizes`), recorded by
the executor while CUDA graphs are on, and what ``--cuda-graphs`` records before timing from
them (`ForwardSizes.filled`): no strategy declares its sizes (issue 56)."""

from __future__ import annotations

from dataclasses import dataclass, field

from framework.engine.execution.spec import ForwardSpec
from framework.types import AcceptanceRule


@dataclass
class ForwardSizes:
    """Token counts T of forwards, by kind.

    Attributes:
        chain: causal forwards from token ids (draft steps, plain steps, chain verifications).
        tree: token-tree verifications.
        scratch: forwards whose attention hides part of the prefix or that keep no KV (scratch
            passes, CLaSp's block evaluations): only their MLP branches take the graphs.
        checked: chain verifications with an acceptance ``rule`` inside (a graph of its own).
        rule: that rule (one without inputs: the engine can record it before timing), or ``None``.
    """

    chain: set[int] = field(default_factory=set)
    tree: set[int] = field(default_factory=set)
    scratch: set[int] = field(default_factory=set)
    checked: set[int] = field(default_factory=set)
    rule: AcceptanceRule | None = None

    def note(self, spec: ForwardSpec, rows: int) -> None:
        """A forward of ``spec`` over ``rows`` tokens ran (not a prefill)."""
        if not spec.persist or (spec.visible is not None and spec.visible != spec.base):
            self.scratch.add(rows)
        elif spec.tree_mask is not None:
            self.tree.add(rows)
        elif spec.start == 0:
            self.chain.add(rows)
            if spec.rule is not None and not spec.rule.inputs and spec.plan is None:
                self.checked.add(rows)
                self.rule = self.rule or spec.rule.fn

    def filled(self, max_draft: int, tree_width: int) -> ForwardSizes:
        """What a method of drafts of at most ``max_draft`` tokens can run, from what it ran: every
        chain of 1 .. ``max_draft`` + 1 tokens (with the rule it verified with, if any), trees of
        up to ``max_draft`` depths of ``tree_width`` candidates once it verified a tree, and
        scratch passes of up to the longest it ran."""
        chain = set(range(1, max_draft + 2)) | self.chain
        tree = set(range(2, 2 + max_draft * max(tree_width, 1))) | self.tree if self.tree else set()
        scratch = set(range(1, max(self.scratch) + 1)) if self.scratch else set()
        checked = set(range(1, max_draft + 2)) | self.checked if self.rule is not None else set()
        return ForwardSizes(chain, tree, scratch, checked, self.rule)
