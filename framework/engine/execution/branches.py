"""CUDA graphs of each block's attention and MLP branch, for short forwards (``--cuda-graphs
--cuda-graph-route branch``, and the forwards the whole-forward route cannot take).

Why: at batch 1 a GPU decoding step is bound by kernel launches, not by the device: an eager
Llama block launches about 40 small kernels, each costing the host a few microseconds, while the
device needs a few tens of microseconds for the whole block. A captured graph replays a branch's
kernels with one launch.

A skip plan decides per sub-layer whether a branch runs, so graphs are recorded per branch (block
``i``'s attention, block ``i``'s MLP), per weights (the model's own, or a draft's low-bit copy:
`framework.kernels.lowbit`), per number of tokens T (1 to ``max_tokens``) and per attention span
(`framework.engine.execution.store.span`), and any plan replays the ones it runs: draft steps,
plain steps, chain and token-tree verifications share them.

How a branch becomes static: its input (the residual), the RoPE cos/sin and the first write slot
live in static buffers (one set per T) that each call fills before the replay; the keys and values
go to the KV pool (`framework.engine.execution.pool`) at slots computed inside the graph; the
mask is computed inside the graph from the same slots (causal, or a token tree's mask copied into
a static (T, T) buffer). The branch itself is the model's own modules, called as the
architecture calls them (no forked modeling code).

Numerics: attending over a span under a mask gives the same function as attending to the used
prefix (masked scores are ``finfo.min``, whose softmax weight is exactly 0), but the reduction runs
over more slots, so results agree to rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from framework.engine.execution.pool import KVPool
from framework.engine.execution.store import UNBOUNDED, GraphStore, span, spans
from framework.kernels.lowbit import active_format
from framework.kernels.protocols import BranchModel


class BranchGraphs:
    """Static branches of every block for forwards of 1 to ``max_tokens`` tokens, replayed from
    ``store``'s graphs on ``pool``.

    Attributes:
        pos: the first write slot of the forward (a device tensor the graphs read).
    """

    def __init__(self, arch: BranchModel, store: GraphStore, pool: KVPool, max_tokens: int) -> None:
        self.arch, self.store, self.pool, self.max_tokens = arch, store, pool, max_tokens
        self.device = arch.device
        with torch.inference_mode(False):
            self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
            self._offsets = torch.arange(max_tokens, device=self.device)
        self._pos_value = -1
        self._x: dict[int, torch.Tensor] = {}  # per T: the static residual input
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per T: RoPE cos/sin
        self._tree: dict[int, torch.Tensor] = {}  # per T: the (T, T) tree mask of a tree forward

    def set_rotary(self, pos_emb: Any) -> None:
        """Copy this forward's RoPE cos/sin into the static buffers of its T (once per forward)."""
        cos, sin = pos_emb
        t = cos.shape[-2]
        bufs = self._rope.get(t)
        if bufs is None or bufs[0].shape != cos.shape:
            with torch.inference_mode(False):
                bufs = self._rope[t] = (
                    torch.zeros(cos.shape, dtype=cos.dtype, device=self.device),
                    torch.zeros(sin.shape, dtype=sin.dtype, device=self.device),
                )
            self.store.drop(k for kind in UNBOUNDED for k in self.store.keys(kind) if k[2] == t)
        bufs[0].copy_(cos)
        bufs[1].copy_(sin)

    def attention(
        self, i: int, hidden: torch.Tensor, slot: int, tree: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Block ``i``'s attention branch output (without the residual) for T tokens written at
        slots ``slot .. slot + T - 1``. Token j attends to every slot before ``slot`` and, among
        the new tokens, to those before it (``tree`` ``None``) or to those ``tree[j]`` allows."""
        if slot != self._pos_value:
            self.pos.fill_(slot)
            self._pos_value = slot
        t = hidden.shape[1]
        s = span(slot + t, self.pool.capacity)
        if tree is None:
            return self._run(("attn", i, t, s), hidden, lambda: self._static_attention(i, t, False, s))
        self.tree_buffer(t).copy_(tree, non_blocking=True)
        return self._run(("tree", i, t, s), hidden, lambda: self._static_attention(i, t, True, s))

    def mlp(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Block ``i``'s MLP branch output (without the residual)."""
        t = hidden.shape[1]
        return self._run(("mlp", i, t, 0), hidden, lambda: self.arch.mlp_branch(i, self._x[t]))

    def tree_buffer(self, t: int) -> torch.Tensor:
        """The static (T, T) tree mask of forwards of T tokens."""
        buf = self._tree.get(t)
        if buf is None:
            with torch.inference_mode(False):
                buf = self._tree[t] = torch.zeros(t, t, dtype=torch.bool, device=self.device)
        return buf

    def _static_attention(self, i: int, t: int, tree: bool, s: int) -> torch.Tensor:
        pool = self.pool
        assert pool.arange is not None
        slots = self.pos + self._offsets[:t]  # (T,)
        arange = pool.arange[:s]
        if tree:  # every slot before pos, and the tree's own pattern over the block's slots
            rel = arange - self.pos  # (span,)
            inside = (rel >= 0) & (rel < t)
            among = self._tree[t].index_select(1, rel.clamp(0, t - 1)) & inside[None, :]
            hidden = ~((rel < 0)[None, :] | among)  # (T, span)
        else:  # causal: beyond each token's own slot
            hidden = arange[None, :] > slots[:, None]
        return self.arch.attention_branch(
            i, self._x[t], self._rope[t], pool.mask(hidden)[None, None], pool.slots(slots, s)
        )

    def _run(self, key: tuple, hidden: torch.Tensor, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        t = hidden.shape[1]
        x = self._x.get(t)
        if x is None:
            with torch.inference_mode(False):
                x = self._x[t] = torch.zeros(
                    1, t, self.arch.hidden_size, dtype=self.arch.dtype, device=self.device
                )
        x.copy_(hidden)
        return self.store.run((*key, active_format()), fn)  # a draft's low-bit weights: graphs of their own

    def precapture(
        self,
        rotary: Callable[[int], Any],
        *,
        chain: Iterable[int] = (),
        tree: Iterable[int] = (),
        mlp: Iterable[int] = (),
    ) -> None:
        """Record, on the current pool, every branch graph forwards of these token counts can use:
        each block's attention for ``chain`` (causal) and ``tree`` (a token tree's mask) counts at
        every span, its MLP for all three (``mlp``: forwards whose attention runs eagerly, scratch
        passes). Counts above ``max_tokens`` take the eager path and are skipped. The recording
        forwards write garbage into the pool's slots, so the pool must not be lent."""
        fits = lambda ts: sorted({t for t in ts if 1 <= t <= self.max_tokens})  # noqa: E731
        chain_t, tree_t = fits(chain), fits(tree)
        for t in sorted({*chain_t, *tree_t, *fits(mlp)}):
            x = torch.zeros(1, t, self.arch.hidden_size, dtype=self.arch.dtype, device=self.device)
            self.set_rotary(rotary(t))
            for i in range(self.arch.num_layers):
                self.mlp(i, x)
                for s in spans(self.pool.capacity) if t in chain_t or t in tree_t else ():
                    slot = max(0, s - t)  # a forward ending inside this span
                    if t in chain_t:
                        self.attention(i, x, slot)
                    if t in tree_t:
                        self.attention(
                            i, x, slot, torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
                        )
