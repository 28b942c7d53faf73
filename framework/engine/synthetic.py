"""Synthetic acceptance: the verifier accepts at a forced rate, to measure the system apart from
the draft's quality (issue 47, item 5).

Serving engines (vLLM, SGLang, TensorRT-LLM) have such a mode: a draft token is accepted with
probability P from a seeded stream, whatever the target says, so that what a round costs at a given
acceptance can be measured and set against the cost model's prediction. Everything a real round
does still runs (the drafts, the verify forward, the strategies' observations); only the number of
accepted tokens is overridden, after the verifier: the first ``m`` draft tokens are committed,
where ``m`` counts the leading draws below P, followed by the target's own token after them (its
choice at row ``m`` of the verified block). The KV cache stays consistent: the verify forward wrote
the block's KV, and the commit keeps its first ``m + 1`` positions, as for any chain.

**The output is not the model's.** Every generation that ran with it says so
(`GenerationResult.synthetic`); records carry ``synthetic_acceptance``, method labels the mark
``@synthetic-P``, reports a line saying it; equality checks against plain decoding are refused
(``lossless`` is ``None``), and Spec-Bench answer files are not written.

A round with ``m`` beyond the verifier's own acceptance reads the target's token at row ``m``
from the device (one read that round); token trees are refused (their commit is not a chain).
"""

from __future__ import annotations

import torch

from framework.types import Draft, Verification

#: The mark of a synthetic method's label, e.g. ``static_confidence@synthetic-0.5``.
MARK = "@synthetic-"


def synthetic_label(label: str, p: float) -> str:
    """``label`` marked as synthetic at acceptance ``p`` (once)."""
    return label if MARK in label else f"{label}{MARK}{p:g}"


class SyntheticAcceptance:
    """Accept each draft token with probability ``p`` from a seeded stream.

    Args:
        p: the acceptance probability, in [0, 1].
        seed: the stream's seed (the same seed, the same acceptances, generation after generation
            of one decoder).
    """

    def __init__(self, p: float, seed: int = 0) -> None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"synthetic acceptance must be a probability in [0, 1], got {p!r}")
        self.p = float(p)
        self.generator = torch.Generator().manual_seed(int(seed))

    def accepted(self, k: int) -> int:
        """How many of ``k`` draft tokens this round accepts: the leading draws below ``p``."""
        draws = torch.rand(k, generator=self.generator).tolist()
        m = 0
        while m < k and draws[m] < self.p:
            m += 1
        return m

    def apply(self, draft: Draft, result: Verification) -> Verification:
        """The verifier's ``result`` with the synthetic number of accepted tokens.

        Raises:
            ValueError: a verification that is not a chain (a token tree), or one without the
                target's tokens.
        """
        k = draft.length
        if k == 0:
            return result
        if result.kv_keep is not None:
            raise ValueError(
                "synthetic acceptance needs a chain verifier (greedy or sampling), not a token tree"
            )
        if result.target_tokens is None:
            raise ValueError(
                "synthetic acceptance needs the verifier's target tokens (Verification.target_tokens)"
            )
        m = self.accepted(k)
        real = result.accepted  # the verifier's own m (the committed tokens' count, less one)
        if m == real:
            return result
        if m < real:  # a prefix of the real commit: draft tokens, then the next one (a view)
            new = result.new_tokens[:, : m + 1]
        else:  # draft tokens the target refused, then the target's token after them (read at the commit)
            new = torch.cat([draft.tokens[:, :m], result.target_tokens[:, m : m + 1]], dim=1)
        return Verification(
            num_accepted=torch.full_like(result.num_accepted, m),
            new_tokens=new,
            target_tokens=result.target_tokens,
            hidden_states=result.hidden_states,
        )
