"""What a strategy's one-time preparation (`Strategy.prepare`) may use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from framework.engine.cost_model import CostModel

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead
    from framework.kernels.fused import FusedBlocks


@dataclass
class PrepareContext:
    """What a one-time preparation step (`Strategy.prepare`) may use: the model and a way to make
    prompts. Built by the runner (``Experiment``) once the model is loaded, before the warm-up.

    Attributes:
        adapter: the `ModelAdapter` of the target model.
        encode: a user message -> chat-formatted prompt token ids (the run's tokenizer and template).
        eos_token_ids: tokens that end a generation.
        artifact_stem: where a strategy may write files (``f"{artifact_stem}.<suffix>"``, next to
            the results), or ``None`` when nothing should be written.
        log: progress and notices (the runner prints them).
        store: shared across `Experiment.rebuild`: a strategy that did expensive work (an offline
            search) keeps its result here, keyed by its config, so fresh instances reuse it.
        dtype: the model's dtype name (``"float32"``), recorded in artefacts.
        load_prompts: ``(source, categories) -> user messages``: the first turns of a Spec-Bench
            JSONL file (``source``), or of the built-in calibration set when ``source`` is empty,
            filtered by category; raises ``ValueError`` naming the file and line of bad input.
            Supplied by the runner, so that strategies need no data-loading code of their own
            (see `calibration_prompts`).
        draft_head: the reduced LM head the run's drafter scores draft tokens with
            (`framework.engine.draft_head.DraftHead`), ``None`` for the full head. Set by
            `SpeculativeDecoder.prepare` after the drafter's own preparation (which builds it), so
            that selectors searching draft-like passes and the cost model use the draft that runs.
        draft_weights: the compressed weights the run's drafter drafts with
            (`framework.engine.adapter.ModelAdapter.draft_branches`), ``None`` for the model's
            own; set with ``draft_head``.
    """

    adapter: Any
    encode: Callable[[str], list[int]]
    eos_token_ids: frozenset[int] = frozenset()
    artifact_stem: Any = None
    log: Callable[[str], None] = print
    store: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    load_prompts: Callable[[str, tuple[str, ...]], list[str]] | None = None
    draft_head: DraftHead | None = None
    draft_weights: FusedBlocks | None = None

    def calibration_prompts(self, source: str = "", categories: tuple[str, ...] = ()) -> list[str]:
        """Calibration prompts (user messages) for an offline search: the first turns of
        ``source`` (a Spec-Bench JSONL file; empty: the built-in calibration set).

        Raises:
            ValueError: unreadable or empty data (the message names the file and line), or a
                context built without ``load_prompts``.
        """
        if self.load_prompts is None:
            raise ValueError("this PrepareContext has no load_prompts: the runner supplies one")
        return self.load_prompts(source, tuple(categories))

    def cost_model(self) -> CostModel:
        """The measured `framework.engine.cost_model.CostModel` of this model on this machine, its
        draft steps priced with `draft_head` and `draft_weights`; measured on first use (about 15 s
        on a 2-core CPU for the default model) and shared through ``store`` (one per draft head and
        weight format)."""
        weights = self.draft_weights
        compressed = weights is not None and weights.weights != "float32"
        head_key = "cost_model" if self.draft_head is None else f"cost_model:{self.draft_head.key}"
        key = f"{head_key}:weights={weights.weights}" if compressed else head_key
        if key not in self.store:
            full = self.store.get("cost_model")
            own = self.store.get(head_key)  # the same head, the model's own weights
            if compressed and own is not None:
                self.store[key] = own.with_weights(self.adapter, weights)
            elif full is not None and self.draft_head is not None and not compressed:
                self.store[key] = full.with_head(self.adapter, self.draft_head)
            else:
                self.store[key] = CostModel.measure(
                    self.adapter, draft_head=self.draft_head, draft_weights=weights
                )
        return self.store[key]
