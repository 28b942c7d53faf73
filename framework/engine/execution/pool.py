"""The KV pool: buffers at a fixed address that CUDA graphs read and write, lent to one KV cache
at a time (`KVPool.lease`).

A graph fixes every address it touches, so the forwards it replays write their keys and values
into the pool's buffers. ``ModelAdapter.new_cache`` asks the pool first; a cache that cannot have
it (a batch of several sequences, the pool still held by a live cache) gets buffers of its own and
runs eagerly. The new tokens' keys and values go to slots computed inside the graph from a device
tensor (`SlotCache`), so neither the slot nor the step is part of a graph.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch

from framework.kernels.protocols import BranchModel, CacheSlots

#: Smallest pool capacity (slots); a larger request rounds up to the next power of two.
MIN_CAPACITY = 512


def pow2(n: int, lo: int) -> int:
    """``n`` rounded up to a power of two, at least ``lo``."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class SlotCache:
    """What an HF attention module needs of a cache: ``update`` writes the new tokens' K/V of one
    layer at ``slots`` (a device tensor) and returns the layer's first ``span`` slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, span: int) -> None:
        self.keys, self.values, self.slots, self.span = keys, values, slots, span

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.slots, key)
        v.index_copy_(2, self.slots, value)
        return k[:, :, : self.span], v[:, :, : self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # pragma: no cover - HF compatibility only
        return 0


class KVPool:
    """Every layer's keys and values for one sequence, lent to one cache at a time.

    Args:
        arch: the model's shape (layers, KV heads, head size, dtype, device).
        on_grow: called before the pool is reallocated (every graph recorded on it is stale).

    Attributes:
        keys, values: (L, 1, kv_heads, capacity, head_dim), or ``None`` before the first `reserve`.
        arange: ``arange(capacity)`` on the device (the slots graphs mask by).
    """

    def __init__(self, arch: BranchModel, on_grow: Callable[[], None]) -> None:
        self.arch = arch
        self.device = arch.device
        self._on_grow = on_grow
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.arange: torch.Tensor | None = None
        self._holder: Callable[[], Any] | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    def reserve(self, capacity: int) -> None:
        """Make the pool hold at least ``capacity`` slots (rounded up to a power of two, at least
        `MIN_CAPACITY`). Growing it reallocates the pool and drops every graph recorded on it
        (``on_grow``), so a run sizes it before it records any."""
        if capacity <= self.capacity:
            return
        cap = pow2(capacity, MIN_CAPACITY)
        a = self.arch
        shape = (a.num_layers, 1, a.num_kv_heads, cap, a.head_dim)
        self._on_grow()
        self.keys = self.values = None
        with torch.inference_mode(False):
            # zeros, not empty: masked slots still enter the attention product (times 0)
            self.keys = torch.zeros(shape, dtype=a.dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=a.dtype, device=self.device)
            self.arange = torch.arange(cap, device=self.device)

    def lease(self, capacity: int, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pool's buffers for a new cache of ``capacity`` slots, or ``None`` (the cache then
        allocates its own and runs eagerly): a batch of several sequences, or a pool still lent
        to a live cache. A larger capacity than the pool's reallocates it (`reserve`)."""
        if batch != 1 or self.lent:
            return None
        self.reserve(capacity)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    @property
    def lent(self) -> bool:
        """Whether a live cache holds the pool."""
        if self._holder is None or self._holder() is None:
            return False
        gc.collect()  # a holder kept alive only by a reference cycle
        return self._holder() is not None

    def lent_to(self, cache: CacheSlots) -> None:
        """Record that ``cache`` holds the pool (until it is released or garbage)."""
        self._holder = weakref.ref(cache)

    def give_back(self, cache: CacheSlots) -> None:
        if self._holder is not None and self._holder() is cache:
            self._holder = None

    def holds(self, cache: CacheSlots) -> bool:
        """Whether ``cache`` writes into the pool (a cache that grew past it no longer does)."""
        return self.keys is not None and cache.keys is self.keys

    def slots(self, slots: torch.Tensor, span: int) -> SlotCache:
        """The cache object through which a static attention writes at ``slots`` and reads the
        first ``span`` slots of its layer."""
        assert self.keys is not None and self.values is not None
        return SlotCache(self.keys, self.values, slots, span)

    def mask(self, hidden_slots: torch.Tensor) -> torch.Tensor:
        """An additive attention mask: ``finfo.min`` where ``hidden_slots``, 0 elsewhere."""
        dtype = self.arch.dtype
        mask = torch.zeros(hidden_slots.shape, dtype=dtype, device=self.device)
        return mask.masked_fill(hidden_slots, torch.finfo(dtype).min)
