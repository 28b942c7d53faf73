"""The decode state: committed tokens, the KV cache and the forwards strategies may run.

Strategies never touch the KV cache directly; they call the three forwards below, which encode
the cache semantics of `framework.engine.kv_cache`:

- `DecodeState.forward_draft`: continue the current draft with a (partial) model;
- `DecodeState.forward_verify`: discard the draft's KV and run the full model over a block
  starting at the first uncommitted position (chain or tree);
- `DecodeState.forward_scratch`: teacher-forced draft pass over already committed tokens
  that leaves the committed cache untouched (SWIFT's candidate scoring);
- `DecodeState.forward_block`: one decoder block applied to candidate hidden states of one
  committed position, also leaving the committed cache untouched (CLaSp's dynamic programme).

Invariant between rounds: ``cache.committed == num_tokens - 1``. The last committed token
(``pending``: the previous round's correction or bonus token) has no KV yet; it is the first input
of the next draft and of the next verification.

Early-exit reuse: a drafter that runs a pure prefix of the model (blocks ``0..E-1``, nothing
skipped) may call ``forward_draft(..., reusable=True)``. Those blocks then computed exactly what the
target computes for the drafted positions, so the next chain verification keeps their KV and
hidden states and runs only blocks ``E..L-1`` for them (plus every block for positions the draft
never fed). ``DecodeStats.verify_blocks_saved`` counts the block evaluations this avoided.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from framework.engine.adapter import ModelAdapter
from framework.engine.draft_head import DraftHead, LiveDraftHead
from framework.engine.execution.spec import RuleCall
from framework.engine.execution.work import DeviceWork, RandomStream
from framework.engine.kv_cache import KVCache
from framework.engine.processing import LogitsProcessing
from framework.interfaces import Drafter, LayerSelector, LengthController, Strategy, Verifier
from framework.kernels.protocols import DraftWeights
from framework.types import (
    AcceptanceRule,
    DecodeStats,
    ForwardOutput,
    LayerPlan,
    ModelInfo,
    TokenPick,
    Verification,
)


@dataclass
class _DraftPrefix:
    """What a reusable (pure-prefix) draft computed this round, for the verification to keep."""

    exit_layer: int
    ids: list[torch.Tensor] = field(default_factory=list)  # (B, t) inputs fed, in order
    last_hidden: list[torch.Tensor] = field(default_factory=list)  # (B, t, d) after block E-1
    hidden: list[torch.Tensor] | None = None  # (E+1, B, t, d) per step, when capture_hidden

    @property
    def length(self) -> int:
        return sum(int(x.shape[1]) for x in self.ids)


class DecodeState:
    """Everything one generation carries from round to round (batch-shaped, B = 1 for now).

    Args:
        adapter: the model adapter.
        prompt_ids: LongTensor (B, P), the prompt (P >= 1).
        capacity: KV slots to preallocate (prompt + new tokens + the longest draft + 1).
        capture_hidden: verification passes return every layer's hidden states.
        need_confidence: drafters compute top-1 probabilities.
        need_draft_probs: drafters keep their full distributions.
        readers: strategies whose ``reads`` the round's read serves (`values_for`).
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
        readers: Sequence[Any] = (),
    ) -> None:
        if prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
            raise ValueError(f"prompt_ids must be (B, P) with P >= 1, got shape {tuple(prompt_ids.shape)}")
        if prompt_ids.shape[0] != 1:
            raise NotImplementedError(
                "batch size > 1 is not supported yet (the data objects are batch-shaped)"
            )
        self.adapter = adapter
        self.info: ModelInfo = adapter.arch.info()
        self.device = adapter.arch.device
        self.prompt_len = int(prompt_ids.shape[1])
        with torch.inference_mode(False):  # writable outside inference mode too
            self._tokens = torch.zeros(
                prompt_ids.shape[0], max(capacity, self.prompt_len) + 1, dtype=torch.long, device=self.device
            )
        self._tokens[:, : self.prompt_len] = prompt_ids.to(self.device)
        with torch.inference_mode(False):
            self._arange = torch.arange(self._tokens.shape[1] + 64, device=self.device)
        self.num_tokens = self.prompt_len
        #: Row 0's tokens known on the host, a prefix of ``tokens[0]`` (`host_tokens`).
        self._host: list[int] = prompt_ids[0].tolist() if prompt_ids.device.type == "cpu" else []
        self.cache: KVCache = adapter.new_cache(max(capacity, self.prompt_len + 1), batch=prompt_ids.shape[0])
        self.capture_hidden = capture_hidden
        self.need_confidence = need_confidence
        self.need_draft_probs = need_draft_probs
        #: Set by the decoder from ``Verifier.draft_sampler()``; ``None`` = greedy drafting.
        self.draft_sampler = None
        #: Set by the decoder from ``Verifier.draft_top_k()``; 0 = keep no top-k candidates.
        self.draft_top_k = 0
        #: Set by the decoder from ``Drafter.draft_head()`` (this generation's `LiveDraftHead`):
        #: the reduced LM head every draft pass (`forward_draft`, `forward_scratch`) scores tokens
        #: with; ``None`` = the full head. `commit` shows it the committed tokens.
        self.draft_head: DraftHead | None = None
        #: Set by the decoder from ``Drafter.draft_weights()``: the compressed copy of the model's
        #: fused branches every draft pass runs (`ModelAdapter.draft_branches`, e.g. int8
        #: weights); ``None`` = the model's own weights. Verification always runs the model's own.
        self.draft_weights: DraftWeights | None = None
        self.draft_len = 0  # tokens fed to the draft model in the current round
        #: Set by the decoder: the generation's logits processors (`framework.engine.processing`),
        #: applied to every row a forward scores for the next token, with the row's own prefix;
        #: ``None``: none.
        self.processing: LogitsProcessing | None = None
        #: Set by the decoder: the generation's grammar matcher (`framework.engine.grammar.GrammarState`:
        #: ``forced(tokens, limit)`` gives the tokens the grammar forces next), or ``None``.
        self.grammar: Any = None
        self._fed: list[torch.Tensor] = []  # this round's draft inputs, for the processors' prefixes
        self.round = 0
        self.stats = DecodeStats()
        #: Hidden states of the last verification (L+1, B, T, d), when capture_hidden.
        self.last_hidden_states: torch.Tensor | None = None
        self._prefix: _DraftPrefix | None = None  # this round's reusable early-exit draft
        #: the generation's random stream (`compute`'s draws; the decoder sets the verifier's)
        self.random: RandomStream | None = None
        self._work = DeviceWork(self)
        #: strategies whose `reads` ask for values of each verified chain, and what they got
        self._readers: tuple[Any, ...] = tuple(readers)
        self._values: dict[Any, dict[str, list[Any]]] = {}
        #: the hidden states of this round's chain verification (or the prompt's), if any, and
        #: whether its readers were served
        self._verified_chain: torch.Tensor | None = None
        self._served = False
        self._prefix_plans: dict[int, LayerPlan] = {}
        #: `forward_block`'s ``(position, positions (1, n), mask (n, n))`` for the last position it
        #: was called with, n the most candidates it was given there
        self._block_inputs: tuple[int, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_strategies(
        cls,
        adapter: ModelAdapter,
        prompt_ids: torch.Tensor,
        capacity: int,
        selector: LayerSelector,
        length: LengthController,
        verifier: Verifier,
        drafter: Drafter | None = None,
    ) -> DecodeState:
        """A state whose flags and hooks come from the strategies' capability declarations.

        The one place that wires ``needs_hidden_states``, ``needs_confidence``,
        ``needs_draft_probs``, ``draft_sampler()``, ``draft_top_k()``, ``random``, ``reads`` and
        ``draft_head()`` into the state.
        """
        state = cls(
            adapter,
            prompt_ids,
            capacity,
            capture_hidden=selector.needs_hidden_states,
            need_confidence=length.needs_confidence,
            need_draft_probs=verifier.needs_draft_probs,
            readers=[
                s
                for s in (selector, length, drafter, verifier)
                if s is not None and type(s).reads is not Strategy.reads
            ],
        )
        state.draft_sampler = verifier.draft_sampler()
        state.draft_top_k = verifier.draft_top_k()
        state.random = verifier.random
        head = drafter.draft_head() if drafter is not None else None
        if head is not None:
            state.draft_head = head.start(prompt_ids)
        state.draft_weights = drafter.draft_weights() if drafter is not None else None
        return state

    @property
    def layer_loads(self) -> int:
        """Blocks entered by the model's forwards so far, whatever their token count (the model's
        lifetime counter: read differences)."""
        return self.adapter.executor.layer_loads

    def top1_from_hidden(
        self, hidden: torch.Tensor, *, draft_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy token and its probability for pre-norm residuals (..., d): the full LM head,
        or with ``draft_head`` the generation's `draft_head` (``ModelAdapter.top1_from_hidden``)."""
        return self.adapter.top1_from_hidden(hidden, head=self.draft_head if draft_head else None)

    @property
    def compressed_drafts(self) -> bool:
        """Whether draft passes run a compressed copy of the weights (`draft_weights`): their
        blocks then do not compute what the target computes, so nothing they computed may be
        kept by verification (no early-exit reuse)."""
        return self.draft_weights is not None and self.draft_weights.weights != "float32"

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

    @property
    def pending_position(self) -> int:
        """The position of `pending`: the first KV slot not committed (a verified block starts here)."""
        return self.cache.committed

    def _positions(self, start: int, n: int) -> torch.Tensor:
        """Positions ``start .. start + n - 1`` (B, n): a view of one arange made per state (a
        launch per forward less on a GPU)."""
        if start + n > self._arange.shape[0]:
            with torch.inference_mode(False):
                self._arange = torch.arange(2 * (start + n), device=self.device)
        return self._arange[start : start + n][None].expand(self._tokens.shape[0], n)

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
        self._verified_chain, self._served = (
            out.hidden_states,
            False,
        )  # the prompt's: read with the first token
        if self.processing is not None:
            return self.processing.next(self._tokens[:, :p], out.logits[:, -1])
        return out.logits[:, -1]

    def prefix_plan(self, exit_layer: int) -> LayerPlan:
        """The plan that runs blocks ``0..exit_layer-1`` unchanged, then the LM head."""
        plan = self._prefix_plans.get(exit_layer)
        if plan is None:
            plan = LayerPlan.from_indices(self.info.num_layers, exit_layer=exit_layer)
            self._prefix_plans[exit_layer] = plan
        return plan

    def forward_draft(
        self,
        input_ids: torch.Tensor,
        plan: LayerPlan | None,
        *,
        logits_at: str | torch.Tensor | None = "last",
        reusable: bool = False,
        pick: TokenPick | None = None,
    ) -> ForwardOutput:
        """Feed the next draft token(s) (B, T) through the draft model ``plan``.

        Positions continue after the committed prefix and the tokens already drafted this round;
        KV is appended only in the layers whose attention the plan runs. Logits come from
        `draft_head` (``ForwardOutput.head`` says which).

        Args:
            input_ids: LongTensor (B, T).
            plan: the draft model (``None``: the full model).
            logits_at: as in `ModelAdapter.forward`.
            reusable: the plan is a pure prefix (``exit_layer`` E, nothing skipped before it), and
                the next chain verification may keep what these blocks computed instead of
                recomputing it (early-exit reuse). Every step of the round must say so.
            pick: choose the next token from the last row's logits inside the forward (its graph
                on the ``forward`` route), returned as ``ForwardOutput.picked``
                (`framework.types.TokenPick`; `framework.drafting.builder.DraftBuilder.pick` says
                what a builder needs). A reduced draft head's logits come after the graph: then
                nothing is picked.

        Raises:
            ValueError: ``reusable`` with a plan that is not a pure prefix, or with compressed
                draft weights (`compressed_drafts`).
        """
        t = input_ids.shape[1]
        start = self.cache.committed + self.draft_len
        capture = False
        if reusable and self.compressed_drafts:
            raise ValueError(
                "reusable draft steps must run the model's own weights (draft_weights is "
                f"{self.draft_weights.weights if self.draft_weights is not None else None}): "
                "verification would keep what the compressed copy computed"
            )
        if reusable:
            if plan is None or plan.exit_layer is None or plan.exit_layer >= plan.num_layers:
                raise ValueError("reusable draft steps need an early-exit plan with exit_layer < L")
            e = plan.exit_layer
            if any(not (plan.runs_attn(i) and plan.runs_mlp(i)) for i in range(e)):
                raise ValueError("reusable draft steps must run every sub-layer before the exit layer")
            if self.draft_len == 0:
                self._prefix = _DraftPrefix(e, hidden=[] if self.capture_hidden else None)
            elif self._prefix is not None and (
                self._prefix.exit_layer != e or self._prefix.length != self.draft_len
            ):
                self._prefix = None  # not one contiguous pure-prefix draft: verify recomputes
            capture = self._prefix is not None and self._prefix.hidden is not None
        else:
            self._prefix = None
        processing = self.processing
        out = self.adapter.forward(
            input_ids,
            self._positions(start, t),
            self.cache,
            plan,
            logits_at=logits_at,
            capture_hidden=capture,
            head=self.draft_head,
            weights=self.draft_weights,
            pick=pick if processing is None else None,  # processed first: picked by the caller
        )
        if processing is not None:
            out = self._process_draft(out, input_ids, logits_at)
        if reusable and self._prefix is not None:
            self._prefix.ids.append(input_ids)
            self._prefix.last_hidden.append(out.last_hidden)
            if self._prefix.hidden is not None:
                self._prefix.hidden.append(out.hidden_states)
        self.draft_len += t
        self.stats.draft_forwards += 1
        return out

    def _process_draft(
        self, out: ForwardOutput, input_ids: torch.Tensor, logits_at: str | torch.Tensor | None
    ) -> ForwardOutput:
        """A draft forward's rows through the generation's processors, each with its own prefix
        (the committed tokens, then this round's draft inputs after the pending token), over the
        whole vocabulary (a reduced head's scores expanded, ``-inf`` outside it)."""
        if self.draft_len == 0:
            self._fed = []
        self._fed.append(input_ids)
        if out.logits is None or self.processing is None:
            return out
        fed = torch.cat(self._fed, dim=1)  # [pending, drafted inputs ...]
        t, n = input_ids.shape[1], fed.shape[1]
        rows = list(range(n - t, n)) if not isinstance(logits_at, str) or logits_at == "all" else [n - 1]
        if isinstance(logits_at, torch.Tensor):
            rows = [n - t + int(r) for r in logits_at.tolist()]
        logits = out.logits if out.head is None else out.head.expand(out.logits)
        committed = self._tokens[:, : self.num_tokens]
        return replace(
            out, logits=self.processing.rows(committed, fed, logits, rows=rows), head=None, picked=None
        )

    def forward_verify(
        self,
        input_ids: torch.Tensor,
        *,
        logits_at: str | torch.Tensor | None = "all",
        position_ids: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        rule: AcceptanceRule | None = None,
        rule_inputs: Sequence[torch.Tensor | None] = (),
    ) -> ForwardOutput:
        """Full-model forward over a block (B, T) starting at the first uncommitted position.

        The draft's KV is discarded first; the block is written at ``[committed, committed + T)``
        in every layer. ``position_ids``/``tree_mask`` support tree verification (default: a chain).
        Stores the hidden states in ``last_hidden_states`` when ``capture_hidden``. ``rule``: the
        verifier's acceptance rule (`framework.types.AcceptanceRule`) on the block, every row's
        logits and ``rule_inputs``, inside the forward's graph where it runs as one; its outputs
        come back in ``ForwardOutput.ruled``; needs ``logits_at="all"``.

        After a reusable early-exit draft (see `forward_draft`) a chain verification whose block
        starts with the drafted inputs keeps the draft's blocks ``0..E-1`` for those positions and
        runs blocks ``E..L-1`` only; the result equals a full forward up to rounding. Without
        a ``rule`` the block is compared with the drafted inputs first (one device-to-host read;
        a block that differs is recomputed). With a ``rule`` nothing is read: the block is
        verified reusing the draft, and the rule sees ``-1`` in place of every token from the
        first position where the block leaves the drafted inputs on (`seen_ids`): rows from there
        on saw the draft's inputs, so it accepts none of them, and what it accepts is the full
        forward's. A block starts with the pending token, as the draft's first input does.
        """
        prefix, self._prefix = self._prefix, None
        self.stats.verify_tokens += int(input_ids.shape[1])
        call = None if rule is None else RuleCall(rule, tuple(rule_inputs), self.random)
        if self.processing is not None:  # the rows processed first, the rule on what they give
            out = self._verify(input_ids, prefix, logits_at, position_ids, tree_mask, None)
            return self._process_verification(out, input_ids, logits_at, tree_mask, call)
        return self._verify(input_ids, prefix, logits_at, position_ids, tree_mask, call)

    def _process_verification(
        self,
        out: ForwardOutput,
        input_ids: torch.Tensor,
        logits_at: str | torch.Tensor | None,
        tree_mask: torch.Tensor | None,
        call: RuleCall | None,
    ) -> ForwardOutput:
        """A verify forward's rows through the generation's processors, each with its own prefix
        (the committed tokens, then the block's tokens before the row: a tree row's ancestors),
        then the verifier's rule on them."""
        if out.logits is None or self.processing is None:
            return out
        t = input_ids.shape[1]
        rows: list[int] = list(range(t))
        if isinstance(logits_at, torch.Tensor):
            rows = [int(r) for r in logits_at.tolist()]
        elif logits_at == "last":
            rows = [t - 1]
        committed = self._tokens[:, : self.num_tokens]
        logits = self.processing.rows(committed, input_ids, out.logits, tree_mask=tree_mask, rows=rows)
        ruled = None if call is None else self.adapter.executor.apply_rule(call, input_ids, logits)
        return replace(out, logits=logits, ruled=ruled)

    def _verify(
        self,
        input_ids: torch.Tensor,
        prefix: _DraftPrefix | None,
        logits_at: str | torch.Tensor | None,
        position_ids: torch.Tensor | None,
        tree_mask: torch.Tensor | None,
        call: RuleCall | None,
    ) -> ForwardOutput:
        """`forward_verify`'s forward (reusing an early-exit draft where it can), ``call`` inside it."""
        if prefix is not None and position_ids is None and tree_mask is None:
            n = min(prefix.length, input_ids.shape[1])
            fed = torch.cat(prefix.ids, dim=1)[:, :n]
            complete = prefix.hidden is not None or not self.capture_hidden
            if n > 0 and complete and call is not None:
                # No read: the rule sees only the inputs the rows saw (`seen_ids`), inside the
                # forward of the upper blocks; the reusing path runs eagerly around its forwards.
                return self._verify_reusing(
                    input_ids, prefix, n, logits_at, replace(call, ids=input_ids, fed=fed)
                )
            if (
                n > 0 and complete and torch.equal(input_ids[:, :n], fed)
            ):  # one read: a caller that checks itself
                return self._verify_reusing(input_ids, prefix, n, logits_at)
        self._verified_chain = None
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
            rule=call,
        )
        self.stats.target_forwards += 1
        if self.capture_hidden:
            self.last_hidden_states = out.hidden_states
        chain = tree_mask is None and position_ids is None  # a tree's path: known after the read
        self._verified_chain, self._served = (out.hidden_states if chain else None), False
        return out

    def _verify_reusing(
        self,
        input_ids: torch.Tensor,
        prefix: _DraftPrefix,
        n: int,
        logits_at: str | torch.Tensor | None,
        rule: RuleCall | None = None,
    ) -> ForwardOutput:
        """Chain verification reusing a pure-prefix draft's first ``n`` positions (blocks < E);
        ``rule``: the verifier's acceptance rule, run inside the forward of the upper blocks."""
        e, c, t = prefix.exit_layer, self.cache.committed, input_ids.shape[1]
        capture = self.capture_hidden and prefix.hidden is not None
        self.cache.keep_draft(n, range(e))  # the draft's KV in blocks < E is the target's own
        h_e = torch.cat(prefix.last_hidden, dim=1)[:, :n]  # (B, n, d)
        lower = torch.cat(prefix.hidden, dim=2)[:, :, :n] if capture else None  # (E+1, B, n, d)
        if t > n:  # positions the draft never fed: blocks < E first, appended after the kept slots
            tail = self.adapter.forward(
                input_ids[:, n:],
                self._positions(c + n, t - n),
                self.cache,
                self.prefix_plan(e),
                logits_at=None,
                capture_hidden=capture,
            )
            h_e = torch.cat([h_e, tail.last_hidden], dim=1)
            if lower is not None:
                lower = torch.cat([lower, tail.hidden_states], dim=2)
        upper = self.adapter.forward_from(
            h_e,
            self._positions(c, t),
            self.cache,
            start=e,
            logits_at=logits_at,
            capture_hidden=capture,
            rule=rule,
        )
        self.stats.target_forwards += 1
        self.stats.verify_blocks_saved += e * n
        self.stats.reused_positions += n
        hidden = None
        if capture:
            hidden = torch.cat([lower, upper.hidden_states[1:]], dim=0)  # (L+1, B, T, d)
            self.last_hidden_states = hidden
        self._verified_chain, self._served = hidden, False  # a chain: the verification of a pure-prefix draft
        return ForwardOutput(upper.logits, hidden, upper.last_hidden, ruled=upper.ruled)

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
        is untouched. ``logits[:, j]`` predicts token ``start + j + 1``; a draft pass, so they come
        from `draft_head` (``ForwardOutput.top1`` maps them to token ids).

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
            head=self.draft_head,
            weights=self.draft_weights,
        )

    def forward_block(self, block: int, states: torch.Tensor, *, position: int) -> torch.Tensor:
        """Decoder block ``block`` applied to n candidate hidden states of the token at ``position``.

        The n candidates go through the block as a sequence of n tokens, all at ``position``: each
        attends to the committed KV of positions ``< position`` and to itself only, and their own
        KV is written in scratch slots that are forgotten (the committed cache is untouched).
        ``functools.partial(state.forward_block, position=p)`` is the ``run_block`` of CLaSp's DP.

        Args:
            block: the block index in ``[0, L)``.
            states: FloatTensor (n, d), pre-norm residuals entering the block.
            position: a committed position, ``0 <= position < pending_position``.

        Returns:
            FloatTensor (n, d), the residuals after the block.

        Raises:
            ValueError: ``position`` is not committed.
        """
        cache = self.cache
        if not 0 <= position < cache.committed:
            raise ValueError(f"position must be committed, in [0, {cache.committed}), got {position}")
        n = states.shape[0]
        # the positions and the mask, built once for the calls of one DP (one position, up to
        # M + 1 candidates): smaller calls take views of them
        held = self._block_inputs
        if held is None or held[0] != position or held[1].shape[1] < n:
            size = max(n, held[1].shape[1] if held is not None else 0)
            held = self._block_inputs = (
                position,
                torch.full((1, size), position, dtype=torch.long, device=self.device),
                torch.eye(size, dtype=torch.bool, device=self.device),
            )
        positions, mask = held[1][:, :n], held[2][:n, :n]
        out = self.adapter.forward_from(
            states[None],
            positions,
            cache,
            start=block,
            stop=block + 1,
            base=max(cache.lengths),
            visible=position,
            tree_mask=mask,
            persist=False,
        )
        return out.last_hidden[0]

    # ------------------------------------------------------------------ strategies' device work
    def compute(self, fn: Callable[..., Any], *inputs: torch.Tensor | None, **params: Any) -> Any:
        """A strategy's device work ``fn(ops, *inputs, **params)``, keyed, randomised and run by
        the engine (`framework.engine.execution.work`: one graph where forwards run as one)."""
        return self._work.run(fn, inputs, params)

    def compute_at(
        self, position: int, fn: Callable[..., Any], *inputs: torch.Tensor | None, **params: Any
    ) -> Any:
        """`compute`, whose ``ops.block(b, states)`` is `forward_block` at the committed
        ``position`` (CLaSp's dynamic programme).

        Raises:
            ValueError: ``position`` is not committed.
        """
        if not 0 <= position < self.cache.committed:
            raise ValueError(f"position must be committed, in [0, {self.cache.committed}), got {position}")
        return self._work.run(fn, inputs, params, position)

    # ------------------------------------------------------------------ the round's read
    def read(self, **values: torch.Tensor) -> dict[str, list[Any]]:
        """The round's device-to-host read, by name: each tensor flattened into Python numbers
        (ints for an integer tensor). The strategies' `reads` of the chain just verified (or of
        the prompt, at the prefill) travel in the same transfer (one concatenation in float64,
        exact for token ids and counts) and reach them by `values_for`."""
        asked = []
        if not self._served and self._verified_chain is not None:  # a chain (a tree's path: at the commit)
            asked = self._readers_values(self._verified_chain)
            self._served = True
        out = _read_named(
            {**values, **{f"{i}.{k}": v for i, (_, vals) in enumerate(asked) for k, v in vals.items()}}
        )
        for i, (strategy, vals) in enumerate(asked):
            self._values[strategy] = {k: out.pop(f"{i}.{k}") for k in vals}
        return out

    def values_for(self, strategy: Any) -> Mapping[str, list[Any]]:
        """What ``strategy``'s `reads` asked for, read: of the prompt until the first round
        commits, then of each round's verified chain (empty when it asked for nothing)."""
        return self._values.get(strategy, {})

    def _readers_values(self, chain: torch.Tensor | None) -> list[tuple[Any, dict[str, torch.Tensor]]]:
        """Each reading strategy's values of ``chain`` (L+1, B, T, d); every reader starts empty."""
        out = []
        for strategy in self._readers:
            self._values[strategy] = {}
            vals = strategy.reads(self, chain) if chain is not None else None
            if vals:
                out.append((strategy, dict(vals)))
        return out

    # ------------------------------------------------------------------ commits
    def append(self, tokens: torch.Tensor, host: Sequence[int] | None = None) -> None:
        """Append (B, n) tokens without KV changes (the first token after prefill); ``host``: row
        0's tokens as ints when the caller has them (kept for `host_tokens`, no device read)."""
        n = tokens.shape[1]
        self._ensure_token_capacity(n)
        self._tokens[:, self.num_tokens : self.num_tokens + n] = tokens
        if host is not None and len(self._host) == self.num_tokens:
            self._host.extend(host)
        self.num_tokens += n

    def known_on_host(self, tokens: Sequence[int]) -> None:
        """Row 0's last ``len(tokens)`` tokens, appended without ``host``, as the host read them
        (kept for `host_tokens`: no device read for them later)."""
        if len(self._host) + len(tokens) == self.num_tokens:
            self._host.extend(tokens)

    def host_tokens(self) -> list[int]:
        """Row 0's tokens (prompt, generated, ``pending``) as Python ints, without a device read
        for what commits already brought to the host (`Verification.committed_host`); any other
        tail is read once. The list is the state's own: do not modify it."""
        del self._host[self.num_tokens :]
        if len(self._host) < self.num_tokens:
            self._host.extend(self._tokens[0, len(self._host) : self.num_tokens].tolist())
        return self._host

    def commit(self, result: Verification) -> torch.Tensor:
        """Commit a verification: tokens appended, KV cut to exactly the verified prefix.

        When hidden states are captured and the verifier did not pass them on, the verify pass's
        are filled into ``result.hidden_states`` (so `Verification.last_hidden` works).

        Returns:
            LongTensor (B, m+1), the tokens committed.
        """
        new = result.new_tokens
        n = new.shape[1]
        # KV of [pending, d_1..d_m] (m + 1 = n positions) was written by the verify pass.
        self.cache.commit(n, keep=result.kv_keep, keep_host=result.kv_keep_host)
        if self.capture_hidden and result.hidden_states is None:
            result.hidden_states = self.last_hidden_states
        host = result.committed_host() if new.shape[0] == 1 else None
        if isinstance(self.draft_head, LiveDraftHead):
            self.draft_head.observe(new, host)  # coverage; a context head adds the new tokens
        self.append(new, host=host)
        self.draft_len = 0
        self._prefix = None
        if not self._served and self._readers:  # nothing rode on a read: the engine reads itself
            chain = result.path_hidden if self.capture_hidden else None
            asked = self._readers_values(chain)
            if asked:
                got = _read_named(
                    {f"{i}.{k}": v for i, (_, vals) in enumerate(asked) for k, v in vals.items()}
                )
                for i, (strategy, vals) in enumerate(asked):
                    self._values[strategy] = {k: got[f"{i}.{k}"] for k in vals}
        self._verified_chain, self._served = None, False  # the next round's
        self.round += 1
        return new

    def discard_draft(self) -> None:
        """Forget the current round's draft KV (e.g. a drafter that gives up)."""
        self.cache.rollback()
        self.draft_len = 0
        self._prefix = None

    def _ensure_token_capacity(self, n: int) -> None:
        if self.num_tokens + n > self._tokens.shape[1]:
            with torch.inference_mode(False):
                grow = torch.zeros(
                    self._tokens.shape[0], 2 * self._tokens.shape[1] + n, dtype=torch.long, device=self.device
                )
            grow[:, : self.num_tokens] = self._tokens[:, : self.num_tokens]
            self._tokens = grow


def _read_named(values: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """``values`` read to the host in one transfer, by name: each flattened into Python numbers,
    ints for an integer (or boolean) tensor. One tensor reads as it is; several are concatenated,
    in their dtype when they share an integer one, else in float64 (exact for token ids and
    counts)."""
    flat = {k: v.reshape(-1) for k, v in values.items()}
    if not flat:
        return {}
    if len(flat) == 1:
        ((name, v),) = flat.items()
        return {name: v.tolist()}
    device = next(iter(flat.values())).device
    dtypes = {v.dtype for v in flat.values()}
    common = (
        dtypes.pop()
        if len(dtypes) == 1 and not flat[next(iter(flat))].dtype.is_floating_point
        else torch.float64
    )
    host = torch.cat([v.to(device, common) for v in flat.values()]).tolist()
    out, at = {}, 0
    for name, v in flat.items():
        n = v.numel()
        part = host[at : at + n]
        out[name] = part if v.is_floating_point() else [int(x) for x in part]
        at += n
    return out
