"""``greedy``: accept the longest draft prefix that matches the target's argmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework import DeviceOps, Draft, Verification, Verifier, VerifyView, register_verifier


@dataclass(frozen=True)
class GreedyVerifierConfig:
    pass


@register_verifier("greedy", config=GreedyVerifierConfig)
class GreedyVerifier(Verifier):
    """Exact-match greedy verification (Leviathan et al. 2023, T = 0): lossless token for token.

    One full forward over ``[pending, d_1..d_K]`` gives the target's choices ``a_0..a_K``; the
    longest prefix with ``d_j == a_{j-1}`` is accepted and ``a_m`` is appended (the correction on a
    mismatch, the bonus token when all K are accepted).
    """

    def verify(self, state: VerifyView, draft: Draft) -> Verification:
        block = torch.cat([state.pending, draft.tokens], dim=1)  # (B, K+1)
        # The target's choices a_0..a_K and m, the longest prefix with d_j == a_{j-1}: the rule
        # runs inside the verify forward (in its one graph on a GPU).
        out = state.forward_verify(block, logits_at="all", rule=greedy_rule)
        target, m = out.ruled["target"], out.ruled["accepted"]  # (B, K+1), (B,)
        # The round's one device-to-host read (with any strategy's reads): m and row 0's target
        # choices. The accepted d_1..d_m equal a_0..a_{m-1}, so the committed tokens are a_0..a_m:
        # a view of the target's.
        k = state.read(accepted=m[:1], target=target[0])["accepted"][0]
        return Verification(
            num_accepted=m,
            new_tokens=target[:, : k + 1],  # (B, m+1); batch size 1 (DecodeState's)
            target_tokens=target,
            hidden_states=out.hidden_states,
        )


def greedy_rule(ops: DeviceOps, ids: torch.Tensor, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The greedy acceptance rule over a verified block ``ids`` = ``[pending, d_1..d_K]`` (B, K+1)
    and its logits at every row (B, K+1, V): ``target`` = the argmax ``a``, ``accepted`` = m, the
    longest prefix with ``d_j == a_{j-1}`` (Leviathan et al. 2023 at T = 0). A token ``-1`` (one
    the forward's rows did not see: `framework.types.AcceptanceRule`) is never an argmax, so it is
    never accepted."""
    target = logits.argmax(dim=-1)
    ok = ids[:, 1:] == target[:, :-1]  # (B, K): d_j == a_{j-1}
    return {"target": target, "accepted": ok.cumprod(dim=1).sum(dim=1)}  # booleans' product: an int
