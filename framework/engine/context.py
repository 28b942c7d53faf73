"""What a strategy's one-time preparation (`Strategy.prepare`) may use: `PrepareContext`, the
engine's implementation of `framework.interfaces.PrepareView`, and `PreparedCache`, where preparations
keep what they computed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from framework.engine.adapter import ModelAdapter
from framework.engine.cost_model import CostModel, draft_sublayer_seconds
from framework.engine.decoding import SpeculativeDecoder, StopCondition
from framework.engine.token_ranking import draft_head_for
from framework.interfaces import Drafter, LayerSelector, LengthController, Verifier
from framework.kernels.fused import FusedBlocks
from framework.kernels.lowbit import LowBitLinears
from framework.kernels.protocols import weights_key
from framework.types import LayerPlan, ModelInfo
from framework.view import PlanEvaluation, RoundView

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead
    from framework.types import DraftWeights

T = TypeVar("T")


class PreparedCache:
    """What one-time preparations computed, shared by every experiment on one model (a rebuilt
    experiment, a benchmark's methods): one offline search, one cost model, one token ranking.

    Entries are keyed by the class that computed them and a key of its own (``(CostModel, (head,
    weights))``, ``(SelfSDSelector, settings)``), so that entries of different owners never meet.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[type, Hashable], Any] = {}

    def get(self, owner: type, key: Hashable) -> Any | None:
        """The entry of ``owner`` under ``key``, or ``None``."""
        return self._entries.get((owner, key))

    def put(self, owner: type, key: Hashable, value: Any) -> None:
        """Keep ``value`` as ``owner``'s entry under ``key``."""
        self._entries[(owner, key)] = value

    def once(self, owner: type, key: Hashable, compute: Callable[[], T]) -> T:
        """``owner``'s entry under ``key``, computed by ``compute()`` the first time."""
        k = (owner, key)
        if k not in self._entries:
            self._entries[k] = compute()
        return self._entries[k]

    def __len__(self) -> int:
        return len(self._entries)

    def cost_model(self) -> CostModel | None:
        """The model's own cost model (full head, own weights) once some preparation measured it
        (`PrepareContext.cost_model`), else ``None``."""
        return self.get(CostModel, _cost_key(None, None))

    def set_cost_model(self, costs: CostModel) -> None:
        """Use ``costs`` as the model's own cost model (tests and measurements that price with a
        given one instead of measuring)."""
        self.put(CostModel, _cost_key(None, None), costs)

    @classmethod
    def with_cost_model(cls, costs: CostModel) -> PreparedCache:
        """A cache that already holds ``costs`` as the model's cost model (`set_cost_model`)."""
        cache = cls()
        cache.set_cost_model(costs)
        return cache


def _cost_key(head: DraftHead | None, weights: DraftWeights | None) -> tuple[str, str]:
    return (head.key if head is not None else "", weights_key(weights))


class _FixedPlan(LayerSelector):
    """Returns one given plan every round (`PrepareContext.evaluate`)."""

    name = "fixed_plan"

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, plan: LayerPlan) -> None:
        super().__init__(self.Config())
        self._plan = plan

    def plan(self, state: RoundView) -> LayerPlan:
        return self._plan


@dataclass
class PrepareContext:
    """The engine's `framework.interfaces.PrepareView` (see there for what a preparation may use),
    built by the runner (``Session``) once the model is loaded, before the warm-up.

    Attributes:
        adapter: the `ModelAdapter` of the target model (the engine's; not part of the view).
        encode: a user message -> chat-formatted prompt token ids (the run's tokenizer and template).
        eos_token_ids: tokens that end a generation.
        artifact_stem: where a strategy may write files (``f"{artifact_stem}.<suffix>"``, next to
            the results), or ``None`` when nothing should be written.
        log: progress and notices (the runner prints them).
        progress: whether a long preparation may show a progress bar (``False``: a quiet caller).
        prepared: what preparations computed, shared across `Session.rebuild` and a
            benchmark's methods (`PreparedCache`; strategies use `once`).
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
        label: the method being prepared (``"static_confidence"``), named in progress lines;
            ``""``: none.
    """

    adapter: ModelAdapter
    encode: Callable[[str], list[int]]
    eos_token_ids: frozenset[int] = frozenset()
    artifact_stem: Any = None
    log: Callable[[str], None] = print
    progress: bool = True
    prepared: PreparedCache = field(default_factory=PreparedCache)
    dtype: str = "float32"
    load_prompts: Callable[[str, tuple[str, ...]], list[str]] | None = None
    draft_head: DraftHead | None = None
    draft_weights: DraftWeights | None = None
    label: str = ""

    @property
    def info(self) -> ModelInfo:
        return self.adapter.arch.info()

    @property
    def device(self) -> torch.device:
        return self.adapter.arch.device

    def fingerprint(self) -> str:
        """The model's weight fingerprint (`ModelAdapter.fingerprint`)."""
        return self.adapter.arch.fingerprint()

    def with_draft(self, drafter: Drafter) -> PrepareContext:
        """A copy whose `draft_head` and `draft_weights` are ``drafter``'s (once prepared); the
        `prepared` cache is shared."""
        return dataclasses.replace(
            self, draft_head=drafter.draft_head(), draft_weights=drafter.draft_weights()
        )

    def once(self, owner: type, key: Hashable, compute: Callable[[], T]) -> T:
        """``owner``'s entry of `prepared` under ``key``, computed by ``compute()`` once."""
        return self.prepared.once(owner, key, compute)

    def reduced_head(self, size: int, vocab_file: str = "", *, context: bool = True) -> DraftHead:
        """The reduced draft head of the ``size`` top-ranked tokens (or of ``vocab_file``'s
        ranking), built once per run (`framework.engine.token_ranking.draft_head_for`)."""
        return draft_head_for(self, size, vocab_file, context=context)

    def compressed_weights(
        self, fmt: str, *, check: bool = True, compress_head: bool = True
    ) -> tuple[DraftWeights | None, str]:
        """The compressed copy of the weights drafts run in format ``fmt`` (``"auto"``: the
        fastest that pays), chosen once per run (`choose_draft_weights`: with ``check``, timed
        against the model's own weights), and a note when it is not what ``fmt`` asked for;
        ``compress_head=False`` scores the reduced draft head from the model's own weights."""
        weights, note = self.once(
            PrepareContext,
            ("draft_weights", fmt, check),
            lambda: choose_draft_weights(self.adapter, fmt, check, self.log),
        )
        if isinstance(weights, FusedBlocks) and not compress_head:
            weights = weights.with_head(None)
        return weights, note

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
        on a 2-core CPU for the default model) and shared through `prepared` (one per draft head
        and weight format)."""
        head, weights = self.draft_head, self.draft_weights
        compressed = weights is not None and weights.weights != "float32"
        key = _cost_key(head, weights if compressed else None)
        hit = self.prepared.get(CostModel, key)
        if hit is not None:
            return hit
        full = self.prepared.get(CostModel, _cost_key(None, None))
        own = self.prepared.get(CostModel, _cost_key(head, None))  # the same head, own weights
        if compressed and own is not None:
            costs = own.with_weights(self.adapter, weights)
            if head is not None:  # the head, scored from its compressed copy
                costs = costs.with_head(self.adapter, head, weights=weights)
        elif full is not None and head is not None and not compressed:
            costs = full.with_head(self.adapter, head)
        else:
            what = f"{head.size}-token draft head" if head is not None else "full LM head"
            if compressed:
                what += f", {weights.weights} draft weights"
            who = f" for {self.label}" if self.label else ""
            self.log(f"[selfspec] measuring the cost model{who} ({what}; about 15 s on 2 CPU cores) ...")
            start = time.perf_counter()
            costs = CostModel.measure(self.adapter, draft_head=head, draft_weights=weights, log=self.log)
            self.log(f"[selfspec] cost model measured in {time.perf_counter() - start:.0f} s")
        self.prepared.put(CostModel, key, costs)
        return costs

    def evaluate(
        self,
        plan: LayerPlan,
        prompts: Sequence[torch.Tensor],
        *,
        length: LengthController,
        drafter: Drafter,
        verifier: Verifier,
        max_new_tokens: int,
        max_draft: int,
    ) -> PlanEvaluation:
        """Decode each prompt with ``plan`` in every round (`framework.interfaces.PrepareView.evaluate`)."""
        dec = SpeculativeDecoder(
            self.adapter, _FixedPlan(plan), length, drafter, verifier, max_draft=max_draft
        )
        stop = StopCondition(max_new_tokens)  # no EOS: every prompt yields the same token count
        results = [dec.generate(ids, stop) for ids in prompts]
        return PlanEvaluation(
            tokens=sum(r.new_tokens for r in results),
            prompts=len(results),
            wall_time=sum(r.wall_time for r in results),
            draft_lengths=tuple(k for r in results for k in r.draft_lengths),
            drafted=sum(r.drafted for r in results),
            accepted=sum(r.accepted for r in results),
            rounds=sum(len(r.accept_lengths) for r in results),
        )


def choose_draft_weights(
    adapter: ModelAdapter, fmt: str, check: bool, log: Callable[[str], None]
) -> tuple[DraftWeights | None, str]:
    """``(the weights drafts run, a note when they are not what the config asked for)``.

    A named format (``fmt``): the adapter's copy in it, dropped (``None``: the model's own) when
    there is nothing to compress or, with ``check``, when it does not draft faster (an int4 copy of
    the fused branches without its VNNI kernel is kept, with a note: its scalar loop is slow).
    ``auto``: int8 in the CPU kernels' fused branches where they run (int4 is opt-in); elsewhere
    the fastest of the fp8 and int8 copies with a fast kernel, if it drafts faster than the model's
    own weights.
    """
    own = "drafts run the model's own weights"
    if fmt == "auto":
        if adapter.fused is not None:
            return adapter.draft_branches("int8"), ""
        candidates = {f: adapter.draft_branches(f) for f in ("fp8", "int8")}
        usable = {f: w for f, w in candidates.items() if isinstance(w, LowBitLinears) and w.kernel == "fast"}
        if not usable:
            return None, f"draft_weights=auto: no fast low-bit kernel on {adapter.arch.device}: {own}"
        return _fastest(adapter, log, usable, "draft_weights=auto")
    weights = adapter.draft_branches(fmt)
    if weights is None:
        return None, f"draft_weights={fmt}: nothing to compress (the model is {adapter.arch.dtype}): {own}"
    if isinstance(weights, FusedBlocks) and fmt == "int4" and weights.int4_kernel != "avx512_vnni":
        return (
            weights,
            "draft_weights=int4: no AVX-512 VNNI in this CPU's kernels: int4 drafts run a slow scalar loop",
        )
    if not isinstance(weights, LowBitLinears) or not check:
        return weights, ""
    if weights.kernel == "reference":
        return None, (
            f"draft_weights={fmt} has no fast kernel on {adapter.arch.device} (only the float32 "
            f"reference, slower than the model's own weights): {own} (weights_check=False keeps it)"
        )
    return _fastest(adapter, log, {fmt: weights}, f"draft_weights={fmt}")


def _fastest(
    adapter: ModelAdapter, log: Callable[[str], None], options: dict[str, LowBitLinears], what: str
) -> tuple[DraftWeights | None, str]:
    """The copy among ``options`` whose draft block (one attention and one MLP sub-layer, medians
    of interleaved draft steps) is fastest, if faster than the model's own weights."""
    costs = draft_sublayer_seconds(adapter, [None, *options.values()], reps=5)
    per = {f: sum(c) for f, c in zip(["float32", *options], costs, strict=True)}
    said = ", ".join(f"{f} {t * 1e6:.0f} us" for f, t in per.items())
    best = min(options, key=per.__getitem__)
    if per[best] < per["float32"]:
        log(f"note: {what}: drafts run {best} ({options[best].kernel} kernel); a draft block: {said}")
        return options[best], ""
    return None, (
        f"{what} measured no faster than the model's own weights on {adapter.arch.device} (a draft "
        f"block: {said}): drafts run the model's own weights (weights_check=False keeps the copy)"
    )
