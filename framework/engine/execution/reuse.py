"""Early-exit reuse (`EarlyExitReuse`): a draft that runs a pure prefix of the model (blocks
``0..E-1``, nothing skipped) computed exactly what the target computes for the drafted positions,
so the next chain verification keeps their KV and hidden states and runs only blocks ``E..L-1``
for them (plus every block for positions the draft never fed). ``DecodeStats.verify_blocks_saved``
counts the block evaluations this avoided. The decode state asks it before and after each draft
step and at the verification (`framework.engine.state.DecodeState.forward_draft`, ``forward_verify``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from framework.engine.execution.spec import RuleCall
from framework.types import ForwardOutput, LayerPlan

#: The decode state (`framework.engine.state.DecodeState`; not imported: it imports this).
DecodeState = Any


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


class EarlyExitReuse:
    """This round's reusable draft, kept step by step, and the verification that keeps it."""

    def __init__(self) -> None:
        self._prefix: _DraftPrefix | None = None

    def drop(self) -> None:
        """Nothing of this round's draft is kept (a draft step that is not reusable, a commit)."""
        self._prefix = None

    def before_step(self, state: DecodeState, plan: LayerPlan | None) -> bool:
        """Check a reusable draft step of ``plan`` and start or continue the round's prefix;
        returns whether the step captures every block's hidden states (for the verification's).

        Raises:
            ValueError: a plan that is not a pure prefix, or compressed draft weights.
        """
        if state.compressed_drafts:
            weights = state.draft_weights.weights if state.draft_weights is not None else None
            raise ValueError(
                f"reusable draft steps must run the model's own weights (draft_weights is {weights}): "
                "verification would keep what the compressed copy computed"
            )
        if plan is None or plan.exit_layer is None or plan.exit_layer >= plan.num_layers:
            raise ValueError("reusable draft steps need an early-exit plan with exit_layer < L")
        e = plan.exit_layer
        if any(not (plan.runs_attn(i) and plan.runs_mlp(i)) for i in range(e)):
            raise ValueError("reusable draft steps must run every sub-layer before the exit layer")
        if state.draft_len == 0:
            self._prefix = _DraftPrefix(e, hidden=[] if state.capture_hidden else None)
        elif self._prefix is not None and (
            self._prefix.exit_layer != e or self._prefix.length != state.draft_len
        ):
            self._prefix = None  # not one contiguous pure-prefix draft: verify recomputes
        return self._prefix is not None and self._prefix.hidden is not None

    def after_step(self, input_ids: torch.Tensor, out: ForwardOutput) -> None:
        """Keep what a reusable step computed."""
        if self._prefix is not None:
            self._prefix.ids.append(input_ids)
            self._prefix.last_hidden.append(out.last_hidden)
            if self._prefix.hidden is not None:
                self._prefix.hidden.append(out.hidden_states)

    def verify(
        self,
        state: DecodeState,
        input_ids: torch.Tensor,
        logits_at: str | torch.Tensor | None,
        call: RuleCall | None,
    ) -> ForwardOutput | None:
        """The chain verification of ``input_ids`` (a block starting with the pending token, as
        the draft's first input does) reusing this round's draft, or ``None`` when it cannot (no
        reusable draft, or one without the hidden states the selector asked for). With a rule
        nothing is read: the rule sees ``-1`` from where the block leaves the drafted inputs
        (`framework.engine.execution.spec.seen_ids`); without one the block is compared with them
        (one read) and a block that differs is not reused."""
        prefix, self._prefix = self._prefix, None
        if prefix is None:
            return None
        n = min(prefix.length, input_ids.shape[1])
        fed = torch.cat(prefix.ids, dim=1)[:, :n]
        if n == 0 or (prefix.hidden is None and state.capture_hidden):
            return None
        if call is not None:  # inside the forward of the upper blocks; eager around its forwards
            return self._upper(state, input_ids, prefix, n, logits_at, replace(call, ids=input_ids, fed=fed))
        if torch.equal(input_ids[:, :n], fed):  # one read: a caller that checks itself
            return self._upper(state, input_ids, prefix, n, logits_at, None)
        return None

    def _upper(
        self,
        state: DecodeState,
        input_ids: torch.Tensor,
        prefix: _DraftPrefix,
        n: int,
        logits_at: str | torch.Tensor | None,
        rule: RuleCall | None,
    ) -> ForwardOutput:
        """Blocks ``E..L-1`` over the block, the draft's blocks ``< E`` kept for its first ``n``
        positions; ``rule``: the verifier's acceptance rule, inside the forward of the upper blocks."""
        e, c, t = prefix.exit_layer, state.cache.committed, input_ids.shape[1]
        capture = state.capture_hidden and prefix.hidden is not None
        state.cache.keep_draft(n, range(e))  # the draft's KV in blocks < E is the target's own
        h_e = torch.cat(prefix.last_hidden, dim=1)[:, :n]  # (B, n, d)
        lower = torch.cat(prefix.hidden, dim=2)[:, :, :n] if capture else None  # (E+1, B, n, d)
        if t > n:  # positions the draft never fed: blocks < E first, appended after the kept slots
            tail = state.adapter.forward(
                input_ids[:, n:],
                state.positions(c + n, t - n),
                state.cache,
                state.prefix_plan(e),
                logits_at=None,
                capture_hidden=capture,
            )
            h_e = torch.cat([h_e, tail.last_hidden], dim=1)
            if lower is not None:
                lower = torch.cat([lower, tail.hidden_states], dim=2)
        upper = state.adapter.forward_from(
            h_e,
            state.positions(c, t),
            state.cache,
            start=e,
            logits_at=logits_at,
            capture_hidden=capture,
            rule=rule,
        )
        state.stats.verify_blocks_saved += e * n
        state.stats.reused_positions += n
        hidden = torch.cat([lower, upper.hidden_states[1:]], dim=0) if capture else None  # (L+1, B, T, d)
        return ForwardOutput(upper.logits, hidden, upper.last_hidden, ruled=upper.ruled)
