"""The decode state: one generation's tokens, KV cache, round and counters, as the views see it.

Strategies never touch the KV cache: they call the forwards of the views (`framework.view`), which
this class implements with the cache semantics of `framework.engine.kv_cache`. Invariant between
rounds: ``cache.committed == num_tokens - 1``; the last committed token (``pending``) has no KV yet
and is the first input of the next draft and verification. What the state delegates lives beside
it: the committed tokens (`framework.engine.tokens`), the forwards (`framework.engine.forwards`),
early-exit reuse (`framework.engine.execution.reuse`), the round's reads (`framework.engine.reads`),
a draft step by step (`framework.engine.draft_steps`) and the logits processors
(`framework.engine.processing`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from framework.engine.adapter import ModelAdapter
from framework.engine.draft_head import DraftHead, LiveDraftHead
from framework.engine.draft_steps import DraftConfidence, DraftSteps, ForceAfter, copied_draft
from framework.engine.execution.reuse import EarlyExitReuse
from framework.engine.execution.spec import RuleCall
from framework.engine.execution.work import DeviceWork, RandomStream
from framework.engine.forwards import ScratchBlocks, draft_pass, scratch_pass, verify_pass
from framework.engine.host_values import HostValues, constant
from framework.engine.kv_cache import KVCache
from framework.engine.processing import LogitsProcessing
from framework.engine.reads import RoundReads
from framework.engine.tokens import CommittedTokens
from framework.interfaces import Drafter, LayerSelector, LengthController, Strategy, Verifier
from framework.kernels.protocols import DraftWeights
from framework.types import (
    AcceptanceRule,
    DecodeStats,
    Draft,
    ForwardOutput,
    LayerPlan,
    TokenPick,
    Verification,
)
from framework.utils import upload


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
        self.adapter, self.info, self.device = adapter, adapter.arch.info(), adapter.arch.device
        self.prompt_len = int(prompt_ids.shape[1])
        self.committed_tokens = CommittedTokens(prompt_ids, capacity, self.device)
        self.cache: KVCache = adapter.new_cache(max(capacity, self.prompt_len + 1), batch=prompt_ids.shape[0])
        self.capture_hidden, self.need_confidence = capture_hidden, need_confidence
        self.need_draft_probs = need_draft_probs
        #: set from the strategies (`for_strategies`): the verifier's draft sampler (``None``: argmax)
        #: and top-k, the drafter's head and weights (``None``: the model's own, as verifications run)
        self.draft_sampler: Callable[..., Any] | None = None
        self.draft_top_k = 0
        self.draft_head: DraftHead | None = None
        self.draft_weights: DraftWeights | None = None
        #: set by the decoder: the logits processors (`framework.engine.processing`, every row a
        #: forward scores, with its own prefix) and the grammar matcher (``forced(tokens, limit)``)
        self.processing: LogitsProcessing | None = None
        self.grammar: Any = None
        #: the generation's random stream (`compute`'s draws; the decoder sets the verifier's)
        self.random: RandomStream | None = None
        self.draft_len = 0  # tokens fed to the draft model in the current round
        self.round = 0
        self.stats = DecodeStats()
        #: hidden states of the last verification (L+1, B, T, d), when capture_hidden
        self.last_hidden_states: torch.Tensor | None = None
        #: row 0 of the last commit's tokens as ints (the decode loop's stop check)
        self.last_committed: list[int] = []
        self._work, self._reads, self._reuse = DeviceWork(self), RoundReads(readers), EarlyExitReuse()
        self._steps: DraftSteps | None = None  # this round's draft, step by step
        self._prefix_plans: dict[int, LayerPlan] = {}
        self._blocks = ScratchBlocks()  # `forward_block`'s inputs, built once per position

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
        """A state whose flags and hooks come from the strategies' capability declarations: the
        one place that wires ``needs_hidden_states``, ``needs_confidence``, ``needs_draft_probs``,
        ``draft_sampler()``, ``draft_top_k()``, ``random``, ``reads``, ``draft_head()`` and
        ``draft_weights()`` into the state."""
        strategies = (selector, length, drafter, verifier)
        state = cls(
            adapter,
            prompt_ids,
            capacity,
            capture_hidden=selector.needs_hidden_states,
            need_confidence=length.needs_confidence,
            need_draft_probs=verifier.needs_draft_probs,
            readers=[s for s in strategies if s is not None and type(s).reads is not Strategy.reads],
        )
        state.draft_sampler, state.draft_top_k = verifier.draft_sampler(), verifier.draft_top_k()
        state.random = verifier.random
        head = drafter.draft_head() if drafter is not None else None
        if head is not None:
            state.draft_head = head.start(prompt_ids)
        state.draft_weights = drafter.draft_weights() if drafter is not None else None
        return state

    # ------------------------------------------------------------------ what a round reads
    @property
    def layer_loads(self) -> int:
        """Blocks entered by the model's forwards so far (a lifetime counter: read differences)."""
        return self.adapter.executor.layer_loads

    @property
    def compressed_drafts(self) -> bool:
        """Whether draft passes run a compressed copy of the weights (no early-exit reuse then)."""
        return self.draft_weights is not None and self.draft_weights.weights != "float32"

    @property
    def host_values(self) -> HostValues:
        """What this round's reads, uploads and draft steps brought to the host."""
        return self._reads.known

    @property
    def num_tokens(self) -> int:
        """N: the prompt and every committed new token (``pending`` included)."""
        return self.committed_tokens.count

    @property
    def tokens(self) -> torch.Tensor:
        """LongTensor (B, N): prompt and every committed new token (``pending`` included)."""
        return self.committed_tokens.span(0)

    @property
    def new_tokens(self) -> torch.Tensor:
        """LongTensor (B, N - P): the generated tokens so far."""
        return self.committed_tokens.span(self.prompt_len)

    @property
    def num_new(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def pending(self) -> torch.Tensor:
        """LongTensor (B, 1): the last committed token, whose KV is not cached yet."""
        return self.committed_tokens.span(self.num_tokens - 1)

    @property
    def pending_position(self) -> int:
        """The position of `pending`: the first KV slot not committed (a verified block starts here)."""
        return self.cache.committed

    def positions(self, start: int, n: int) -> torch.Tensor:
        """Positions ``start .. start + n - 1`` (B, n): a view of one arange per state."""
        return self.committed_tokens.positions(start, n)

    def prefix_plan(self, exit_layer: int) -> LayerPlan:
        """The plan that runs blocks ``0..exit_layer-1`` unchanged, then the LM head."""
        if exit_layer not in self._prefix_plans:
            self._prefix_plans[exit_layer] = LayerPlan.from_indices(
                self.info.num_layers, exit_layer=exit_layer
            )
        return self._prefix_plans[exit_layer]

    def top1_from_hidden(
        self, hidden: torch.Tensor, *, draft_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy token and its probability for pre-norm residuals (..., d): the full LM head,
        or with ``draft_head`` the generation's `draft_head` (``ModelAdapter.top1_from_hidden``)."""
        return self.adapter.top1_from_hidden(hidden, head=self.draft_head if draft_head else None)

    # ------------------------------------------------------------------ forwards
    def prefill(self) -> torch.Tensor:
        """Full forward over the prompt; the last position's logits (B, V). The prompt's KV is
        committed but for its last token, ``pending``; the caller appends the first new token."""
        p = self.prompt_len
        out = self.adapter.forward(
            self.tokens,
            self.positions(0, p),
            self.cache,
            logits_at="last",
            capture_hidden=self.capture_hidden,
        )
        self.cache.commit(p)
        self.verified(out)  # the prompt's hidden states: read with the first token
        if self.processing is not None:
            return self.processing.next(self.tokens, out.logits[:, -1])
        return out.logits[:, -1]

    def forward_draft(
        self,
        input_ids: torch.Tensor,
        plan: LayerPlan | None,
        *,
        logits_at: str | torch.Tensor | None = "last",
        reusable: bool = False,
        pick: TokenPick | None = None,
    ) -> ForwardOutput:
        """Feed draft token(s) (B, T) through ``plan`` after the committed prefix and this round's
        draft (`framework.engine.forwards.draft_pass`)."""
        self._device_work()
        out = draft_pass(self, self._reuse, input_ids, plan, logits_at, reusable, pick)
        self.draft_len += input_ids.shape[1]
        self.stats.draft_forwards += 1
        return out

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
        """Full-model forward over a block (B, T) from `pending_position`, the draft's KV discarded
        first, ``rule`` folded in (`framework.engine.forwards.verify_pass`)."""
        self._device_work()
        self.stats.verify_tokens += int(input_ids.shape[1])
        call = None if rule is None else RuleCall(rule, tuple(rule_inputs), self.random)
        return verify_pass(self, self._reuse, input_ids, logits_at, position_ids, tree_mask, call)

    def verified(self, out: ForwardOutput, chain: bool = True) -> None:
        """Count a target forward (the prefill, a verification) and keep its hidden states; a chain's
        go to the round's reads (a tree's path is known after the read)."""
        self.stats.target_forwards += 1
        if self.capture_hidden:
            self.last_hidden_states = out.hidden_states
        self._reads.verified(out.hidden_states if chain else None)

    def forward_scratch(
        self,
        start: int,
        plan: LayerPlan | None,
        *,
        end: int | None = None,
        logits_at: str | torch.Tensor | None = "all",
    ) -> ForwardOutput:
        """A teacher-forced draft pass over committed tokens, the cache untouched (`scratch_pass`)."""
        self._device_work()
        return scratch_pass(self, start, plan, end, logits_at)

    def forward_block(self, block: int, states: torch.Tensor, *, position: int) -> torch.Tensor:
        """Decoder block ``block`` on candidate states (n, d) of the committed ``position``, the cache
        untouched (`ScratchBlocks.run`)."""
        self._device_work()
        return self._blocks.run(self, block, states, position)

    # ------------------------------------------------------------------ strategies' device work
    def _device_work(self) -> None:
        self._reads.device_work(self.round)

    def compute(self, fn: Callable[..., Any], *inputs: torch.Tensor | None, **params: Any) -> Any:
        """A strategy's device work ``fn(ops, *inputs, **params)``, keyed, randomised and run by
        the engine (`framework.engine.execution.work`: one graph where forwards run as one)."""
        self._device_work()
        return self._work.run(fn, inputs, params)

    def compute_at(
        self, position: int, fn: Callable[..., Any], *inputs: torch.Tensor | None, **params: Any
    ) -> Any:
        """`compute`, whose ``ops.block(b, states)`` is `forward_block` at the committed ``position``.

        Raises:
            ValueError: ``position`` is not committed.
        """
        if not 0 <= position < self.cache.committed:
            raise ValueError(f"position must be committed, in [0, {self.cache.committed}), got {position}")
        self._device_work()
        return self._work.run(fn, inputs, params, position)

    def read(self, **values: torch.Tensor) -> dict[str, list[Any]]:
        """The round's device-to-host read, by name (`framework.engine.reads.RoundReads.read`)."""
        return self._reads.read(self, values)

    def values_for(self, strategy: Any) -> Mapping[str, list[Any]]:
        """What ``strategy``'s `reads` asked for, read (empty when it asked for nothing)."""
        return self._reads.values_for(strategy)

    def tensor(self, values: Sequence[Any], dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host ``values`` on the device without waiting; the engine keeps them for the round."""
        out = upload(values, self.device, dtype)
        nested = values and isinstance(values[0], (list, tuple))
        self._reads.known.remember(out, [x for row in values for x in row] if nested else list(values))
        return out

    def constant(
        self, values: Any, dtype: torch.dtype = torch.long, *, key: Hashable | None = None
    ) -> torch.Tensor:
        """``values`` on the device once per model, shared (`framework.engine.host_values.constant`)."""
        return constant(self.adapter.executor.constants, self.device, values, dtype, key)

    # ------------------------------------------------------------------ the round's draft
    def draft_step(
        self, input_ids: torch.Tensor, plan: LayerPlan | None, *, reusable: bool = False
    ) -> tuple[torch.Tensor, DraftConfidence | None]:
        """A draft forward and the token the engine chooses from its last row (`DraftSteps.step`)."""
        return self._draft_steps().step(input_ids, plan, reusable)

    def force(self, tokens: Sequence[int], *, after: ForceAfter | None = None) -> None:
        """Draft ``tokens`` with no forward; ``after`` each fed token, what it returns (`DraftSteps.force`)."""
        self._draft_steps().force(tokens, after)

    def _draft_steps(self) -> DraftSteps:
        if self._steps is None:
            self._steps = DraftSteps(self)
        return self._steps

    def drop_draft_step(self, confidence: float | None = None) -> None:
        """Forget the last draft token (`DraftSteps.drop_last`)."""
        if self._steps is not None:
            self._steps.drop_last(confidence)

    def drafted(self, plan: LayerPlan) -> Draft:
        """The round's draft of the tokens `draft_step` chose (possibly none), with ``plan``."""
        steps, self._steps = self._steps, None
        return (steps or DraftSteps(self)).build(plan)

    def copied_draft(self, tokens: Sequence[int], plan: LayerPlan, confidence: float) -> Draft:
        """A draft of ``tokens`` copied from the context, after what `force` drafted
        (`framework.engine.draft_steps.copied_draft`)."""
        return copied_draft(self, tokens, plan, confidence, self._steps)

    # ------------------------------------------------------------------ commits
    def append(self, tokens: torch.Tensor, host: Sequence[int] | None = None) -> None:
        """Append (B, n) tokens without KV changes (the first token after prefill); ``host``: row
        0's tokens as ints when the caller has them (kept for `token_ids`, no device read)."""
        self.committed_tokens.append(tokens, host)

    def known_on_host(self, tokens: Sequence[int]) -> None:
        """Row 0's last ``len(tokens)`` tokens, appended without ``host``, as the host read them."""
        self.committed_tokens.known_on_host(tokens)

    def token_ids(self) -> list[int]:
        """Row 0's tokens (prompt, generated, ``pending``) as Python ints, without a device read for
        what commits brought to the host (`CommittedTokens.ids`), then what `force` drafted before
        the round's first draft step. Do not modify the list."""
        ids = self.committed_tokens.ids()
        return ids if self._steps is None or not self._steps.context else [*ids, *self._steps.context]

    def commit(self, result: Verification) -> torch.Tensor:
        """Commit a verification: its tokens appended, the KV cut to exactly the verified prefix
        (its hidden states filled in when captured and not passed on). What a read or an upload
        brought to the host is not read again. Returns the tokens committed, (B, m+1)."""
        new, keep = result.new_tokens, result.kv_keep
        known = self._reads.known
        # KV of [pending, d_1..d_m] (m + 1 positions) was written by the verify pass.
        self.cache.commit(new.shape[1], keep=keep, keep_host=None if keep is None else known.of(keep))
        if self.capture_hidden and result.hidden_states is None:
            result.hidden_states = self.last_hidden_states
        host = (known.of(new[0]) or new[0].tolist()) if new.shape[0] == 1 else None
        self.last_committed = host or []
        if isinstance(self.draft_head, LiveDraftHead):
            self.draft_head.observe(new, host)  # coverage; a context head adds the new tokens
        self.append(new, host=host)
        self._end_draft()  # the cache's commit dropped the draft's KV
        self._reads.commit(self, result.path_hidden if self.capture_hidden else None)
        self.round += 1
        return new

    def discard_draft(self) -> None:
        """Forget the current round's draft KV and tokens (e.g. a drafter that gives up)."""
        self.cache.rollback()
        self._end_draft()

    def _end_draft(self) -> None:
        self.draft_len, self._steps = 0, None
        self._reuse.drop()
