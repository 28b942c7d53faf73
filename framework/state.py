"""The decode state: committed tokens, the KV cache and the forwards strategies may run.

Strategies never touch the KV cache directly; they call the three forwards below, which encode
the cache semantics of `framework.kv_cache`:

- `DecodeState.forward_draft`: continue the current draft with a (partial) model;
- `DecodeState.forward_verify`: discard the draft's KV and run the full model over a block
  starting at the first uncommitted position (chain or tree);
- `DecodeState.forward_scratch`: teacher-forced draft pass over already committed tokens
  that leaves the committed cache untouched (SWIFT's candidate scoring).

Invariant between rounds: ``cache.committed == num_tokens - 1``. The last committed token
(``pending``: the previous round's correction or bonus token) has no KV yet; it is the first input
of the next draft and of the next verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from framework.interfaces import LayerPlan, ModelInfo, Verification
from framework.kv_cache import KVCache
from framework.model_adapter import ForwardOutput, ModelAdapter


@dataclass
class RoundRecord:
    """Per-round trace (kept for logging and metrics)."""

    drafted: int
    accepted: int
    committed: int
    skip_ratio: float


@dataclass
class DecodeStats:
    """Counters of one generation.

    Attributes:
        rounds: per-round records.
        timings: seconds per phase: prefill, select, draft, verify, length, commit.
        target_forwards: full-model forwards (prefill and verifications).
        draft_forwards: draft forwards.
    """

    rounds: list[RoundRecord] = field(default_factory=list)
    timings: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("prefill", "select", "draft", "verify", "length", "commit"), 0.0
        )
    )
    target_forwards: int = 0
    draft_forwards: int = 0


class DecodeState:
    """Everything one generation carries from round to round (batch-shaped, B = 1 for now).

    Args:
        adapter: the model adapter.
        prompt_ids: LongTensor (B, P), the prompt (P >= 1).
        capacity: KV slots to preallocate (prompt + new tokens + the longest draft + 1).
        capture_hidden: verification passes return every layer's hidden states.
        need_confidence: drafters compute top-1 probabilities.
        need_draft_probs: drafters keep their full distributions.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        prompt_ids: torch.Tensor,
        capacity: int,
        *,
        capture_hidden: bool = False,
        need_confidence: bool = False,
        need_draft_probs: bool = False,
    ) -> None:
        if prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
            raise ValueError(f"prompt_ids must be (B, P) with P >= 1, got shape {tuple(prompt_ids.shape)}")
        if prompt_ids.shape[0] != 1:
            raise NotImplementedError(
                "batch size > 1 is not supported yet (the data objects are batch-shaped)"
            )
        self.adapter = adapter
        self.info: ModelInfo = adapter.info()
        self.device = adapter.device
        self.prompt_len = int(prompt_ids.shape[1])
        with torch.inference_mode(False):  # writable outside inference mode too
            self._tokens = torch.zeros(
                prompt_ids.shape[0], max(capacity, self.prompt_len) + 1, dtype=torch.long, device=self.device
            )
        self._tokens[:, : self.prompt_len] = prompt_ids.to(self.device)
        self.num_tokens = self.prompt_len
        self.cache: KVCache = adapter.new_cache(max(capacity, self.prompt_len + 1), batch=prompt_ids.shape[0])
        self.capture_hidden = capture_hidden
        self.need_confidence = need_confidence
        self.need_draft_probs = need_draft_probs
        #: Set by the decoder from ``Verifier.draft_sampler()``; ``None`` = greedy drafting.
        self.draft_sampler = None
        #: Set by the decoder from ``Verifier.draft_top_k()``; 0 = keep no top-k candidates.
        self.draft_top_k = 0
        self.draft_len = 0  # tokens fed to the draft model in the current round
        self.round = 0
        self.stats = DecodeStats()
        #: Hidden states of the last verification (L+1, B, T, d), when capture_hidden.
        self.last_hidden_states: torch.Tensor | None = None
        #: free-form per-generation scratch space for strategies (keyed by strategy name).
        self.extras: dict[str, Any] = {}

    @classmethod
    def for_strategies(
        cls,
        adapter: ModelAdapter,
        prompt_ids: torch.Tensor,
        capacity: int,
        selector: Any,
        length: Any,
        verifier: Any,
    ) -> DecodeState:
        """A state whose flags and hooks come from the strategies' capability declarations.

        The one place that wires ``needs_hidden_states``, ``needs_confidence``,
        ``needs_draft_probs``, ``draft_sampler()`` and ``draft_top_k()`` into the state.
        """
        state = cls(
            adapter,
            prompt_ids,
            capacity,
            capture_hidden=selector.needs_hidden_states,
            need_confidence=length.needs_confidence,
            need_draft_probs=verifier.needs_draft_probs,
        )
        state.draft_sampler = verifier.draft_sampler()
        state.draft_top_k = verifier.draft_top_k()
        return state

    # ------------------------------------------------------------------ token views
    @property
    def tokens(self) -> torch.Tensor:
        """LongTensor (B, N): prompt and every committed new token (``pending`` included)."""
        return self._tokens[:, : self.num_tokens]

    @property
    def new_tokens(self) -> torch.Tensor:
        """LongTensor (B, N - P): the generated tokens so far."""
        return self._tokens[:, self.prompt_len : self.num_tokens]

    @property
    def num_new(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def pending(self) -> torch.Tensor:
        """LongTensor (B, 1): the last committed token, whose KV is not cached yet."""
        return self._tokens[:, self.num_tokens - 1 : self.num_tokens]

    def _positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=self.device)[None].expand(self._tokens.shape[0], n)

    # ------------------------------------------------------------------ forwards
    def prefill(self) -> torch.Tensor:
        """Full forward over the prompt; returns the last position's logits (B, V).

        Leaves the prompt's KV committed except for its last token, which becomes ``pending``:
        the first generated token is chosen by the caller and appended with `append`.
        """
        p = self.prompt_len
        out = self.adapter.forward(
            self._tokens[:, :p],
            self._positions(0, p),
            self.cache,
            logits_at="last",
            capture_hidden=self.capture_hidden,
        )
        self.cache.commit(p)
        self.stats.target_forwards += 1
        if self.capture_hidden:
            self.last_hidden_states = out.hidden_states
        return out.logits[:, -1]

    def forward_draft(
        self,
        input_ids: torch.Tensor,
        plan: LayerPlan | None,
        *,
        logits_at: str | torch.Tensor | None = "last",
    ) -> ForwardOutput:
        """Feed the next draft token(s) (B, T) through the draft model ``plan``.

        Positions continue after the committed prefix and the tokens already drafted this round;
        KV is appended only in the layers whose attention the plan runs.
        """
        t = input_ids.shape[1]
        start = self.cache.committed + self.draft_len
        out = self.adapter.forward(
            input_ids, self._positions(start, t), self.cache, plan, logits_at=logits_at
        )
        self.draft_len += t
        self.stats.draft_forwards += 1
        return out

    def forward_verify(
        self,
        input_ids: torch.Tensor,
        *,
        logits_at: str | torch.Tensor | None = "all",
        position_ids: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Full-model forward over a block (B, T) starting at the first uncommitted position.

        The draft's KV is discarded first; the block is written at ``[committed, committed + T)``
        in every layer. ``position_ids``/``tree_mask`` support tree verification (default: a chain).
        Stores the hidden states in ``last_hidden_states`` when ``capture_hidden``.
        """
        self.cache.rollback()
        c = self.cache.committed
        t = input_ids.shape[1]
        pos = self._positions(c, t) if position_ids is None else position_ids
        out = self.adapter.forward(
            input_ids,
            pos,
            self.cache,
            None,
            logits_at=logits_at,
            capture_hidden=self.capture_hidden,
            base=c,
            tree_mask=tree_mask,
        )
        self.stats.target_forwards += 1
        if self.capture_hidden:
            self.last_hidden_states = out.hidden_states
        return out

    def forward_scratch(
        self,
        start: int,
        plan: LayerPlan | None,
        *,
        end: int | None = None,
        logits_at: str | torch.Tensor | None = "all",
    ) -> ForwardOutput:
        """Teacher-forced pass of ``plan`` over committed tokens ``[start, end)``.

        Token ``start`` attends to the committed KV of ``[0, start)`` and to the block's own KV, which
        is written beyond every layer's end pointer and forgotten afterwards; the committed cache
        is untouched. ``logits[:, j]`` predicts token ``start + j + 1``.

        Args:
            start: first token fed.
            plan: the draft model (``None``: the full model).
            end: one past the last token fed; default ``N - 1`` (every committed token with KV).
            logits_at: as in `ModelAdapter.forward`.

        Raises:
            ValueError: ``start``/``end`` outside ``0 <= start < end <= N - 1``.
        """
        last = self.num_tokens - 1  # == cache.committed
        end = last if end is None else end
        if not 0 <= start < end <= last:
            raise ValueError(f"scratch span must satisfy 0 <= start < end <= {last}, got [{start}, {end})")
        ids = self._tokens[:, start:end]
        base = max(self.cache.lengths)
        return self.adapter.forward(
            ids,
            self._positions(start, end - start),
            self.cache,
            plan,
            logits_at=logits_at,
            base=base,
            visible=start,
            persist=False,
        )

    # ------------------------------------------------------------------ commits
    def append(self, tokens: torch.Tensor) -> None:
        """Append (B, n) tokens without KV changes (the first token after prefill)."""
        n = tokens.shape[1]
        self._ensure_token_capacity(n)
        self._tokens[:, self.num_tokens : self.num_tokens + n] = tokens
        self.num_tokens += n

    def commit(self, result: Verification) -> torch.Tensor:
        """Commit a verification: tokens appended, KV cut to exactly the verified prefix.

        Returns:
            LongTensor (B, m+1), the tokens committed.
        """
        new = result.new_tokens
        n = new.shape[1]
        # KV of [pending, d_1..d_m] (m + 1 = n positions) was written by the verify pass.
        self.cache.commit(n, keep=result.kv_keep)
        self.append(new)
        self.draft_len = 0
        self.round += 1
        return new

    def discard_draft(self) -> None:
        """Forget the current round's draft KV (e.g. a drafter that gives up)."""
        self.cache.rollback()
        self.draft_len = 0

    def _ensure_token_capacity(self, n: int) -> None:
        if self.num_tokens + n > self._tokens.shape[1]:
            with torch.inference_mode(False):
                grow = torch.zeros(
                    self._tokens.shape[0], 2 * self._tokens.shape[1] + n, dtype=torch.long, device=self.device
                )
            grow[:, : self.num_tokens] = self._tokens[:, : self.num_tokens]
            self._tokens = grow
