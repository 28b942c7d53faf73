"""The KV cache of a batch: one buffer for B sequences, each row with its own pointers.

`BatchCache` allocates the keys and values of B rows once, ``(L, B, H_kv, capacity, D)``, and
hands each row a `RowCache`: a `framework.engine.kv_cache.KVCache` of batch 1 whose buffers are
that row's views. A row's committed length, per-layer end pointers, commits, rollbacks and tree
gathers are its own, with exactly the semantics (and the code) of a one-sequence cache. Rows are
ragged: row r's slot j holds its token at position j, and nothing is re-padded when rows accept
different numbers of tokens.

`MergedRows` is the cache one forward over several rows sees (`framework.engine.batch.merge`):
each row begins, writes and ends through its own `RowCache` (its own base, its own block length);
the Hugging Face attention modules get the rows' keys and values as one tensor and a mask that
shows each row its own prefix and block only. The fused CPU branches run a row at a time on its
`RowCache` (their attention takes one base), the MLP over every row's tokens at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from framework.engine.kv_cache import KVCache
from framework.kernels.cpu import MAX_ROWS

#: A branch of the block loop: ``(block, residuals) -> residuals``.
Branch = Callable[[int, torch.Tensor], torch.Tensor]


class RowCache(KVCache):
    """Row ``row`` of a `BatchCache`: a one-sequence cache on views of the batch's buffers.

    It cannot grow (growing would give it buffers of its own, which the batch's merged forwards do
    not see): the batch allocates what its longest row needs.
    """

    def __init__(self, batch: BatchCache, row: int) -> None:
        k, v = batch.keys[:, row : row + 1], batch.values[:, row : row + 1]
        super().__init__(
            batch.num_layers, 1, k.shape[2], k.shape[4], k.shape[3], k.dtype, k.device, buffers=(k, v)
        )
        self.batch, self.row = batch, row

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            raise ValueError(
                f"row {self.row} of the batch needs {needed} KV slots, the batch holds {self.capacity}"
            )


class BatchCache:
    """KV buffers for B sequences, each row a `RowCache`.

    Args:
        num_layers, num_kv_heads, head_dim: the model's shapes.
        batch: B.
        capacity: slots per row (the longest row's prompt + budget + draft + slack).
        dtype, device: the buffers'.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        with torch.inference_mode(False):  # writable inside and outside inference mode
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers = num_layers
        self.rows = [RowCache(self, r) for r in range(batch)]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]


@dataclass(frozen=True)
class RowWrite:
    """Where one row's part of a merged forward goes (`KVCache.begin`'s arguments for that row).

    Attributes:
        cache: the row's cache.
        num_new: the row's own tokens in the forward (<= the forward's T: the rest is padding,
            written beyond the row's pointers and never kept).
        base: slot of the row's first new token (``None``: each layer's end pointer).
    """

    cache: RowCache
    num_new: int
    base: int | None


class MergedRows:
    """The cache of one forward over rows of a `BatchCache` (in order), every row writing at its
    own slots. Consecutive rows read their slice of the buffers; rows with a gap between them (a
    finished row left) read a gathered copy on the modules' path, and the fused path reads each
    row's own cache.

    Implements what the executor and the attention modules ask a cache during a forward
    (``begin``, ``update``, ``attention_mask``, ``end``, ``empty``); a fused branch runs on each
    row's cache (`rows`).
    """

    def __init__(self, batch: BatchCache, writes: Sequence[RowWrite], num_new: int) -> None:
        rows = [w.cache.row for w in writes]
        if rows != sorted(set(rows)):
            raise ValueError(f"a merged forward runs rows in order, each once, got {rows}")
        self.batch, self.writes, self.num_new = batch, list(writes), num_new
        self.first = rows[0]
        #: rows that are not one slice of the buffers (a finished row left a gap): gathered
        self._gather = (
            None if rows[-1] - rows[0] + 1 == len(rows) else torch.tensor(rows, device=batch.keys.device)
        )
        self._masks: dict[int, torch.Tensor] = {}

    @property
    def rows(self) -> list[RowCache]:
        return [w.cache for w in self.writes]

    @property
    def empty(self) -> bool:
        return False

    @property
    def dtype(self) -> torch.dtype:
        return self.batch.keys.dtype

    def begin(self, num_new: int, **_: object) -> None:
        """Every row begins its own write (its base, its own token count)."""
        for w in self.writes:
            if w.base is not None and w.base + self.num_new > w.cache.capacity:
                raise ValueError(
                    f"row {w.cache.row}'s block does not fit the batch's {w.cache.capacity} slots"
                )
            w.cache.begin(w.num_new, base=w.base)
        self._masks = {}

    def end(self) -> None:
        for w in self.writes:
            w.cache.end()

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new K/V (B', H_kv, T, D) at its own slots; return the rows' K/V
        (B', H_kv, S, D), S the furthest row's end (`attention_mask` hides what a row must not see)."""
        span = 0
        for j, w in enumerate(self.writes):
            w.cache.update(key[j : j + 1], value[j : j + 1], layer_idx)
            span = max(span, w.cache._base(layer_idx) + key.shape[2])
        n = len(self.writes)
        if self._gather is not None:  # a copy of the rows' slots (the fused path never asks)
            k = self.batch.keys[layer_idx].narrow(2, 0, span).index_select(0, self._gather)
            return k, self.batch.values[layer_idx].narrow(2, 0, span).index_select(0, self._gather)
        k = self.batch.keys[layer_idx].narrow(0, self.first, n).narrow(2, 0, span)
        v = self.batch.values[layer_idx].narrow(0, self.first, n).narrow(2, 0, span)
        return k, v

    def attention_mask(self, layer: int) -> torch.Tensor:
        """Additive mask (B', 1, T, S): row j sees its slots before its base and, among the new
        tokens, the causal order."""
        mask = self._masks.get(layer)
        if mask is not None:
            return mask
        t = self.num_new
        bases = [w.cache._base(layer) for w in self.writes]
        span = max(bases) + t
        device = self.batch.keys.device
        slots = torch.arange(span, device=device)
        base = torch.tensor(bases, device=device)[:, None, None]  # (B', 1, 1)
        new = torch.arange(t, device=device)[None, :, None]  # (1, T, 1)
        allowed = (slots < base) | ((slots >= base) & (slots <= base + new))
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        self._masks[layer] = mask = mask[:, None]
        return mask

    def branches(self, arch: Any, fused: Any, pos_emb: Any) -> tuple[Branch, Branch]:
        """The attention and MLP branches (residual included) of a forward on these rows, for the
        block loop: a fused attention runs each row on its own cache and its own tokens (the
        kernel takes one base), the modules' attention all rows through `update` and
        `attention_mask`; the MLP runs every row's tokens as one sequence (`rowwise`)."""

        def attention(i: int, x: torch.Tensor) -> torch.Tensor:
            if fused is None or fused.attn[i] is None:
                return x + arch.attention_branch(i, x, pos_emb, self.attention_mask(i), self)
            out = x.clone()
            cos, sin = pos_emb
            for j, w in enumerate(self.writes):
                n = w.num_new
                out[j : j + 1, :n] = fused.attention(
                    i,
                    x[j : j + 1, :n].contiguous(),
                    cos[j : j + 1, :n].contiguous(),
                    sin[j : j + 1, :n].contiguous(),
                    w.cache,
                )
            return out

        def mlp(i: int, x: torch.Tensor) -> torch.Tensor:
            if fused is None or fused.mlp[i] is None:
                return rowwise(lambda y: y + arch.mlp_branch(i, y), x)
            return rowwise(lambda y: fused.mlp_branch(i, y.contiguous()), x)

        return attention, mlp

    # HF attention code sometimes asks a cache these.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(w.cache.lengths[layer_idx] for w in self.writes)

    @property
    def is_compileable(self) -> bool:  # pragma: no cover - HF compatibility only
        return False


def rowwise(fn: Any, x: torch.Tensor) -> torch.Tensor:
    """``fn`` on the tokens of ``x`` (B', T, d) as one sequence of B' * T rows, in blocks of at
    most `MAX_ROWS` on a CPU (where the kernels keep a row's result independent of the block)."""
    flat = x.reshape(1, -1, x.shape[-1])
    step = MAX_ROWS if x.is_cpu else flat.shape[1]
    out = torch.cat([fn(flat[:, lo : lo + step]) for lo in range(0, flat.shape[1], step)], dim=1)
    return out.view(*x.shape[:-1], out.shape[-1])
