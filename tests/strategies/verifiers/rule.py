"""The speculative-sampling rule with its draws made from a generator, for the tests: what the
sampling verifier's rounds compute (the engine draws from the verifier's stream, then runs
`strategies.verifiers.sampling.accept_with_noise` inside the verify forward), as one call that
can be tested without a model (issue 56: test-only twins live with the tests)."""

from __future__ import annotations

import torch

from strategies.verifiers.sampling import accept_with_noise


def acceptance_noise(
    batch: int, k: int, vocab: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The random draws of one `accept_prefix`, in its order: the K acceptance uniforms (B, K)
    (``None`` when K = 0), then the Exp(1) noise (B, V) of the token it samples."""
    u = torch.rand(batch, k, generator=generator, device=device, dtype=dtype) if k else None
    e = torch.empty(batch, vocab, dtype=dtype, device=device).exponential_(1, generator=generator)
    return u, e


def accept_prefix(
    draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling acceptance rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    Draft token ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, in order; at the
    first rejection the replacement is sampled from ``norm(max(0, p_j - q_j))`` (from ``p_j`` if that
    residual is numerically empty) and drafting stops; if all K are accepted the bonus token is
    sampled from ``p_{K+1}``. The K uniforms are drawn at once (equivalent to drawing them one by
    one and stopping at the first rejection), then one token (`acceptance_noise`, then
    `accept_with_noise`), in the order the verifier's rounds draw them.

    Args:
        draft_tokens: LongTensor (B, K), K >= 0.
        q: FloatTensor (B, K, V), the (warped) draft distributions the tokens were sampled from.
        p: FloatTensor (B, K+1, V), the (warped) target distributions after each verified input.
        generator: the random stream (on ``p``'s device).

    Returns:
        ``(num_accepted (B,), next_token (B,))``: m per row and the correction or bonus token.
    """
    b, k = draft_tokens.shape
    u, e = acceptance_noise(b, k, p.shape[-1], p.dtype, p.device, generator)
    return accept_with_noise(draft_tokens, q, p, u, e)
