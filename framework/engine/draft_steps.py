"""A round's draft, step by step, kept by the engine (issue 56): a drafter asks for the next token
(``state.draft_step``) and for the round's `Draft` (``state.drafted``); what every drafter did the
same way after each forward lives here.

`DraftSteps` chooses each token as the verifier wants it (the warped sample of the verifier's
draft sampler, else the argmax, picked inside the forward where it runs as one graph) and keeps
only the extras some strategy declared it needs (top-1 confidences, full distributions, top-k
candidates). The confidences a stop rule read step by step are remembered on the host with the
draft (`framework.engine.host_values`): a strategy that reads them again reads nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from framework.types import Draft, LayerPlan, Picked, TokenPick, pick_tokens
from framework.view import DeviceOps

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead

#: The decode state (`framework.engine.state.DecodeState`; not imported: it imports this).
DecodeState = Any
#: What forces tokens after each drafted token fed (`DraftSteps.force`): the fed tokens -> the forced.
ForceAfter = Callable[[list[int]], Sequence[int]]


class DraftConfidence(float):
    """The confidence `DraftSteps.add` reports: a float, the top-1 draft probability (what
    ``LengthController.should_continue`` documents), that also knows the probability of the token
    actually drafted under the draft's unwarped softmax (`sampled`).

    ``sampled`` is what Draft & Verify's released code compares with its threshold when it samples
    (``decoding.py``, ``self_speculative_sample``: the temperature-1 softmax of the draft logits,
    without top-k / top-p, at the sampled token); the threshold controllers offer it as
    ``stop_on="sampled"``. Under greedy drafting the drafted token is the argmax, so ``sampled``
    is the float itself; when sampling it costs one softmax, on first access only.
    """

    def __new__(cls, top1: float, logits: torch.Tensor | None = None, token: torch.Tensor | None = None):
        """A confidence of value ``top1`` (the top-1 draft probability, of the warped q when
        sampling); ``logits`` are the draft logits of batch row 0 (V,) and ``token`` the token
        drafted there (a 0-d tensor) when sampling, else ``None``."""
        self = super().__new__(cls, top1)
        self._logits, self._token = logits, token
        self._sampled = float(top1) if logits is None else None
        #: ``sampled`` was read (a stop rule depended on the drafted token itself).
        self.read_sampled = False
        return self

    @property
    def sampled(self) -> float:
        """The probability of the drafted token under the unwarped draft softmax (batch row 0)."""
        self.read_sampled = True
        if self._sampled is None:
            self._sampled = float(torch.softmax(self._logits.float(), dim=-1)[self._token])
            self._logits = self._token = None
        return self._sampled


def sampled_step(
    ops: DeviceOps, logits: torch.Tensor, *, rule: Callable[..., Any], top_k: int
) -> dict[str, torch.Tensor]:
    """A sampled draft step's device work: the token and q by the verifier's ``rule`` (its draws
    from ``ops``), q's top-1 probability (Draft & Verify Alg. 4: max_x q(x)) and its ``top_k``."""
    tok, p = rule(ops, logits)
    out = {"tokens": tok, "q": p, "top_p": p.max(dim=-1).values}
    if top_k:
        vals, idx = p.topk(min(top_k, p.shape[-1]), dim=-1)  # (B, k), sorted by p
        out.update(top_tokens=idx, top_probs=vals)
    return out


class DraftSteps:
    """Collects one round's draft tokens.

    Args:
        state: the `DecodeState`; its flags (``need_confidence``, ``need_draft_probs``,
            ``draft_top_k``, ``draft_sampler``) decide what is computed.
    """

    def __init__(self, state: DecodeState) -> None:
        self._state = state
        self.sampler = state.draft_sampler
        self.want_extras = state.need_confidence or state.need_draft_probs or state.draft_top_k > 0
        self.want_probs = state.need_draft_probs
        self.want_conf = state.need_confidence  # reading it is a device sync: only when asked
        self.top_k = state.draft_top_k
        #: what a draft forward may choose for this builder inside its graph (`ForwardSpec.pick`, handed
        #: back as ``ForwardOutput.picked``); ``None`` when sampling (the sampler's stream is the
        #: verifier's)
        self.pick = (
            None
            if self.sampler is not None
            else TokenPick(softmax=self.want_extras, probs=self.want_probs, top_k=self.top_k)
        )
        self.batch = state.pending.shape[0]
        self.device = state.device
        self.tokens: list[torch.Tensor] = []
        self.confs: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.top_tokens: list[torch.Tensor] = []
        self.top_probs: list[torch.Tensor] = []
        self.read_top1: list[float] = []  # what the stop rule read, step by step
        #: forced tokens (`force`): those placed before the first step (host ints, the context a
        #: drafter continues), those that ride along with the next forward (B, n), and the function
        #: that forces tokens after each drafted token fed
        self.context: list[int] = []
        self.queue: torch.Tensor | None = None
        self.after: ForceAfter | None = None
        self.stepped = False

    def __len__(self) -> int:
        return len(self.tokens)

    def step(
        self, input_ids: torch.Tensor, plan: LayerPlan | None, reusable: bool
    ) -> tuple[torch.Tensor, DraftConfidence | None]:
        """One draft forward of ``input_ids`` through ``plan`` and its token (`add`), picked
        inside the forward when it can be; forced tokens (`force`) ride along after the input."""
        if self.after is not None and self.stepped:  # the drafter feeds what it drafted
            run = self.after(input_ids[0].tolist())
            if run:
                self.queue = self.known(run, 1.0)
        if self.queue is not None:
            input_ids, self.queue = torch.cat([input_ids, self.queue], dim=1), None
        self.stepped = True
        fwd = self._state.forward_draft(input_ids, plan, logits_at="last", reusable=reusable, pick=self.pick)
        return self.add(fwd.logits[:, -1], fwd.head, fwd.picked)

    def force(self, tokens: Sequence[int], after: ForceAfter | None) -> None:
        """Draft ``tokens`` without a forward (`known`, confidence 1): the context a drafter
        continues (``token_ids``), fed after the input of the next draft forward. ``after``: called
        with the tokens a drafter feeds to each later draft forward (host ints: the tokens it
        drafted), returns tokens to force after them, which ride along in that forward."""
        if tokens:
            self.queue = self.known(tokens, 1.0)
            self.context.extend(int(t) for t in tokens)
        self.after = after

    def known(self, tokens: Sequence[int], confidence: float) -> torch.Tensor:
        """Append ``tokens`` (host ints) to the draft without a forward, each with ``confidence`` and
        a one-hot draft distribution where the strategies asked for them (a copied token's extras:
        `copied_draft`); returns them on the device, (B, k)."""
        ids = self._state.tensor([list(tokens)] * self.batch).reshape(self.batch, len(tokens))
        conf, q = (
            known_extras(self._state, ids, confidence, self.want_probs) if self.want_extras else (None, None)
        )
        for i in range(len(tokens)):
            self.tokens.append(ids[:, i])
            if conf is not None:
                self.confs.append(conf[:, i])
            if self.want_conf:
                self.read_top1.append(float(confidence))
            if q is not None:
                self.probs.append(q[:, i])
        return ids

    def add(
        self, logits: torch.Tensor, head: DraftHead | None = None, picked: Picked | None = None
    ) -> tuple[torch.Tensor, DraftConfidence | None]:
        """Choose the next draft token from ``logits`` (B, V), or (B, K) over ``head.ids`` when the
        forward ran a reduced draft head (pass its ``ForwardOutput.head``).

        With a head the draft distribution is q over the head's K tokens (zero elsewhere): the
        sampler warps the logits with ``-inf`` outside the head, greedy takes the argmax among the
        K tokens, and confidences are top-1 probabilities renormalised over them.

        Args:
            logits: the last row's logits.
            head: the reduced draft head they come from, or ``None``.
            picked: what the forward already chose from them (``ForwardOutput.picked``, asked for
                with `pick`: inside it, in vocabulary ids whatever the head); ``None``: chosen
                here, by the same rule (`framework.types.pick_tokens`).

        Returns:
            ``(token (B,), confidence)``: the confidence is the top-1 draft probability of batch
            row 0, a `DraftConfidence` that also gives the drafted token's unwarped probability
            (``None`` unless the length controller asked for confidences: ``need_confidence``).
        """
        if self.sampler is not None:  # sampling: the same warping as the verifier's target
            full = logits if head is None else head.expand(logits)  # q is 0 outside the head
            out = self._state.compute(sampled_step, full, rule=self.sampler, top_k=self.top_k)
            tok, p, top_p = out["tokens"], out["q"], out["top_p"]  # p: the warped draft q (B, V)
            if self.want_probs:
                self.probs.append(p)  # over the vocabulary already
            if self.top_k:
                self.top_tokens.append(out["top_tokens"])
                self.top_probs.append(out["top_probs"])
        else:
            if picked is None:  # in vocabulary ids, through the head's ids with one
                picked = pick_tokens(logits, self.pick, head)
            tok = picked.tokens
            if not self.want_extras:
                self.tokens.append(tok)
                return tok, None
            top_p = picked.top_p
            if self.want_probs:
                self.probs.append(picked.probs)
            if self.top_k:
                self.top_tokens.append(picked.top_tokens)
                self.top_probs.append(picked.top_probs)
        self.confs.append(top_p)
        self.tokens.append(tok)
        if not self.want_conf:
            return tok, None
        self.read_top1.append(float(top_p[0]))  # the stop rule's read
        if self.sampler is not None:
            return tok, DraftConfidence(self.read_top1[-1], full[0], tok[0])
        return tok, DraftConfidence(self.read_top1[-1])  # greedy: the drafted token is the argmax

    def drop_last(self, conf: float | None = None) -> None:
        """Forget the last token (a drafter that breaks before appending, as DEL does).

        ``conf``: the confidence the stop decision read (`add`'s). Dropping a *sampled* token
        because of its own probability (a stop rule that read `DraftConfidence.sampled`) would leave
        the kept tokens distributed as q restricted to the likely ones, not as q, and speculative
        sampling would no longer sample the target's distribution: that raises ValueError.
        """
        if self.sampler is not None and getattr(conf, "read_sampled", False):
            raise ValueError(
                "on_stop='drop' with a stop rule that reads the drafted token's own probability "
                "(stop_on='sampled') biases speculative sampling; use on_stop='keep' or stop_on='top1'"
            )
        n = len(self.tokens)
        for lst in (self.tokens, self.confs, self.probs, self.top_tokens, self.top_probs, self.read_top1):
            if len(lst) == n and lst:
                lst.pop()

    def build(self, plan: LayerPlan) -> Draft:
        """The `Draft` of the tokens collected (possibly none)."""

        def stack(xs: list[torch.Tensor]) -> torch.Tensor | None:
            if len(xs) == 1:  # one step: a view, no copy
                return xs[0].unsqueeze(1)
            return torch.stack(xs, dim=1) if xs else None

        tokens = stack(self.tokens)
        if tokens is None:
            tokens = torch.empty(self.batch, 0, dtype=torch.long, device=self.device)
        chain = len(self.top_tokens) != len(self.tokens)  # tokens known without a forward: no top-k
        draft = Draft(
            tokens=tokens,
            plan=plan,
            confidences=stack(self.confs),
            probs=stack(self.probs),
            top_tokens=None if chain else stack(self.top_tokens),
            top_probs=None if chain else stack(self.top_probs),
        )
        if draft.confidences is not None and len(self.read_top1) == len(self.tokens):
            # row 0 as the stop rule read it, known for the round: no strategy reads it again
            self._state.host_values.remember(draft.confidences[0], self.read_top1)
        return draft


def known_extras(
    state: DecodeState, ids: torch.Tensor, confidence: float, probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The extras of tokens known without a forward, ``ids`` (B, k): each one's ``confidence``
    (B, k) and, with ``probs``, its one-hot draft distribution (B, k, V), float32 as the draft
    sampler's q (for which speculative sampling is still exact)."""
    conf = torch.full(ids.shape, float(confidence), device=state.device)
    if not probs:
        return conf, None
    q = torch.zeros(*ids.shape, state.info.vocab_size, device=state.device)
    return conf, q.scatter_(-1, ids[..., None], 1.0)


def copied_draft(
    state: DecodeState,
    tokens: Sequence[int],
    plan: LayerPlan,
    confidence: float,
    steps: DraftSteps | None = None,
) -> Draft:
    """A draft of ``tokens`` copied from the context (no forward: ``Draft.source`` is ``"lookup"``),
    with the extras the strategies asked for: each token's confidence is ``confidence``, its draft
    distribution the one-hot q (for which speculative sampling is still exact). No top-k
    candidates: the draft is a chain. After the tokens the round's ``steps`` forced before any
    draft step (`DraftSteps.force`), which stay there for a draft step of the same round."""
    batch, k = state.pending.shape[0], len(tokens)
    ids = state.tensor([list(tokens)] * batch).reshape(batch, k)
    draft = Draft(tokens=ids, plan=plan, source="lookup")
    if k and (state.need_confidence or state.need_draft_probs or state.draft_top_k > 0):
        draft.confidences, draft.probs = known_extras(state, ids, confidence, state.need_draft_probs)
        state.host_values.remember(draft.confidences[0], [float(confidence)] * k)
    if steps is None or steps.stepped or not len(steps):
        return draft
    lead = steps.build(plan)
    if not k:
        return lead
    cat = lambda a, b: None if a is None or b is None else torch.cat([a, b.to(a.dtype)], dim=1)  # noqa: E731
    return Draft(
        torch.cat([lead.tokens, ids], dim=1),
        plan,
        cat(lead.confidences, draft.confidences),
        cat(lead.probs, draft.probs),
        source="lookup",
    )
