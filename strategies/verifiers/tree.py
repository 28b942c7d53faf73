"""``tree``: SWIFT's dynamic verification: confidence-banded top-k alternatives in one tree pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework import Draft, ForwardSizes, RoundView, Verification, Verifier, register_verifier
from framework.config_fields import ConfigError, check_range, param
from framework.utils import upload


@dataclass(frozen=True)
class TreeVerifierConfig:
    band_edges: tuple[float, ...] = param(
        (0.5, 0.8, 0.95),
        help="draft-confidence band edges, increasing in (0, 1); a step whose top-1 probability p falls "
        "in band i is widened to band_widths[i] candidates",
    )
    band_widths: tuple[int, ...] = param(
        (10, 5, 3, 1),
        help="candidates per draft step for each band, one more entry than band_edges, each in [1, 64]. "
        "SWIFT's paper: 10,5,3,1; its released greedy code: 10,8,5,3",
    )
    temperature: float = param(
        0.0,
        help="must be 0: tree verification is greedy here (multi-candidate rejection sampling over a "
        "tree is not implemented); use --verifier sampling for lossless chain sampling",
    )

    def __post_init__(self) -> None:
        if self.temperature != 0.0:
            raise ConfigError(
                "temperature",
                self.temperature,
                "0 (tree verification is greedy only; for sampling use --verifier sampling, which is "
                "lossless in distribution)",
            )
        edges, widths = self.band_edges, self.band_widths
        if not edges or any(not 0.0 < e < 1.0 for e in edges) or list(edges) != sorted(set(edges)):
            raise ConfigError("band_edges", edges, "strictly increasing values in (0, 1)")
        if len(widths) != len(edges) + 1:
            raise ConfigError("band_widths", widths, f"{len(edges) + 1} widths (one more than band_edges)")
        for w in widths:
            check_range("band_widths", w, 1, 64, integer=True)


def build_tree(
    chain: list[int], top_tokens: list[list[int]], widths: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """Nodes of SWIFT's tree, linearised root first, then depth by depth.

    The top-1 chain continues; the alternatives of depth j hang off chain node j-1 as leaves.

    Args:
        chain: the K draft tokens d_1..d_K (the chain).
        top_tokens: per depth, the draft's candidates in descending probability.
        widths: per depth, how many candidates to verify (the chain token included).

    Returns:
        ``(tokens, parents, depths)`` of the T - 1 non-root nodes, linearised; parent indices refer to
        the linear order with the root at 0 (so node i of the lists is tree node i + 1).
    """
    tokens, parents, depths = [], [], []
    chain_idx = 0  # linear index of the previous chain node (the root at depth 0)
    for j, d in enumerate(chain):
        alts = [t for t in top_tokens[j] if t != d][: max(0, widths[j] - 1)]
        first = len(tokens) + 1  # linear index of this depth's chain node
        for t in [d, *alts]:
            tokens.append(t)
            parents.append(chain_idx)
            depths.append(j + 1)
        chain_idx = first
    return tokens, parents, depths


def tree_mask(parents: list[int]) -> torch.Tensor:
    """BoolTensor (T, T): each node sees itself, the root and its ancestors."""
    t = len(parents) + 1
    rows = [[j == 0 for j in range(t)]]  # built on the host in Python: one tensor operation
    for i, p in enumerate(parents, start=1):
        row = list(rows[p])
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


@register_verifier("tree", config=TreeVerifierConfig)
class TreeVerifier(Verifier):
    """Verify a confidence-banded top-k token tree around the draft chain in one forward pass.

    SWIFT's dynamic verification (Xia et al., ICLR 2025, §4.2, Fig. 5b): each draft step with
    top-1 probability p is widened to k(p) candidates by confidence band; alternatives hang off the
    greedy chain as leaves; the tree is linearised and verified in one full forward with a tree
    attention mask; the longest path whose every token equals the target's argmax at its parent is
    committed with the target's next token, and the KV of that path is gathered into place. Greedy:
    lossless token for token. The drafted count is the chain length (alternatives not counted), as
    in SWIFT's code.
    """

    def draft_top_k(self) -> int:
        return max(self.config.band_widths)

    def widths(self, draft: Draft, top1: list[float] | None = None) -> list[int]:
        """Candidates per depth from the draft's top-1 probabilities (band i: p <= edges[i]);
        ``top1``: those probabilities already read to the host (else read here).

        A draft without candidates (a drafter that ignores ``draft_top_k()``) is a chain: width 1.
        """
        if draft.top_probs is None:
            return [1] * draft.length
        edges, widths = self.config.band_edges, self.config.band_widths
        if top1 is None:
            top1 = draft.top_probs[0, :, 0].tolist()
        return [widths[sum(p > e for e in edges)] for p in top1]

    def forward_sizes(self, max_draft: int) -> ForwardSizes:
        """``pending`` alone (a round without drafts), and trees of up to ``max_draft`` depths of
        the widest band each."""
        return ForwardSizes.of(chain=(1,), tree=range(2, 2 + max_draft * max(self.config.band_widths)))

    def verify(self, state: RoundView, draft: Draft) -> Verification:
        if draft.tokens.shape[0] != 1:
            raise NotImplementedError("tree verification supports batch size 1")
        device = state.device
        if draft.length == 0:
            out = state.forward_verify(state.pending, logits_at="all")
            target = out.logits.argmax(dim=-1)
            return Verification(
                num_accepted=torch.zeros(1, dtype=torch.long, device=device),
                new_tokens=target[:, :1],
                target_tokens=target,
                hidden_states=out.hidden_states,
            )
        k = draft.length
        top1 = None
        if draft.top_tokens is not None and draft.top_probs is not None:
            # chain, candidates and their bands' probabilities in one device-to-host read (token
            # ids are exact in float64)
            w = draft.top_tokens.shape[-1]
            parts = [draft.tokens[0], draft.top_tokens[0].reshape(-1), draft.top_probs[0, :, 0]]
            flat = torch.cat([p.double() for p in parts]).tolist()
            chain = [int(t) for t in flat[:k]]
            top = [[int(t) for t in flat[k + i * w : k + (i + 1) * w]] for i in range(k)]
            top1 = flat[k + k * w :]
        else:
            chain = draft.tokens[0].tolist()
            top = draft.top_tokens[0].tolist() if draft.top_tokens is not None else [[t] for t in chain]
        tokens, parents, depths = build_tree(chain, top, self.widths(draft, top1))
        c = state.pending_position
        nodes = upload([tokens], device, state.pending.dtype)  # host values: no device wait
        block = torch.cat([state.pending, nodes], dim=1)  # (1, T)
        pos = upload([[c, *(c + d for d in depths)]], device)  # (1, T)
        out = state.forward_verify(block, logits_at="all", position_ids=pos, tree_mask=tree_mask(parents))
        target = out.logits.argmax(dim=-1)  # (1, T)
        want = target[0].tolist()

        # Walk down: at each depth the target's choice after the current node must be a child.
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents, start=1):
            children.setdefault(p, []).append(i)
        path, node = [0], 0
        while True:
            nxt = next((i for i in children.get(node, ()) if tokens[i - 1] == want[node]), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        m = len(path) - 1
        host = (*(tokens[i - 1] for i in path[1:]), want[node])
        return Verification(
            num_accepted=upload([m], device),
            new_tokens=upload([host], device),  # (1, m+1)
            kv_keep=upload(path, device),
            target_tokens=target,
            hidden_states=out.hidden_states,
            host_tokens=host,
        )
