"""Shared step-by-step bookkeeping of drafters: pick each draft token and keep what was asked for.

A drafter's loop is its own (which forward, when to stop); what every drafter does the same way
after each forward lives in `DraftBuilder`: choose the token as the verifier wants it (the warped
sample of ``state.draft_sampler``, else the argmax) and keep only the extras some strategy
declared it needs (top-1 confidences, full distributions, top-k candidates).

Drafters that copy tokens from the context instead of running the model (prompt lookup) share
`NgramIndex` (the incremental n-gram search, kept by the drafter and brought up to date with the
committed tokens by `NgramIndex.follow`) and `copy_draft` (a copied draft with the extras the strategies asked for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from framework.interfaces import LengthController
from framework.types import Draft, LayerPlan, Picked, TokenPick, pick_tokens
from framework.utils import upload
from framework.view import DeviceOps, RoundView

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead


class DraftConfidence(float):
    """The confidence `DraftBuilder.add` reports: a float, the top-1 draft probability (what
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


class DraftBuilder:
    """Collects one round's draft tokens.

    Args:
        state: the `DecodeState`; its flags (``need_confidence``, ``need_draft_probs``,
            ``draft_top_k``, ``draft_sampler``) decide what is computed.
    """

    def __init__(self, state: RoundView) -> None:
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
        self.host_top1: list[float] = []  # what the stop rule read, step by step

    def __len__(self) -> int:
        return len(self.tokens)

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
        self.host_top1.append(float(top_p[0]))  # the stop rule's read
        if self.sampler is not None:
            return tok, DraftConfidence(self.host_top1[-1], full[0], tok[0])
        return tok, DraftConfidence(self.host_top1[-1])  # greedy: the drafted token is the argmax

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
        for lst in (self.tokens, self.confs, self.probs, self.top_tokens, self.top_probs, self.host_top1):
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
        return Draft(
            tokens=tokens,
            plan=plan,
            confidences=stack(self.confs),
            probs=stack(self.probs),
            top_tokens=stack(self.top_tokens),
            top_probs=stack(self.top_probs),
            host_top1=tuple(self.host_top1) if len(self.host_top1) == len(self.tokens) else None,
        )


# --------------------------------------------------------------------------------------------
# Drafting by copying from the context (prompt lookup): no forward at all
# --------------------------------------------------------------------------------------------


class NgramIndex:
    """The most recent earlier occurrence of every short n-gram of a growing token sequence.

    Maps each n-gram (``min_n <= n <= max_n``) to the position of its last token in its most recent
    occurrence that ends *before* the sequence's last token (so the n-gram that ends at the last
    token, the query, never matches itself). Appending t tokens costs ``t * (max_n - min_n + 1)``
    dict insertions and a `match` at most ``max_n - min_n + 1`` dict probes: the cost per round does
    not grow with the context.

    Args:
        min_n: shortest n-gram indexed (>= 1).
        max_n: longest n-gram indexed (>= min_n).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramIndex needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens; the n-grams that now end before the last token become matchable."""
        seq = self.tokens
        start = len(seq)
        seq.extend(int(t) for t in tokens)
        last = self._last
        # Ends start-1 .. len-2: the previous last token's n-grams were held back as the query's.
        for end in range(max(start - 1, 0), len(seq) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                last[tuple(seq[end - n + 1 : end + 1])] = end

    def match(self) -> tuple[int, int]:
        """The longest n-gram ending at the last token that occurred earlier.

        Returns:
            ``(n, end)``: its length and the position of the last token of its most recent earlier
            occurrence, or ``(0, -1)`` when no n-gram of ``min_n`` tokens or more recurs.
        """
        seq = self.tokens
        size = len(seq)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = self._last.get(tuple(seq[size - n :]))
            if end is not None:
                return n, end
        return 0, -1

    def continuation(self, end: int, k: int) -> list[int]:
        """The k tokens that followed position ``end``.

        Past the sequence's last token the copy continues from its own output (an overlapping copy,
        as in LZ77): an occurrence d tokens back proposes the last d tokens repeated periodically.
        """
        seq = self.tokens
        size = len(seq)
        out: list[int] = []
        for i in range(k):
            j = end + 1 + i
            out.append(seq[j] if j < size else out[j - size])
        return out

    def follow(self, tokens: Sequence[int]) -> NgramIndex:
        """Bring the index up to date with ``tokens``, the sequence it indexes so far plus what was
        committed since (each round indexes only its new tokens); a sequence that is not a
        continuation of the indexed one (another generation) is indexed afresh. Returns ``self``."""
        have = len(self.tokens)
        if have > len(tokens) or (have and tokens[have - 1] != self.tokens[-1]):
            self.tokens, self._last, have = [], {}, 0  # the tokens were replaced: rebuild
        if len(tokens) > have:
            self.extend(tokens[have:])
        return self

    def lookup(self, k: int) -> tuple[int, list[int]]:
        """``(n, the k tokens after the match)`` for the longest match, or ``(0, [])``."""
        n, end = self.match()
        return (n, self.continuation(end, k)) if n else (0, [])


def copy_draft(
    state: RoundView,
    candidates: Sequence[int],
    plan: LayerPlan,
    length: LengthController,
    max_tokens: int,
    confidence: float,
) -> Draft:
    """A draft of tokens copied from the context (no forward), stopped as the length controller says.

    Each copied token is reported with the fixed ``confidence`` (to ``length.should_continue`` and,
    when some strategy asked for confidences, in ``Draft.confidences``). The draft distribution of
    a copied token is deterministic: when the verifier needs draft probabilities (speculative
    sampling) ``Draft.probs`` is the one-hot q of each token, for which speculative sampling is
    still exact (accept with probability p(d), else resample from p without d). No top-k
    candidates are kept: the draft is a chain, which tree verification verifies as such.
    ``Draft.source`` is ``"lookup"``: no forward ran for it.

    Args:
        state: the `DecodeState`.
        candidates: the tokens to propose, in order (at most ``max_tokens`` are used).
        plan: recorded as ``Draft.plan``.
        length: asked after each token whether to continue.
        max_tokens: the round's cap.
        confidence: the confidence of every copied token, in [0, 1].
    """
    toks: list[int] = []
    for tok in candidates[:max_tokens]:
        toks.append(int(tok))
        if len(toks) >= max_tokens or not length.should_continue(len(toks), confidence):
            break
    batch, k = state.pending.shape[0], len(toks)
    tokens = upload([toks] * batch, state.device, torch.long).reshape(batch, k)  # no device wait
    draft = Draft(tokens=tokens, plan=plan, source="lookup")  # no forward ran
    if k and (state.need_confidence or state.need_draft_probs or state.draft_top_k > 0):
        draft.confidences = torch.full((batch, k), float(confidence), device=state.device)
    if k and state.need_draft_probs:  # q = one-hot: (B, K, V), float32 as the draft sampler's
        draft.probs = torch.zeros(batch, k, state.info.vocab_size, device=state.device).scatter_(
            -1, tokens[..., None], 1.0
        )
    return draft
