"""``sampling``: speculative sampling, lossless in distribution (the output is distributed as sampling)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from framework import (
    DeviceOps,
    Draft,
    RandomStream,
    Verification,
    Verifier,
    VerifyView,
    register_verifier,
)
from framework.config_fields import ConfigError, check_range, param

#: A residual ``max(0, p - q)`` with less total mass than this is treated as empty (p == q up to
#: rounding, where a rejection has probability ~0): the replacement is then sampled from p.
RESIDUAL_EPS = 1e-12


@dataclass(frozen=True)
class SamplingVerifierConfig:
    temperature: float = param(1.0, help="softmax temperature applied to draft and target logits; > 0")
    top_k: int = param(0, help="keep only the k most likely tokens before sampling; 0 = off; >= 0")
    top_p: float = param(
        1.0, help="nucleus sampling: keep the smallest set of tokens with mass >= top_p; 1.0 = off; in (0, 1]"
    )
    seed: int = param(0, help="seed of the verifier's random generator (one stream per run)")

    def __post_init__(self) -> None:
        check_range("temperature", self.temperature, 0.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ConfigError("top_k", self.top_k, "an integer >= 0 (0 = off)")
        check_range("top_k", self.top_k, 0)
        check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("seed", self.seed, "an integer")


def warp(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution: temperature, then top-k, then top-p, renormalised.

    Args:
        logits: FloatTensor (..., V).
        temperature: divides the logits (> 0).
        top_k: keep the ``top_k`` largest logits (ties at the k-th value are all kept); 0 = off.
        top_p: keep the most likely tokens until their mass reaches ``top_p`` (the token that
            crosses it included, so at least one token survives); 1.0 = off.

    Returns:
        FloatTensor (..., V) of probabilities summing to 1 (float32 at least; float64 logits stay
        float64).
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:  # x / 1.0 is x: no operation for it
        x = x / temperature
    v = x.shape[-1]
    if 0 < top_k < v:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the mass strictly before it already reaches top_p.
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` (B, V) -> LongTensor (B,); zero-probability tokens never come.

    ``torch.multinomial(probs, 1)``, token for token and draw for draw: its own rule for one
    sample is the argmax of ``probs / noise`` with Exp(1) noise (`sample_with_noise`), which is
    drawn here first, so that the rule itself can run where no generator is (inside the engine).
    """
    return sample_with_noise(probs, torch.empty_like(probs).exponential_(1, generator=generator))


def sample_with_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`sample` given its noise: ``argmax(probs / noise)`` over the last dimension, ``noise``
    (B, V) Exp(1) draws (the exponential race: exact for any non-negative weights)."""
    return (probs / noise).argmax(dim=-1)


def accept_with_noise(
    draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, u: torch.Tensor | None, e: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling acceptance rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023),
    given its draws: no generator, no host read (a static function of device tensors).

    Draft token ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, in order
    (``u_j * q_j(d_j) < p_j(d_j)``); at the first rejection the replacement is sampled from
    ``norm(max(0, p_j - q_j))`` (from ``p_j`` if that residual is numerically empty) and drafting
    stops; if all K are accepted the bonus token is sampled from ``p_{K+1}``; the token is the
    exponential race over ``e`` (`sample_with_noise`).

    Args:
        draft_tokens: LongTensor (B, K), K >= 0 (-1: a token the verify forward's rows did not see).
        q: FloatTensor (B, K, V), the (warped) draft distributions the tokens were sampled from.
        p: FloatTensor (B, K+1, V), the (warped) target distributions after each verified input.
        u: the K acceptance uniforms (B, K) (``None`` when K = 0), drawn first.
        e: the Exp(1) noise (B, V) of the token, drawn after ``u``.

    Returns:
        ``(num_accepted (B,), next_token (B,))``: m per row and the correction or bonus token.
    """
    b, k = draft_tokens.shape
    if not k:
        return torch.zeros(b, dtype=torch.long, device=p.device), sample_with_noise(p[:, 0], e)
    assert u is not None
    q = q.to(p.dtype)
    rows = torch.arange(b, device=p.device)
    seen = draft_tokens >= 0  # -1: a token the verify forward's rows did not see (AcceptanceRule)
    idx = draft_tokens.clamp_min(0)[..., None]
    p_d = p[:, :k].gather(-1, idx).squeeze(-1)  # (B, K)
    q_d = q.gather(-1, idx).squeeze(-1)
    # u < min(1, p/q) is u * q < p for u in [0, 1): no division, and q(d) = 0 (which cannot happen
    # for a token sampled from q) accepts iff p(d) > 0
    m = (torch.lt(u * q_d, p_d) & seen).cumprod(dim=1).sum(dim=1)  # (B,): accepted before the first rejection
    p_m = p[rows, m]  # (B, V): p_{m+1}, the bonus distribution when m == K
    q_m = q[rows, m.clamp(max=k - 1)]
    residual = (p_m - q_m).clamp_min(0)  # the exponential race takes weights: no normalising
    use_residual = (m < k) & (residual.sum(dim=-1) > RESIDUAL_EPS)  # rejected, and p != q there
    return m, sample_with_noise(torch.where(use_residual[:, None], residual, p_m), e)


@register_verifier("sampling", config=SamplingVerifierConfig)
class SamplingVerifier(Verifier):
    """Speculative sampling: the committed tokens are distributed exactly as sampling from the target.

    Speculative sampling (Leviathan et al., ICML 2023; Chen et al., 2023), used for self-speculative
    decoding in Draft & Verify (Zhang et al., ACL 2024, Alg. 4).

    One warping (temperature, then top-k, then top-p, renormalised; `warp`) is applied to the
    draft logits (through `draft_sampler`, so drafters sample from q and keep it in
    ``Draft.probs``), to the target logits in `verify` and in `choose` (prefill, declined rounds
    and the vanilla baseline), so speculative and vanilla sampling target the same distribution.
    `verify` runs one full forward over ``[pending, d_1..d_K]`` and applies `accept_with_noise`.

    Randomness: one stream (`random`, a generator per device seeded from ``config.seed`` when
    first used and never re-seeded: ``reset`` keeps it), so successive generations differ but a
    run (same seed, same calls) is reproducible. Draft sampling and acceptance draw from it inside
    their rules (``ops``, the engine's handle on it: `sample_draft`, `accept_rule`), vanilla
    sampling in `choose`: the same draws in the same order, however the engine runs the rules.
    """

    needs_draft_probs = True
    lossless = "distribution"

    def __init__(self, config: SamplingVerifierConfig | None = None) -> None:
        super().__init__(config)
        self.random = RandomStream(self.config.seed)

    def generator(self, device: torch.device | str) -> torch.Generator:
        """The verifier's random stream on ``device`` (`random`'s generator there)."""
        return self.random.generator(device)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The configured warping of ``logits`` (..., V) into probabilities (see `warp`)."""
        c = self.config
        return warp(logits, c.temperature, c.top_k, c.top_p)

    def draft_sampler(self) -> functools.partial:
        """Warp the draft logits as the target's and sample from q (`sample_draft`, with this
        verifier's warping)."""
        c = self.config
        return functools.partial(sample_draft, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.warp(logits)
        return sample(p, self.generator(p.device))

    def verify(self, state: VerifyView, draft: Draft) -> Verification:
        k = draft.length
        if k and draft.probs is None:
            raise ValueError(
                "the sampling verifier needs the draft distributions q (Draft.probs, B x K x V): the "
                "drafter must sample through state.draft_sampler and keep q when state.need_draft_probs "
                "is set (as the layer_skip drafter does)"
            )
        if k and draft.probs.shape[:2] != draft.tokens.shape:
            raise ValueError(
                f"Draft.probs has shape {tuple(draft.probs.shape)}, expected (B, K, V) with (B, K) = "
                f"{tuple(draft.tokens.shape)}"
            )
        block = torch.cat([state.pending, draft.tokens], dim=1)  # (B, K+1)
        c = self.config
        rule = functools.partial(accept_rule, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)
        out = state.forward_verify(block, logits_at="all", rule=rule, rule_inputs=(draft.probs,))
        res = out.ruled
        a = state.read(accepted=res["m"][:1], committed=res["committed"][0])["accepted"][0]  # one read
        return Verification(
            num_accepted=res["m"],
            new_tokens=res["committed"][:, : a + 1],  # (B, m+1): a view of what was read
            target_tokens=res["target"],
            hidden_states=out.hidden_states,
        )


def sample_draft(
    ops: DeviceOps, logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled draft step: q = `warp` of the draft logits (B, V), one token of it per row (the
    exponential race of `sample`, its noise from the generation's stream). Returns ``(tokens (B,),
    q (B, V))``."""
    q = warp(logits, temperature, top_k, top_p)
    return sample_with_noise(q, ops.exponential(*q.shape, dtype=q.dtype)), q


def accept_rule(
    ops: DeviceOps,
    ids: torch.Tensor,
    logits: torch.Tensor,
    q: torch.Tensor | None,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
) -> dict[str, torch.Tensor]:
    """The sampling verification (a verifier's acceptance rule: `framework.types.AcceptanceRule`)
    of the verified block ``ids`` = ``[pending, d_1..d_K]`` (B, K+1), its drafts drawn from ``q``
    (B, K, V), against the target ``logits`` (B, K+1, V): warp them into p, draw the
    rule's random numbers from the engine (``ops.uniform``: the K uniforms, then
    ``ops.exponential``: the token's Exp(1) noise) and apply `accept_with_noise`. Returns m, the
    correction or bonus token ``next``, the target's argmax ``target`` and ``committed`` (B, K+1),
    whose first m+1 tokens are the commit's (d_1..d_m, then ``next``)."""
    p = warp(logits, temperature, top_k, top_p)  # (B, K+1, V)
    tokens = ids[:, 1:]
    b, k = tokens.shape
    u = ops.uniform(b, k, dtype=p.dtype) if k else None
    e = ops.exponential(b, p.shape[-1], dtype=p.dtype)
    m, nxt = accept_with_noise(tokens, p.new_zeros(b, 0, p.shape[-1]) if q is None else q, p, u, e)
    # the commit's tokens first: d_1..d_m, then ``next`` at m (what follows is not committed)
    committed = torch.cat([tokens, nxt[:, None]], dim=1).scatter(1, m[:, None], nxt[:, None])
    return {"m": m, "next": nxt, "target": logits.argmax(dim=-1), "committed": committed}
