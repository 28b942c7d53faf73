"""The four strategy interfaces and the typed objects passed between the stages of a round.

One round of self-speculative decoding (see ``docs/concepts.md``)::

    plan   = selector.plan(state)                          # LayerPlan
    k_max  = length.max_length(state)                      # 0 = do not draft this round
    draft  = drafter.draft(state, plan, length, k_max)     # Draft, calls length.should_continue
    result = verifier.verify(state, draft)                 # Verification
    state.commit(result)                                   # tokens + KV cache to accepted length
    selector.observe(state, draft, result)
    length.observe(draft, result)

Shape notation: ``B`` batch (1 for now; objects are batch-shaped so that B > 1 can come later),
``K`` draft length, ``T`` tokens in one forward, ``V`` vocabulary, ``L`` decoder blocks, ``d`` hidden
size. Tensors are annotated ``name: LongTensor (B, K)`` in docstrings.

Capability flags are ``ClassVar``s that tell the engine what to compute, so that nobody pays for
what no strategy asked for (``LayerSelector.needs_hidden_states``,
``LengthController.needs_confidence``, ``Verifier.needs_draft_probs``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from framework import registry

if TYPE_CHECKING:
    from framework.state import DecodeState


# --------------------------------------------------------------------------------------------
# Data objects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about the target model that strategies may need at set-up.

    Attributes:
        num_layers: number of decoder blocks L (sub-layers are 2L: one attention, one MLP each).
        hidden_size: residual width d.
        vocab_size: V.
        max_context: the longest sequence the model accepts.
        name: model path or id.
        dtype: parameter dtype.
        device: where the model runs.
    """

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    name: str = ""
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class LayerPlan:
    """Which sub-layers the draft computes in one round.

    A skipped sub-layer is the identity on the residual stream (its norm is skipped too) and a
    skipped attention writes no KV. ``exit_layer = E`` runs blocks ``0..E-1`` only, then the final
    norm and LM head (early exit); blocks ``>= E`` count as skipped.

    Attributes:
        attn_skip: (L,) ``True`` where block i's attention sub-layer is skipped.
        mlp_skip: (L,) ``True`` where block i's MLP sub-layer is skipped.
        exit_layer: number of blocks run before the LM head, or ``None`` for all L.
    """

    attn_skip: tuple[bool, ...]
    mlp_skip: tuple[bool, ...]
    exit_layer: int | None = None

    def __post_init__(self) -> None:
        if len(self.attn_skip) != len(self.mlp_skip):
            raise ValueError(
                f"attn_skip and mlp_skip must have one entry per block, got {len(self.attn_skip)} "
                f"and {len(self.mlp_skip)}"
            )
        if self.exit_layer is not None and not 1 <= self.exit_layer <= len(self.attn_skip):
            raise ValueError(f"exit_layer must be in [1, {len(self.attn_skip)}], got {self.exit_layer}")

    # ---- constructors ------------------------------------------------------------------
    @classmethod
    def full(cls, num_layers: int) -> LayerPlan:
        """The plan that runs every sub-layer (the target model itself)."""
        return cls((False,) * num_layers, (False,) * num_layers)

    @classmethod
    def from_indices(
        cls, num_layers: int, attn: Iterable[int] = (), mlp: Iterable[int] = (), exit_layer: int | None = None
    ) -> LayerPlan:
        """Build a plan from the block indices whose attention / MLP sub-layer is skipped.

        Raises:
            ValueError: an index outside ``[0, num_layers)``.
        """
        attn, mlp = set(attn), set(mlp)
        bad = sorted(i for i in attn | mlp if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"layer indices {bad} do not exist: the model has blocks 0..{num_layers - 1}")
        return cls(
            tuple(i in attn for i in range(num_layers)),
            tuple(i in mlp for i in range(num_layers)),
            exit_layer,
        )

    @classmethod
    def from_bits(cls, bits: Sequence[int | bool], exit_layer: int | None = None) -> LayerPlan:
        """From a 2L bit vector ``z`` (Self-SD convention: z[i] attention of block i, z[L+i] its MLP)."""
        if len(bits) % 2:
            raise ValueError(f"a skip bit vector has 2L entries, got {len(bits)}")
        n = len(bits) // 2
        return cls(tuple(bool(b) for b in bits[:n]), tuple(bool(b) for b in bits[n:]), exit_layer)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.attn_skip)

    @property
    def blocks_run(self) -> int:
        """Number of blocks the draft enters (``exit_layer`` or L)."""
        return self.num_layers if self.exit_layer is None else self.exit_layer

    def runs_attn(self, i: int) -> bool:
        return i < self.blocks_run and not self.attn_skip[i]

    def runs_mlp(self, i: int) -> bool:
        return i < self.blocks_run and not self.mlp_skip[i]

    @property
    def num_skipped(self) -> int:
        """Sub-layers not computed, early-exited blocks included."""
        return sum(not self.runs_attn(i) for i in range(self.num_layers)) + sum(
            not self.runs_mlp(i) for i in range(self.num_layers)
        )

    @property
    def skip_ratio(self) -> float:
        """Fraction of the 2L sub-layers the draft does not compute."""
        return self.num_skipped / (2 * self.num_layers)

    @property
    def is_full(self) -> bool:
        return self.num_skipped == 0

    def to_bits(self) -> tuple[int, ...]:
        """The 2L bit vector (1 = skipped), early-exited blocks included."""
        n = self.num_layers
        return tuple(int(not self.runs_attn(i)) for i in range(n)) + tuple(
            int(not self.runs_mlp(i)) for i in range(n)
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary (for logs)."""
        return {
            "attn_skip": [i for i in range(self.num_layers) if self.attn_skip[i]],
            "mlp_skip": [i for i in range(self.num_layers) if self.mlp_skip[i]],
            "exit_layer": self.exit_layer,
            "skip_ratio": round(self.skip_ratio, 4),
        }


@dataclass
class Draft:
    """The tokens proposed in one round.

    Attributes:
        tokens: LongTensor (B, K); K may be 0 (the round declined to draft).
        plan: the LayerPlan the draft ran with.
        confidences: FloatTensor (B, K), top-1 probability of each draft step, or ``None`` when no
            strategy asked for it.
        probs: FloatTensor (B, K, V), the draft distributions (only when the verifier sets
            ``needs_draft_probs``).
        top_tokens: LongTensor (B, K, k), each step's k most probable draft tokens (only when
            the verifier's ``draft_top_k()`` is k > 0; tree verification).
        top_probs: FloatTensor (B, K, k), their draft probabilities.
        extras: strategy-specific data (e.g. tree candidates), JSON-friendly where possible.
    """

    tokens: torch.Tensor
    plan: LayerPlan
    confidences: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    top_tokens: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """K, the number of draft tokens."""
        return int(self.tokens.shape[1])

    @classmethod
    def empty(cls, batch: int, plan: LayerPlan, device: torch.device | str = "cpu") -> Draft:
        return cls(torch.empty(batch, 0, dtype=torch.long, device=device), plan)


@dataclass
class Verification:
    """The outcome of verifying a draft with one full forward pass.

    Attributes:
        num_accepted: LongTensor (B,), m = draft tokens accepted (0..K).
        new_tokens: LongTensor (B, m+1), tokens to commit: the accepted draft tokens followed by
            the target's correction (on a rejection) or bonus token (when all K were accepted).
        kv_keep: LongTensor (m+1,) or ``None``; offsets, within the verified block, of the
            positions whose KV is kept (tree verification). ``None`` keeps the first m+1.
        target_tokens: LongTensor (B, T), the target's choice after every verified position.
        hidden_states: FloatTensor (L+1, B, T, d) of pre-norm residuals from the verify pass, only
            when the selector set ``needs_hidden_states``; index 0 is the embedding.
    """

    num_accepted: torch.Tensor
    new_tokens: torch.Tensor
    kv_keep: torch.Tensor | None = None
    target_tokens: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None

    @property
    def accepted(self) -> int:
        """m for batch size 1."""
        if self.num_accepted.numel() != 1:
            raise ValueError("Verification.accepted is defined for batch size 1; use num_accepted")
        return int(self.num_accepted.item())


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
    """

    adapter: Any
    encode: Callable[[str], list[int]]
    eos_token_ids: frozenset[int] = frozenset()
    artifact_stem: Any = None
    log: Callable[[str], None] = print
    store: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"

    def cost_model(self) -> Any:
        """The measured `framework.cost_model.CostModel` of this model on this machine, measured
        on first use (about 15 s on a 2-core CPU for the default model) and shared through ``store``."""
        if "cost_model" not in self.store:
            from framework.cost_model import CostModel

            self.store["cost_model"] = CostModel.measure(self.adapter)
        return self.store["cost_model"]


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

    def prepare(self, ctx: PrepareContext) -> None:  # noqa: B027 - optional hook
        """Called once per experiment after ``setup``, before the warm-up, with the model and a
        prompt encoder: offline work (e.g. Self-SD's Bayesian search of the skip set) goes here.
        Must be cheap when repeated with the same ``ctx`` (keep results in ``ctx.store``)."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Called before each generation (each turn of each prompt).

        Strategies whose state carries across prompts (e.g. SWIFT's optimisation) keep it here.
        """

    def summary(self) -> dict[str, Any]:
        """Per-prompt statistics to log (e.g. optimisation steps, chosen sets)."""
        return {}


class LayerSelector(Strategy):
    """Decides which sub-layers the draft skips (or where it exits) in the next round."""

    #: The verify pass must return every layer's hidden states (CLaSp, DEL).
    needs_hidden_states: ClassVar[bool] = False

    @abstractmethod
    def plan(self, state: DecodeState) -> LayerPlan:
        """The LayerPlan for the next draft round."""

    def observe(self, state: DecodeState, draft: Draft, result: Verification) -> None:  # noqa: B027
        """Update after a verification (the state has already been committed)."""


class LengthController(Strategy):
    """Decides how many tokens to draft and when to stop drafting."""

    #: The drafter must compute the top-1 probability of every draft step.
    needs_confidence: ClassVar[bool] = False

    @abstractmethod
    def max_length(self, state: DecodeState) -> int:
        """Upper bound K on the draft length of the next round; 0 declines to draft."""

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        """Called after each draft token; ``False`` stops drafting (that token is kept).

        Args:
            drafted: tokens drafted so far this round (>= 1).
            confidence: top-1 probability of the last draft step (``None`` unless
                ``needs_confidence``).
        """
        return True

    def observe(self, draft: Draft, result: Verification) -> None:  # noqa: B027
        """Update after a verification."""


class Drafter(Strategy):
    """Produces draft tokens with the target model's own (partial) layers."""

    @abstractmethod
    def draft(self, state: DecodeState, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        """Draft at most ``max_tokens`` (>= 1) tokens after ``state.pending``.

        Implementations run forwards through ``state.forward_draft`` (which owns the KV-cache
        bookkeeping) and call ``length.should_continue`` after each token.
        """

    def observe(self, draft: Draft, result: Verification) -> None:  # noqa: B027
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

    def draft_sampler(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """How drafters pick tokens, so that draft and target use the same warping.

        Returns:
            ``None`` for greedy drafting (argmax), or a function ``logits (B, V) -> (tokens (B,),
            probs (B, V))`` that samples a draft token from the warped draft distribution q and
            returns q.
        """
        return None

    def draft_top_k(self) -> int:
        """How many top candidates per draft step the drafter must keep (``Draft.top_tokens``).

        0 (the default) keeps none; tree verification asks for its widest band.
        """
        return 0

    @abstractmethod
    def verify(self, state: DecodeState, draft: Draft) -> Verification:
        """Run the target over ``[state.pending, draft.tokens]`` via ``state.forward_verify``."""

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Pick the token after a plain target forward (prefill, declined rounds).

        Args:
            logits: FloatTensor (B, V).

        Returns:
            LongTensor (B,). Greedy by default; a sampling verifier samples.
        """
        return logits.argmax(dim=-1)


registry.DRAFTERS.bind_base(Drafter)
registry.VERIFIERS.bind_base(Verifier)
registry.SELECTORS.bind_base(LayerSelector)
registry.LENGTH_CONTROLLERS.bind_base(LengthController)
