"""What drafters that copy tokens from the context instead of running the model share (prompt
lookup): `NgramIndex`, the incremental n-gram search (kept by the drafter, brought up to date
with the committed tokens by `NgramIndex.follow`), and `copy_draft`, a copied draft stopped as
the length controller says, with the extras the other strategies asked for
(``state.copied_draft``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from framework.interfaces import LengthController
from framework.types import Draft, LayerPlan
from framework.view import DraftView

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
    state: DraftView,
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
    return state.copied_draft(toks, plan, confidence)
