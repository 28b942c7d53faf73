"""Shared step-by-step bookkeeping of drafters: pick each draft token and keep what was asked for.

A drafter's loop is its own (which forward, when to stop); what every drafter does the same way
after each forward lives in `DraftBuilder`: choose the token as the verifier wants it (the warped
sample of ``state.draft_sampler``, else the argmax) and keep only the extras some strategy
declared it needs (top-1 confidences, full distributions, top-k candidates).
"""

from __future__ import annotations

import torch

from framework.interfaces import Draft, LayerPlan


class DraftBuilder:
    """Collects one round's draft tokens.

    Args:
        state: the `DecodeState`; its flags (``need_confidence``, ``need_draft_probs``,
            ``draft_top_k``, ``draft_sampler``) decide what is computed.
    """

    def __init__(self, state) -> None:
        self.sampler = state.draft_sampler
        self.want_extras = state.need_confidence or state.need_draft_probs or state.draft_top_k > 0
        self.want_probs = state.need_draft_probs
        self.top_k = state.draft_top_k
        self.batch = state.pending.shape[0]
        self.device = state.device
        self.tokens: list[torch.Tensor] = []
        self.confs: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.top_tokens: list[torch.Tensor] = []
        self.top_probs: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, logits: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """Choose the next draft token from ``logits`` (B, V).

        Returns:
            ``(token (B,), confidence)``: the confidence is the top-1 draft probability of batch
            row 0 (``None`` when no strategy asked for probabilities).
        """
        if self.sampler is not None:  # sampling: the same warping as the verifier's target
            tok, p = self.sampler(logits)  # p: the warped draft distribution q (B, V)
            top_p = p.max(dim=-1).values  # Draft & Verify Alg. 4: max_x q(x)
        elif self.want_extras:
            p = torch.softmax(logits.float(), dim=-1)
            top_p, tok = p.max(dim=-1)
        else:
            self.tokens.append(logits.argmax(dim=-1))
            return self.tokens[-1], None
        if self.want_probs:
            self.probs.append(p)
        if self.top_k:
            vals, idx = p.topk(self.top_k, dim=-1)  # (B, k), sorted; idx[:, 0] is the argmax
            self.top_tokens.append(idx)
            self.top_probs.append(vals)
        self.confs.append(top_p)
        self.tokens.append(tok)
        return tok, float(top_p[0])

    def drop_last(self) -> None:
        """Forget the last token (a drafter that breaks before appending, as DEL does)."""
        for lst in (self.tokens, self.confs, self.probs, self.top_tokens, self.top_probs):
            if lst:
                lst.pop()

    def build(self, plan: LayerPlan) -> Draft:
        """The `Draft` of the tokens collected (possibly none)."""

        def stack(xs: list[torch.Tensor]) -> torch.Tensor | None:
            return torch.stack(xs, dim=1) if xs else None

        tokens = stack(self.tokens)
        if tokens is None:
            tokens = torch.empty(self.batch, 0, dtype=torch.long, device=self.device)
        return Draft(
            tokens=tokens,
            plan=plan,
            confidences=stack(self.confs),
            probs=stack(self.probs),
            top_tokens=stack(self.top_tokens),
            top_probs=stack(self.top_probs),
        )
