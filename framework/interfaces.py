"""The four strategy interfaces and the typed objects passed between the stages of a round.

One round of self-speculative decoding (see ``docs/concepts.md``)::

    plan   = selector.plan(state)                          # LayerPlan
    hint   = selector.length_hint(state)                   # LengthHint | None (most selectors: None)
    k_max  = length.max_length(state, hint)                # 0 = do not draft this round
    draft  = drafter.draft(state, plan, length, k_max)     # Draft, calls length.should_continue
    result = verifier.verify(state, draft)                 # Verification
    state.commit(result)                                   # tokens + KV cache to accepted length
    for s in (selector, length, drafter, verifier):        # the same signature on all four
        s.observe(state, draft, result)

``state`` is the typed, read-only `framework.view.RoundView` of the generation (never the engine's
decode state itself); ``prepare(ctx)`` receives a `framework.interfaces.PrepareView`.

A declined round (``k_max == 0``) still verifies (an empty draft: one plain target step) and is
observed like any other.

Shape notation: ``B`` batch (1 for now; objects are batch-shaped so that B > 1 can come later),
``K`` draft length, ``T`` tokens in one forward, ``V`` vocabulary, ``L`` decoder blocks, ``d`` hidden
size. Tensors are annotated ``name: LongTensor (B, K)`` in docstrings.

Capability flags are ``ClassVar``s that tell the engine what to compute, so that nobody pays for
what no strategy asked for (``LayerSelector.needs_hidden_states``,
``LengthController.needs_confidence``, ``LengthController.exact_length``,
``Verifier.needs_draft_probs``, ``Strategy.needs_phase_timings``).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from framework.registry import BuiltinPackage, Registry
from framework.types import (
    CostPrices,
    Draft,
    DraftWeights,
    LayerPlan,
    LengthHint,
    ModelInfo,
    RandomStream,
    ReducedHead,
    Verification,
)
from framework.view import DraftView, PlanEvaluation, RoundView, VerifyView

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Interfaces
# --------------------------------------------------------------------------------------------


class Strategy(ABC):
    """Common base: a config object, a one-time ``setup`` and a per-prompt ``reset``.

    Subclasses are registered with a frozen config dataclass; ``cls.Config`` and ``cls.name`` are
    set by the registry decorator.
    """

    Config: ClassVar[type]
    name: ClassVar[str] = ""
    #: The decoder must time every phase of a round (``DecodeStats.timings``) even where that
    #: costs device waits (CUDA): the strategy reads the timings itself (a draft gate that
    #: measures its costs). An instance may decide it (a property).
    needs_phase_timings: ClassVar[bool] = False
    #: Import names of packages the strategy needs beyond the engine's (``("botorch",)``): the
    #: runner checks them with the configuration, before the model loads.
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any | None = None) -> None:
        cfg_cls = getattr(type(self), "Config", None)
        if config is None:
            if cfg_cls is None:
                raise TypeError(f"{type(self).__name__} has no Config; register it or pass a config")
            config = cfg_cls()
        elif cfg_cls is not None and not isinstance(config, cfg_cls):
            raise TypeError(
                f"{type(self).__name__} expects a {cfg_cls.__name__}, got {type(config).__name__}"
            )
        self.config = config

    def setup(self, info: ModelInfo) -> None:  # noqa: B027 - optional hook
        """Called once with the model's facts before the first prompt (validate against it here)."""

    def prepare(self, ctx: PrepareView) -> None:  # noqa: B027 - optional hook
        """Called once per experiment after ``setup``, before the warm-up, with the model and a
        prompt encoder: offline work (e.g. Self-SD's Bayesian search of the skip set) goes here.
        Must be cheap when repeated with the same ``ctx`` (keep results with ``ctx.once``)."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Called before each generation (each turn of each prompt).

        Strategies whose state carries across prompts (e.g. SWIFT's optimisation) keep it here.
        """

    def reads(self, state: RoundView, chain: torch.Tensor) -> Mapping[str, torch.Tensor] | None:
        """Device values to read, by name, from a verified chain's hidden states ``chain``
        (L+1, B, T, d: the prompt's at the prefill, then each round's verified block; only when
        some selector asked for hidden states). They travel in the round's one device-to-host
        transfer and reach this strategy, by name, as ``state.values_for(self)`` (in ``plan`` the
        prompt's at the first round, in ``observe`` the round's). Compute them with
        ``state.compute``. Default: nothing to read."""
        return None

    def for_row(self, row: int) -> Strategy:
        """This strategy for row ``row`` of a batch (`framework.engine.batch`): row 0 is this
        instance, every other row a shallow copy of it (what `prepare` found is shared; `reset`
        gives it its own per-generation state) with its own random stream
        (`RandomStream.for_row`). A strategy whose per-generation state lives in an object made in
        ``__init__`` and changed in place overrides this to copy it."""
        if row == 0:
            return self
        twin = copy.copy(self)
        random = getattr(self, "random", None)
        if random is not None:
            twin.random = random.for_row(row)  # type: ignore[attr-defined]
        return twin

    def summary(self) -> dict[str, Any]:
        """Per-prompt statistics to log (e.g. optimisation steps, chosen sets)."""
        return {}

    def run_notes(self, max_new_tokens: int) -> list[str]:
        """What this strategy, as configured, cannot do in a run of ``max_new_tokens`` new tokens
        per turn (SWIFT's search never starting, for one): the run says each note up front and
        keeps it in its metadata. Default: nothing."""
        return []


class LayerSelector(Strategy):
    """Decides which sub-layers the draft skips (or where it exits) in the next round."""

    #: The verify pass must return every layer's hidden states (CLaSp, DEL).
    needs_hidden_states: ClassVar[bool] = False
    #: Every row of a batch gets the same plan from it (a fixed plan, or one searched before
    #: decoding), so the rows' drafts run as one forward. A selector that adapts its plan to each
    #: sequence says ``False``: at batch size > 1 each row still follows its own plan (the output
    #: is the same), but rows whose plans differ draft in separate forwards.
    shares_plan: ClassVar[bool] = False

    def begin(self, state: RoundView) -> None:  # noqa: B027 - optional hook
        """Called once a generation's state exists, before its prefill (after `reset`)."""

    @abstractmethod
    def plan(self, state: RoundView) -> LayerPlan:
        """The LayerPlan for the next draft round."""

    def length_hint(self, state: RoundView) -> LengthHint | None:
        """A suggestion for this round's draft length and stopping threshold, asked right after
        `plan` and passed to ``LengthController.max_length``; ``None`` (the default): none."""
        return None

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:  # noqa: B027
        """Update after a verification (the state has already been committed)."""


class LengthController(Strategy):
    """Decides how many tokens to draft and when to stop drafting."""

    #: The drafter must compute the top-1 probability of every draft step.
    needs_confidence: ClassVar[bool] = False
    #: The controller always drafts exactly ``max_length`` tokens (no early stop), so the draft
    #: gate values drafting K, not the best length up to K.
    exact_length: ClassVar[bool] = False

    @abstractmethod
    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        """Upper bound K on the draft length of the next round; 0 declines to draft.

        Args:
            state: the decode state before drafting.
            hint: the selector's suggestion for this round (`LayerSelector.length_hint`), or
                ``None``; a controller that does not use hints ignores it.
        """

    def max_draft_length(self) -> int | None:
        """The most tokens this controller drafts in one round (its configured cap), or ``None``
        when it has none (the decoder's ``max_draft`` then bounds it). ``--cuda-graphs`` records
        the verifications of up to this many drafts before timing."""
        return None

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        """Called after each draft token; ``False`` stops drafting (that token is kept).

        Args:
            drafted: tokens drafted so far this round (>= 1).
            confidence: top-1 probability of the last draft step (``None`` unless
                ``needs_confidence``).
        """
        return True

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:  # noqa: B027
        """Update after a verification (every round: a declined round's ``draft`` is empty)."""


class Drafter(Strategy):
    """Produces draft tokens with the target model's own (partial) layers."""

    def draft_head(self) -> ReducedHead | None:
        """The reduced LM head this drafter scores tokens with, once prepared
        (`framework.engine.draft_head.DraftHead`; see `framework.drafting.draft_vocab`); ``None``
        (the default): the full vocabulary. The decoder gives it to the decode state
        (``DecodeState.draft_head``, used by every draft pass; strategies read it as
        ``RoundView.draft_head``) and to the other strategies'
        preparation (``PrepareView.draft_head``)."""
        return None

    def draft_weights(self) -> DraftWeights | None:
        """The compressed copy of the model's weights this drafter's passes run, once prepared
        (`framework.engine.adapter.ModelAdapter.draft_branches`: bfloat16, int8 or int4 weights; see
        `framework.drafting.draft_vocab`); ``None`` (the default): the model's own weights. The
        decoder gives it to the decode state (``DecodeState.draft_weights``) and to the other
        strategies' preparation (``PrepareView.draft_weights``), as `draft_head`."""
        return None

    @abstractmethod
    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        """Draft at most ``max_tokens`` (>= 1) tokens after ``state.pending``.

        Implementations ask the engine for each token (``state.draft_step``, which owns the
        forward, the KV-cache bookkeeping and the extras the other strategies asked for), call
        ``length.should_continue`` after each token, and return ``state.drafted(plan)``.
        """

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:  # noqa: B027
        """Update after a verification (every round, also when the drafter was not asked to
        draft: then ``draft`` is the decoder's empty draft)."""


class Verifier(Strategy):
    """Accepts a prefix of the draft using one full forward pass of the target model."""

    #: The drafter must keep the draft distributions (speculative sampling).
    needs_draft_probs: ClassVar[bool] = False
    #: In what sense the output equals the target model's: ``"greedy"`` (token for token equal
    #: to greedy decoding; the combination tests check it) or ``"distribution"`` (speculative
    #: sampling: the same distribution as sampling from the target; checked statistically).
    lossless: ClassVar[str] = "greedy"

    #: The generation's random stream (a sampling verifier's, seeded once per run): what the
    #: device functions' ``ops.uniform`` / ``ops.exponential`` draw from. ``None``: no randomness.
    random: RandomStream | None = None

    def draft_sampler(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        """How drafters pick tokens, so that draft and target use the same warping.

        Returns:
            ``None`` for greedy drafting (argmax), or a device rule ``(ops, logits (B, V)) ->
            (tokens (B,), q (B, V))`` that samples a draft token from the warped draft
            distribution q (its random numbers from ``ops``) and returns q: a module-level
            function, or a ``functools.partial`` of one with plain values, which drafters run
            through ``RoundView.compute``.
        """
        return None

    def draft_top_k(self) -> int:
        """How many top candidates per draft step the drafter must keep (``Draft.top_tokens``).

        0 (the default) keeps none; tree verification asks for its widest band.
        """
        return 0

    @abstractmethod
    def verify(self, state: VerifyView, draft: Draft) -> Verification:
        """Run the target over ``[state.pending, draft.tokens]`` via ``state.forward_verify``."""

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:  # noqa: B027
        """Update after a verification (the state has already been committed); a no-op unless a
        verifier keeps statistics of its own."""

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Pick the token after a plain target forward (prefill, declined rounds).

        Args:
            logits: FloatTensor (B, V).

        Returns:
            LongTensor (B,). Greedy by default; a sampling verifier samples.
        """
        return logits.argmax(dim=-1)


# --------------------------------------------------------------------------------------------
# Registries: one per interface, built here with its base class
# --------------------------------------------------------------------------------------------

#: The composition root: the shipped ``strategies`` package registers every built-in strategy; it
#: is imported once, on the first lookup in any registry (never by the API or the engine themselves).
BUILTIN_STRATEGIES = BuiltinPackage("strategies")

DRAFTERS: Registry[Drafter] = Registry("drafter", Drafter, builtins=BUILTIN_STRATEGIES)
VERIFIERS: Registry[Verifier] = Registry("verifier", Verifier, builtins=BUILTIN_STRATEGIES)
SELECTORS: Registry[LayerSelector] = Registry("selector", LayerSelector, builtins=BUILTIN_STRATEGIES)
LENGTH_CONTROLLERS: Registry[LengthController] = Registry(
    "length", LengthController, builtins=BUILTIN_STRATEGIES
)

#: All registries by the config block (and CLI flag) that selects from them.
REGISTRIES: dict[str, Registry[Any]] = {
    "selector": SELECTORS,
    "length": LENGTH_CONTROLLERS,
    "drafter": DRAFTERS,
    "verifier": VERIFIERS,
}

register_drafter = DRAFTERS.register
register_verifier = VERIFIERS.register
register_selector = SELECTORS.register
register_length = LENGTH_CONTROLLERS.register
get_drafter = DRAFTERS.get
get_verifier = VERIFIERS.get
get_selector = SELECTORS.get
get_length = LENGTH_CONTROLLERS.get


def list_selectors(pattern: str = "*") -> list[str]:
    """Registered selector names matching a glob ``pattern``."""
    return SELECTORS.names(pattern)


def list_drafters(pattern: str = "*") -> list[str]:
    """Registered drafter names matching a glob ``pattern``."""
    return DRAFTERS.names(pattern)


def list_verifiers(pattern: str = "*") -> list[str]:
    """Registered verifier names matching a glob ``pattern``."""
    return VERIFIERS.names(pattern)


def list_lengths(pattern: str = "*") -> list[str]:
    """Registered length-controller names matching a glob ``pattern``."""
    return LENGTH_CONTROLLERS.names(pattern)


class PrepareView(Protocol):
    """What a one-time preparation (``Strategy.prepare``) may use.

    Attributes:
        info: the model's facts.
        device: where the model runs.
        dtype: the model's dtype name (``"float32"``), recorded in artefacts.
        encode: a user message -> chat-formatted prompt token ids.
        eos_token_ids: tokens that end a generation.
        artifact_stem: where a strategy may write files (``f"{artifact_stem}.<suffix>"``), or
            ``None``.
        log: progress and notices (the runner prints them).
        progress: whether a long preparation may show a progress bar (``False`` for a quiet
            caller: ``selfspec.Decoder(..., log=None)``).
        draft_head: the reduced head the run's drafter scores tokens with (``None``: the full
            head); set once the drafter is prepared.
        draft_weights: the compressed weights the run's drafter drafts with (``None``: the model's
            own); set with ``draft_head``.
    """

    info: ModelInfo
    device: torch.device
    dtype: str
    encode: Callable[[str], list[int]]
    eos_token_ids: frozenset[int]
    artifact_stem: object
    log: Callable[[str], None]
    progress: bool
    draft_head: ReducedHead | None
    draft_weights: DraftWeights | None

    def fingerprint(self) -> str:
        """A short hash of the model's weights: what is saved for one model is only valid for the
        weights it was computed on."""

    def calibration_prompts(self, source: str = "", categories: tuple[str, ...] = ()) -> list[str]:
        """Calibration prompts (user messages): the first turns of a Spec-Bench JSONL file
        (``source``; empty: the built-in calibration set)."""

    def cost_model(self) -> CostPrices:
        """The measured cost model of this model on this machine, its draft steps priced with the
        run's draft head and weights."""

    def once(self, owner: type, key: object, compute: Callable[[], T]) -> T:
        """``compute()`` once per ``(owner, key)`` for everything this run prepares (fresh
        strategy instances of a rebuilt experiment reuse it): ``owner`` is the strategy's class,
        so that entries of different strategies never meet."""

    def with_draft(self, drafter: Drafter) -> PrepareView:
        """This view with ``drafter``'s (prepared) `draft_head` and `draft_weights`: what its
        cost model prices (a drafter that gates its own source prepares the gate with it)."""

    def reduced_head(self, size: int, vocab_file: str = "", *, context: bool = True) -> ReducedHead:
        """The reduced draft head of the ``size`` top-ranked tokens of this model (or of
        ``vocab_file``'s ranking), built once per run; ``context``: each generation's head also
        scores its context's tokens. Raises ``ValueError`` for a bad size or file."""

    def compressed_weights(
        self, fmt: str, *, check: bool = True, compress_head: bool = True
    ) -> tuple[DraftWeights | None, str]:
        """The compressed copy of the weights that drafts run in format ``fmt`` (``"bfloat16"``,
        ``"int8"``, ``"int4"``, ``"fp8"``, or ``"auto"``: the fastest that pays), chosen once per
        run (with ``check``, its draft sub-layers timed against the model's own), and a note when
        it is not what ``fmt`` asked for (``None``: the model's own weights);
        ``compress_head=False`` scores a reduced draft head from the model's own weights."""

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
        """Decode each prompt (LongTensor (1, P)) for exactly ``max_new_tokens`` tokens (no EOS
        stop) by self-speculative decoding with ``plan`` in every round and the given length
        controller, drafter and verifier (set up for this model here; prepare them first where
        they need it): the search service of offline plan searches (Self-SD)."""
