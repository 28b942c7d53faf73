"""The typed objects passed between the stages of a round.

Shape notation: ``B`` batch (1 for now; objects are batch-shaped so that B > 1 can come later),
``K`` draft length, ``T`` tokens in one forward, ``V`` vocabulary, ``L`` decoder blocks, ``d`` hidden
size. Tensors are annotated ``name: LongTensor (B, K)`` in docstrings.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


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

    @functools.cached_property
    def num_skipped(self) -> int:
        """Sub-layers not computed, early-exited blocks included (computed once: plans are frozen,
        and a declined round's record reads it every round)."""
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

    def code(self) -> str:
        """The plan as a 2L-character string of `to_bits` (``"1"``: a sub-layer the draft does not
        run), the one text encoding of plans in records, traces and artefacts."""
        return "".join("1" if b else "0" for b in self.to_bits())

    @classmethod
    def from_code(cls, code: str) -> LayerPlan:
        """The plan of a `code` string. An exit layer comes back as the sub-layers beyond it
        skipped, which runs, and costs, the same.

        Raises:
            ValueError: not an even-length string of ``0``/``1``.
        """
        if not code or len(code) % 2 or set(code) - {"0", "1"}:
            raise ValueError(f"a plan code is 2L characters of 0/1, got {code!r}")
        return cls.from_bits([c == "1" for c in code])

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
        source: what produced the draft, named by the drafter for its own bookkeeping and the
            logs: ``"lookup"`` (copied from the context; no forward ran), ``"layer_skip"`` or
            ``"declined"`` (`hybrid`); ``""``: not named.
    """

    tokens: torch.Tensor
    plan: LayerPlan
    confidences: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    top_tokens: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None
    source: str = ""

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
        kv_keep: LongTensor (m+1,) or ``None``; set by a verifier whose block is not a chain (tree
            verification): offsets, within the verified block, of the positions whose KV is
            kept. ``None`` keeps the first m+1. Strategies read `kept_offsets` instead.
        target_tokens: LongTensor (B, T), the target's choice after every verified position.
        hidden_states: FloatTensor (L+1, B, T, d) of pre-norm residuals from the verify pass, only
            when the selector set ``needs_hidden_states`` (the verifier passes them on; otherwise
            ``DecodeState.commit`` fills them in); index 0 is the embedding.

    The engine knows what it read or uploaded: a verifier that read its tokens (``state.read``) or
    built them on the host (``state.tensor``) hands the device tensors on, and the commit reads
    nothing more.
    """

    num_accepted: torch.Tensor
    new_tokens: torch.Tensor
    kv_keep: torch.Tensor | None = None
    target_tokens: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None

    @property
    def accepted(self) -> int:
        """m for batch size 1: ``new_tokens``' length less one (its shape: no device read)."""
        if self.num_accepted.numel() != 1:
            raise ValueError("Verification.accepted is defined for batch size 1; use num_accepted")
        return int(self.new_tokens.shape[1]) - 1

    @property
    def kept_offsets(self) -> torch.Tensor:
        """LongTensor (m+1,): offsets, within the verified block, of the committed positions
        (``pending`` and the m accepted tokens, in order): ``kv_keep``, or ``arange(m+1)`` for a
        chain. Column j of `hidden_states` at ``kept_offsets[i]`` belongs to committed token i."""
        if self.kv_keep is not None:
            return self.kv_keep
        return torch.arange(self.accepted + 1, device=self.num_accepted.device)

    @property
    def path_hidden(self) -> torch.Tensor | None:
        """FloatTensor (L+1, B, n, d): `hidden_states` along the verified chain, or ``None``
        without hidden states. Columns ``0..m`` are the committed positions (`kept_offsets`); a
        chain verification continues with its rejected positions (n = T), a token tree has only
        its committed path (n = m+1)."""
        hs = self.hidden_states
        if hs is None or self.kv_keep is None:
            return hs
        return hs.index_select(2, self.kv_keep.to(hs.device))

    @property
    def last_hidden(self) -> torch.Tensor | None:
        """FloatTensor (L+1, B, d): the full model's states of the last accepted position (the
        one that produced the correction or bonus token), or ``None`` without hidden states."""
        hs = self.hidden_states
        if hs is None:
            return None
        if self.kv_keep is None:
            return hs[:, :, self.accepted]
        return hs.index_select(2, self.kv_keep[-1:].to(hs.device))[:, :, 0]  # no device read


@dataclass
class LengthHint:
    """A selector's suggestion to the length controller for the coming round.

    Part of the round: the decoder asks the selector (``LayerSelector.length_hint``) right after
    its ``plan`` and passes the answer to ``LengthController.max_length(state, hint)``;
    controllers that do not know it ignore it, so any selector still works with any controller.
    DEL's ``del_tpl`` suggests its Token-per-Layer length and the dynamic threshold of the chosen
    exit layer; ``del_dynamic`` uses them.

    Attributes:
        max_length: draft at most this many tokens this round (0: do not draft).
        threshold: stop drafting below this top-1 confidence, or ``None`` for no suggestion.
        source: who set it (for logs).
    """

    max_length: int
    threshold: float | None = None
    source: str = ""


class RandomStream:
    """One seeded random stream per device: the generation's random numbers (a sampling
    verifier's, shared by its draft steps, its acceptance rule and its plain sampling).

    Created once per verifier and never re-seeded, so successive generations differ while a run
    (same seed, same calls) repeats.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def for_row(self, row: int) -> RandomStream:
        """The stream of row ``row`` of a batch: its own generators, seeded ``seed + row`` (row 0
        draws what a batch of one draws)."""
        return RandomStream(self.seed + row)

    def generator(self, device: torch.device | str) -> torch.Generator:
        """The stream's generator on ``device`` (created and seeded on first use)."""
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.get_device_module(device.type).current_device())
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def fill(self, kind: str, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` with ``kind`` numbers from the stream, in place: ``"uniform"`` in [0, 1)
        (what ``torch.rand`` draws) or ``"exponential"`` of rate 1."""
        gen = self.generator(out.device)
        if kind == "uniform":
            return out.uniform_(0, 1, generator=gen)
        return out.exponential_(1, generator=gen)

    def draw(
        self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``kind`` numbers of ``shape`` (`fill` on a new tensor)."""
        return self.fill(kind, torch.empty(shape, dtype=dtype, device=device))


@dataclass(frozen=True)
class RoundRecord:
    """One round of a generation, as the decoding loop records it (the one per-round trace:
    `GenerationResult`'s per-round lists are read from these).

    Attributes:
        drafted: draft tokens proposed (0: the round declined to draft, or a plain step).
        accepted: draft tokens accepted (m).
        committed: tokens committed (m + 1: the accepted drafts and the target's own token).
        skip_ratio: the plan's skip ratio (`LayerPlan.skip_ratio`).
        plan: the plan's `LayerPlan.code` when the round drafted, else ``""``.
        exit_layer: the plan's exit layer when the round drafted (``None``: full depth).
    """

    drafted: int
    accepted: int
    committed: int
    skip_ratio: float
    plan: str = ""
    exit_layer: int | None = None


@dataclass
class DecodeStats:
    """Counters of one generation.

    Attributes:
        rounds: per-round records.
        timings: seconds per phase: prefill, select, draft, verify, length, commit.
        target_forwards: full-model forwards (prefill and verifications).
        draft_forwards: draft forwards.
        verify_tokens: tokens fed to verification forwards (a chain of K drafts: K + 1; a tree:
            its nodes + 1).
        verify_blocks_saved: block evaluations (blocks x positions) verifications skipped by
            reusing an early-exit draft's blocks.
        reused_positions: verified positions whose first blocks came from the draft.
    """

    rounds: list[RoundRecord] = field(default_factory=list)
    timings: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("prefill", "select", "draft", "verify", "length", "commit"), 0.0
        )
    )
    target_forwards: int = 0
    draft_forwards: int = 0
    verify_tokens: int = 0
    verify_blocks_saved: int = 0
    reused_positions: int = 0


class AcceptanceRule(Protocol):
    """A verifier's acceptance rule as a device function, which the engine folds into the verify
    forward (``RoundView.forward_verify(block, rule=rule, rule_inputs=...)``): on the graph route
    inside the forward's one graph, elsewhere right after it. Its outputs reach the verifier by
    name in ``ForwardOutput.ruled``.

    ``ops`` is the engine's `framework.view.DeviceOps` (random draws from the generation's stream:
    ``ops.uniform``, ``ops.exponential``). ``ids`` (B, T) are the block's tokens as the forward's
    rows saw them: where a verification reused an early-exit draft's blocks and the block leaves
    the inputs the draft fed, the tokens from there on are ``-1`` (no row saw them), which a rule
    never accepts. ``logits`` (B, T, V) are every row's. The engine keys the rule as it keys any
    device work (its name, its bound values, its inputs' shapes: `framework.engine.execution.work`).
    """

    def __call__(
        self, ops: Any, ids: torch.Tensor, logits: torch.Tensor, *inputs: Any
    ) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class TokenPick:
    """What a draft step's forward chooses from its last row's logits (issue 38, item 3).

    After each draft forward a drafter chooses the next token: the argmax, or (when a strategy
    asked for extras) the softmax's top-1 token and its probability, the whole distribution and
    the k most probable tokens. Done after the forward, that is 1-3 eager kernel launches per
    drafted token on a GPU; done inside it (``ModelAdapter.forward(..., pick=)``), they are part
    of the forward's one graph on the ``forward`` route (`framework.engine.execution.forward_graph`: the pick is
    part of the graph's key). `pick_tokens` is the rule; sampling is not picked there (the
    sampler's random stream is the verifier's).

    Attributes:
        softmax: the token is the softmax's top-1 (the argmax, up to exact ties), with its
            probability; ``False``: the argmax alone.
        probs: also the whole distribution (B, V) (a verifier that needs q).
        top_k: also the ``top_k`` most probable tokens and their probabilities (0: none).
    """

    softmax: bool = False
    probs: bool = False
    top_k: int = 0

    def __post_init__(self) -> None:
        if (self.probs or self.top_k) and not self.softmax:
            raise ValueError("probs and top_k come from the softmax: set softmax=True")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class Picked:
    """What `pick_tokens` chose, per batch row.

    Attributes:
        tokens: LongTensor (B,).
        top_p: FloatTensor (B,) in float32, the top-1 probability (``None`` without softmax).
        probs: FloatTensor (B, V) in float32, the distribution (``None`` unless asked).
        top_tokens: LongTensor (B, k) in descending probability (``None`` unless asked).
        top_probs: FloatTensor (B, k), their probabilities.
    """

    tokens: torch.Tensor
    top_p: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    top_tokens: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None

    def clone(self) -> Picked:
        """Copies (a graph's outputs are overwritten by its next replay)."""
        c = lambda x: None if x is None else x.clone()  # noqa: E731
        return Picked(c(self.tokens), c(self.top_p), c(self.probs), c(self.top_tokens), c(self.top_probs))


def pick_tokens(logits: torch.Tensor, pick: TokenPick, head: ReducedHead | None = None) -> Picked:
    """Choose from ``logits`` (B, V) as ``pick`` says: the argmax, or the float32 softmax's top-1
    with its probability (and the distribution, and its top k). With ``head``, the logits (B, K)
    are a reduced draft head's: the tokens come back as vocabulary ids and the distribution over
    the vocabulary (0 outside the head). The one rule of the forward that picks inside it
    (`ForwardSpec.pick`) and of `framework.engine.draft_steps.DraftSteps`."""
    if not pick.softmax:
        tok = logits.argmax(dim=-1)
        return Picked(tok if head is None else head.tokens(tok))
    p = torch.softmax(logits.float(), dim=-1)
    top_p, tok = p.max(dim=-1)
    top_probs = top_tokens = None
    if pick.top_k:
        top_probs, top_tokens = p.topk(min(pick.top_k, p.shape[-1]), dim=-1)  # sorted by p
    probs = p if pick.probs else None
    if head is not None:
        tok = head.tokens(tok)
        top_tokens = None if top_tokens is None else head.tokens(top_tokens)
        probs = None if probs is None else head.expand(probs, 0.0)
    return Picked(tok, top_p, probs, top_tokens, top_probs)


class DraftWeights(Protocol):
    """A compressed copy of a model's weights that draft passes run (``--drafter.draft_weights``):
    the CPU kernels' fused branches (`framework.kernels.fused.FusedBlocks.compressed`) or the
    modules' low-bit linear layers (`framework.kernels.lowbit.LowBitLinears`)."""

    #: the storage format's name ("bfloat16", "int8", "int4", "fp8"; "float32": the model's own)
    weights: str

    @property
    def nbytes(self) -> int:
        """Bytes of the weights (and scales) a draft reads."""


def weights_key(weights: DraftWeights | None) -> str:
    """Names a draft's weights in cache keys and records: the format (``"float32"`` for ``None``),
    and the format a compressed fused copy scores the reduced draft head in
    (`framework.kernels.fused.FusedBlocks.head`), e.g. ``"int4, head int8"``."""
    if weights is None:
        return "float32"
    head = getattr(weights, "head", None)
    return weights.weights if head is None else f"{weights.weights}, head {head}"


class ReducedHead(Protocol):
    """What a strategy uses of a reduced draft head (`framework.engine.draft_head.DraftHead`: the
    LM head restricted to K token ids, scoring drafts over K tokens instead of V)."""

    @property
    def size(self) -> int:
        """K, the tokens the head scores."""

    @property
    def key(self) -> str:
        """Names the head in caches and records."""

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of head indices (any shape)."""

    def expand(self, values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """(..., K) values over the head -> (..., V) over the vocabulary, ``fill`` elsewhere."""

    def coverage(self, tokens: torch.Tensor | Iterable[int]) -> float:
        """The share of ``tokens`` the head holds."""


class CostPrices(Protocol):
    """What a strategy uses of the measured cost model (`framework.engine.cost_model.CostModel`):
    seconds per forward, priced by plan and draft length."""

    num_layers: int

    @property
    def step(self) -> float:
        """One plain decoding step."""

    def draft_step(self, plan: LayerPlan) -> float:
        """One draft step with ``plan``."""

    def verify(self, tokens: int) -> float:
        """A verification of ``tokens`` rows."""

    def round_time(self, k: int, plan: LayerPlan, *, draft_scale: float = 1.0, width: float = 1.0) -> float:
        """A round that drafts ``k`` tokens with ``plan`` and verifies them."""

    def decode_time(self, plan: LayerPlan, draft_lengths: Sequence[int]) -> float:
        """Rounds of these draft lengths with ``plan``."""

    def to_dict(self) -> dict[str, Any]:
        """The prices as plain data (records)."""

    def describe(self) -> str:
        """One line for logs."""


@dataclass
class ForwardOutput:
    """What one forward returns (`framework.engine.adapter.ModelAdapter.forward`, and the
    ``forward_*`` methods of a `framework.view.RoundView`).

    Attributes:
        logits: FloatTensor (B, T', V) at the requested positions, or ``None``; (B, T', K) over
            ``head.ids`` when the pass ran a reduced draft head.
        hidden_states: FloatTensor (L'+1, B, T, d) pre-norm residuals after each block run (index 0
            is the embedding; only when ``capture_hidden``; L' = blocks run).
        last_hidden: FloatTensor (B, T, d), the residual stream where the pass stopped (pre-norm).
        head: the reduced draft head the logits come from (column j scores token ``head.ids[j]``),
            or ``None``: the full LM head.
        picked: the token chosen from the last row's logits inside the forward, when the pass
            asked (``pick``, a `TokenPick`) and ran the full LM head; ``None`` otherwise.
        ruled: what the verifier's acceptance rule returned, by name (``rule``: an
            `AcceptanceRule`, run inside the forward), or ``None``.
    """

    logits: torch.Tensor | None
    hidden_states: torch.Tensor | None
    last_hidden: torch.Tensor
    head: ReducedHead | None = None
    picked: Picked | None = None
    ruled: dict[str, torch.Tensor] | None = None

    def top1(self) -> torch.Tensor:
        """LongTensor (B, T'): the argmax token ids of `logits` (mapped through `head`)."""
        if self.logits is None:
            raise ValueError("this forward computed no logits")
        idx = self.logits.argmax(dim=-1)
        return idx if self.head is None else self.head.tokens(idx)
