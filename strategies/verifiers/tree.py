"""``tree``: SWIFT's dynamic verification: confidence-banded top-k alternatives in one tree pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from framework import DeviceOps, Draft, Verification, Verifier, VerifyView, register_verifier
from framework.config_fields import ConfigError, check_range, param


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
    tokens, counts = [], []
    for j, d in enumerate(chain):
        alts = [t for t in top_tokens[j] if t != d][: max(0, widths[j] - 1)]
        tokens += [d, *alts]
        counts.append(1 + len(alts))
    parents, depths = tree_shape(counts)
    return tokens, parents, depths


def tree_shape(widths: list[int]) -> tuple[list[int], list[int]]:
    """``(parents, depths)`` of `build_tree`'s nodes for a chain whose depth j is widened to
    ``widths[j]`` candidates: the tree's shape depends on the widths only, not on the tokens."""
    parents, depths = [], []
    chain_idx = 0
    for j, w in enumerate(widths):
        first = len(parents) + 1
        parents += [chain_idx] * w
        depths += [j + 1] * w
        chain_idx = first
    return parents, depths


def tree_nodes(
    chain: torch.Tensor, top_tokens: torch.Tensor, widths: list[int], picks: torch.Tensor
) -> torch.Tensor:
    """`build_tree`'s node tokens, computed on the device without reading the draft: (T - 1,).

    Args:
        chain: LongTensor (K,), the draft tokens d_1..d_K.
        top_tokens: LongTensor (K, W), each depth's candidates in descending probability,
            ``W >= max(widths)``.
        widths: per depth, the candidates verified (the chain token included).
        picks: `node_picks` ``(widths, W)`` on the device.
    """
    k, w = top_tokens.shape
    if max(widths) > w:
        raise ValueError(f"widths {widths} need {max(widths)} candidates per depth; the draft has {w}")
    # Each depth's candidates other than its chain token, in order (a stable sort puts the chain
    # token, if present, last), then the chain token and the first widths[j] - 1 of them.
    is_chain = top_tokens == chain[:, None]
    alts = top_tokens.gather(1, torch.sort(is_chain, dim=1, stable=True).indices)
    flat = torch.cat([chain[:, None], alts], dim=1).reshape(-1)  # depth j: row j of (K, W + 1)
    return flat[picks]


def node_picks(widths: list[int], w: int) -> list[int]:
    """Where `tree_nodes` takes each node from: row j of the (K, W + 1) table of depth j's chain
    token and its other candidates, the first ``widths[j]`` entries."""
    return [j * (w + 1) + i for j, width in enumerate(widths) for i in range(width)]


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

    def widths(self, top1: Sequence[float]) -> list[int]:
        """Candidates per depth from the draft's top-1 probabilities (band i: p <= edges[i])."""
        edges, widths = self.config.band_edges, self.config.band_widths
        return [widths[sum(p > e for e in edges)] for p in top1]

    def verify(self, state: VerifyView, draft: Draft) -> Verification:
        if draft.tokens.shape[0] != 1:
            raise NotImplementedError("tree verification supports batch size 1")
        device = state.device
        if draft.length == 0:
            out = state.forward_verify(state.pending, logits_at="all", rule=target_rule)
            target = out.ruled["target"]
            return Verification(
                num_accepted=torch.zeros(1, dtype=torch.long, device=device),
                new_tokens=target[:, :1],
                target_tokens=target,
                hidden_states=out.hidden_states,
            )
        k = draft.length
        if draft.top_tokens is not None and draft.top_probs is not None:
            w = draft.top_tokens.shape[-1]  # a reduced draft head may offer fewer candidates
            conf = draft.confidences if draft.confidences is not None else draft.top_probs[..., 0]
            # what a stop rule read already is read again for free
            widths = [min(x, w) for x in self.widths(state.read(top1=conf[0])["top1"])]
            nodes = tree_nodes(
                draft.tokens[0],
                draft.top_tokens[0],
                widths,
                state.constant(node_picks(widths, w), key=("tree picks", tuple(widths), w)),
            )  # on the device
        else:
            widths, nodes = [1] * k, draft.tokens[0]  # a chain: a drafter without candidates
        parents, depths = tree_shape(widths)
        block = torch.cat([state.pending, nodes[None].to(state.pending.dtype)], dim=1)  # (1, T)
        depths_t = state.constant([0, *depths], key=("tree depths", tuple(widths)))
        pos = (depths_t + state.pending_position)[None]  # (1, T)
        mask = state.constant(lambda: tree_mask(parents), torch.bool, key=("tree mask", tuple(widths)))
        out = state.forward_verify(block, logits_at="all", position_ids=pos, tree_mask=mask, rule=target_rule)
        target = out.ruled["target"]  # (1, T): each node's target choice, inside the forward
        # The round's one device-to-host read: the target's choices and the node tokens together.
        got = state.read(target=target[0], nodes=nodes)
        want, tokens = got["target"], got["nodes"]

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
        # m, the committed tokens and the kept offsets in one copy (views of it), which the
        # engine knows on the host: the commit reads nothing
        up = state.tensor([m, *(tokens[i - 1] for i in path[1:]), want[node], *path])
        return Verification(
            num_accepted=up[:1],
            new_tokens=up[1 : m + 2][None],  # (1, m+1)
            kv_keep=up[m + 2 :],
            target_tokens=target,
            hidden_states=out.hidden_states,
        )


def target_rule(ops: DeviceOps, ids: torch.Tensor, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tree verifier's acceptance rule on the device (`framework.types.AcceptanceRule`): the
    target's choice after every node (B, T). The walk down the tree, which needs the tree's shape,
    runs on the host after the round's one read (`TreeVerifier.verify`)."""
    return {"target": logits.argmax(dim=-1)}
