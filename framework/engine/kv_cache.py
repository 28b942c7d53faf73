"""The KV cache: preallocated per-layer buffers with per-layer length pointers.

This module is the single owner of cache semantics (``docs/concepts.md`` states them as
invariants, and ``tests/framework/engine/test_kv_cache.py`` checks them against fresh full forwards):

1. **Committed prefix.** Slots ``[0, committed)`` hold the target model's KV of the committed
   tokens in *every* layer.
2. **Draft positions** are appended after the committed prefix only in the layers whose attention
   the draft ran (``lengths[l]`` is the per-layer end pointer), so a later draft token attends to the
   full-model prefix plus the draft's own earlier tokens in that layer.
3. **Verification** writes the verified block at ``[committed, committed + T)`` in every layer,
   overwriting whatever the draft left there.
4. **Commit / rollback** moves the pointers: ``commit(n)`` keeps ``n`` verified positions (optionally
   gathering a tree path into place first) and drops everything after them; nothing is copied in the
   chain case.
4b. **Early-exit reuse** (``keep_draft``): a draft that ran blocks ``0..E-1`` unchanged wrote the
   target's own KV there, so a verification may keep those draft slots and write only the
   remaining layers (and the positions the draft never reached).
5. **Scratch evaluation** (SWIFT's teacher-forced candidate scoring) writes beyond every layer's end
   pointer, attends to a chosen visible prefix plus the scratch block, and leaves every pointer as it
   was, so the committed cache is never touched and nothing needs copying.

The cache implements the one method Hugging Face attention modules call on a cache,
``update(key, value, layer_idx, *args)``, so unmodified HF attention writes into it directly.

Shapes: buffers are ``(L, B, H_kv, capacity, D)``. A cache of a model split across devices
(``shards``) holds one such buffer per shard, ``(blocks of the shard, B, H_kv, capacity, D)`` on
the shard's device; the semantics are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Write:
    """Where one forward writes and what it attends to (set by `KVCache.begin`)."""

    num_new: int
    base: int | None  # slot of the first new token; None = each layer's own end pointer
    visible: int | None  # prefix slots the new tokens may attend to; None = base
    tree_mask: torch.Tensor | None  # (T, T) bool among new tokens; None = causal
    persist: bool


class KVCache:
    """Preallocated KV buffers for one batch of sequences.

    Args:
        num_layers: decoder blocks L.
        batch: B.
        num_kv_heads: H_kv.
        head_dim: D.
        capacity: initial number of slots (grows by doubling if ever exceeded).
        dtype: buffer dtype (the model's).
        device: buffer device.
        buffers: ``(keys, values)`` to use instead of fresh zeros, each (L, B, H_kv, C, D) with
            C >= ``capacity`` (the pool of `framework.engine.execution.branches.BranchGraphs`, lent by
            `ModelAdapter.new_cache`; whatever they hold beyond the pointers is never read).
        on_release: called with the cache by `release` (gives a lent pool back).
        shards: ``(blocks, device)`` per shard of a model split across devices (consecutive block
            ranges covering ``0..L-1``): one buffer per shard on its device instead of one for all
            (``device`` and ``buffers`` are then not used).
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
        on_release: Callable[[KVCache], None] | None = None,
        shards: Sequence[tuple[range, torch.device]] | None = None,
    ) -> None:
        self.num_layers = num_layers
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        if shards is None:
            shards = [(range(num_layers), torch.device(device))]
        if [i for r, _ in shards for i in r] != list(range(num_layers)):
            raise ValueError(
                f"cache shards must cover layers 0..{num_layers - 1} in order, got {[r for r, _ in shards]}"
            )
        self._shard_ranges = [r for r, _ in shards]
        if buffers is not None:
            k, v = buffers
            if k.shape[:3] != shape[:3] or k.shape[3] < capacity or k.shape[4] != head_dim or len(shards) > 1:
                raise ValueError(f"cache buffers of shape {tuple(k.shape)} do not hold {shape}")
            self._k_shards, self._v_shards = [k], [v]
        else:
            # Normal (not inference-mode) tensors: writable inside and outside torch.inference_mode.
            with torch.inference_mode(False):
                self._k_shards = [
                    torch.zeros(len(r), *shape[1:], dtype=dtype, device=dev) for r, dev in shards
                ]
                self._v_shards = [
                    torch.zeros(len(r), *shape[1:], dtype=dtype, device=dev) for r, dev in shards
                ]
        self._on_release = on_release
        self._layer_views()
        #: slots [0, committed) are the target's KV of committed tokens in every layer.
        self.committed = 0
        #: per-layer end pointer (>= committed); slots beyond committed are draft KV.
        self.lengths = [0] * num_layers
        self._write: _Write | None = None
        self._written: list[bool] = [False] * num_layers
        self._mask_cache: dict[tuple[int, int, torch.device], torch.Tensor | None] = {}

    # ------------------------------------------------------------------ properties
    @property
    def keys(self) -> torch.Tensor:
        """The keys buffer (L, B, H_kv, capacity, D).

        Raises:
            ValueError: a cache split across devices has one buffer per shard (`committed_kv`
                reads any layer).
        """
        if len(self._k_shards) > 1:
            raise ValueError(
                "a cache split across devices has no single keys buffer: use committed_kv(layer)"
            )
        return self._k_shards[0]

    @property
    def values(self) -> torch.Tensor:
        """The values buffer (L, B, H_kv, capacity, D); see `keys`."""
        if len(self._v_shards) > 1:
            raise ValueError(
                "a cache split across devices has no single values buffer: use committed_kv(layer)"
            )
        return self._v_shards[0]

    @property
    def capacity(self) -> int:
        return self._k_shards[0].shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self._k_shards[0].dtype

    def device_of(self, layer: int) -> torch.device:
        """Where ``layer``'s KV lives."""
        return self._k_layers[layer].device

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        for bufs in (self._k_shards, self._v_shards):
            for k, old in enumerate(bufs):
                with torch.inference_mode(False):
                    buf = torch.zeros(
                        *old.shape[:3], new_cap, old.shape[4], dtype=old.dtype, device=old.device
                    )
                buf[:, :, :, : old.shape[3]] = old
                bufs[k] = buf
        self._layer_views()

    def _layer_views(self) -> None:
        # Per-layer views (B, H_kv, capacity, D) of the buffers: `update` runs once per layer and
        # token, and narrowing a view is cheaper than indexing the 5-d buffer.
        with torch.inference_mode(False):  # normal views: writable inside and outside inference mode
            self._k_layers = [layer for buf in self._k_shards for layer in buf.unbind(0)]
            self._v_layers = [layer for buf in self._v_shards for layer in buf.unbind(0)]

    # ------------------------------------------------------------------ one forward
    def begin(
        self,
        num_new: int,
        *,
        base: int | None = None,
        visible: int | None = None,
        tree_mask: torch.Tensor | None = None,
        persist: bool = True,
        writes: Iterable[int] | None = None,
    ) -> None:
        """Declare the next forward: ``num_new`` tokens, where they go and what they see.

        Args:
            num_new: T, tokens in the forward.
            base: slot of the first new token in every layer; ``None`` appends at each layer's
                end pointer (drafting, prefill, plain decoding).
            visible: number of leading slots the new tokens may attend to (``None`` = base). Slots
                ``[visible, base)`` are hidden; used by scratch evaluation.
            tree_mask: BoolTensor (T, T), which new tokens each new token may attend to (itself
                included); ``None`` = causal.
            persist: ``False`` leaves every end pointer unchanged afterwards (scratch).
            writes: the layers whose KV the forward writes, declared up front by an executor that
                writes them without calling `update` or `claim` per layer (one CUDA graph of the
                whole forward, `framework.engine.execution.forward_graph`); ``None``: each layer counts as written
                when its attention calls `update` or `claim`.
        """
        if self._write is not None:
            raise RuntimeError("KVCache.begin called twice without end()")
        if base is not None and base < self.committed and persist:
            raise ValueError(f"cannot overwrite committed slots: base {base} < committed {self.committed}")
        end = (base if base is not None else max(self.lengths, default=0)) + num_new
        self._ensure_capacity(end)
        self._write = _Write(num_new, base, visible, tree_mask, persist)
        self._written = [False] * self.num_layers
        for layer in writes or ():
            self._written[layer] = True
        self._mask_cache = {}

    def end(self) -> None:
        """Finish the forward declared by `begin` and move the end pointers."""
        w = self._write
        if w is None:
            raise RuntimeError("KVCache.end called without begin()")
        if w.persist:
            for layer in range(self.num_layers):
                if self._written[layer]:
                    self.lengths[layer] = self._base(layer) + w.num_new
                elif w.base is not None:
                    # The layer did not run: whatever it held beyond base is stale now.
                    self.lengths[layer] = min(self.lengths[layer], w.base)
        self._write = None

    def first_slots(self) -> list[int]:
        """Every layer's slot of the current forward's first new token (`begin`'s ``base``, else
        the layer's end pointer)."""
        w = self._write
        if w is None:
            raise RuntimeError("KVCache.first_slots called outside begin()/end()")
        return list(self.lengths) if w.base is None else [w.base] * self.num_layers

    def _base(self, layer: int) -> int:
        w = self._write
        assert w is not None
        return self.lengths[layer] if w.base is None else w.base

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V of one layer and return that layer's visible K/V.

        Called by Hugging Face attention modules. ``key``/``value``: (B, H_kv, T, D).

        Returns:
            (keys, values), each (B, H_kv, base + T, D), views into the buffers.
        """
        w = self._write
        if w is None:
            raise RuntimeError("KVCache.update called outside begin()/end()")
        base = self._base(layer_idx)
        t = key.shape[2]
        k, v = self._k_layers[layer_idx], self._v_layers[layer_idx]
        k.narrow(2, base, t).copy_(key)
        v.narrow(2, base, t).copy_(value)
        self._written[layer_idx] = True
        return k.narrow(2, 0, base + t), v.narrow(2, 0, base + t)

    def claim(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`update` for a fused kernel that writes the new tokens' K/V itself.

        Returns:
            ``(keys, values, base)``: the layer's whole buffers (B, H_kv, capacity, D) and the
            slot where the forward's first new token goes. The layer counts as written, exactly
            as after `update`; the caller must write slots ``[base, base + T)``.
        """
        if self._write is None:
            raise RuntimeError("KVCache.claim called outside begin()/end()")
        self._written[layer] = True
        return self._k_layers[layer], self._v_layers[layer], self._base(layer)

    def causal_only(self, layer: int) -> bool:
        """Whether the new tokens of the current forward see exactly the committed/earlier slots
        and the new tokens before them (plain causal attention: no tree, no hidden slots)."""
        w = self._write
        assert w is not None
        return (w.visible is None or w.visible == self._base(layer)) and w.tree_mask is None

    def block_mask(self, layer: int) -> tuple[bool, torch.Tensor | None]:
        """How the new tokens of the current forward attend in ``layer``: ``(True, tree)`` when they
        see every slot before them plus, among themselves, the causal order (``tree`` ``None``) or
        the forward's tree mask (T, T); ``(False, None)`` when some slots are hidden (scratch)."""
        w = self._write
        assert w is not None
        if w.visible is not None and w.visible != self._base(layer):
            return False, None
        return True, w.tree_mask

    @property
    def empty(self) -> bool:
        """No slot written yet in any layer (the next forward is a prefill)."""
        return self.committed == 0 and not any(self.lengths)

    def attention_mask(self, layer: int) -> torch.Tensor | None:
        """Additive float mask (1, 1, T, base + T) for ``layer`` in the current forward.

        ``None`` when the new tokens may attend to everything before them and T == 1 (the common
        single-token step), which lets SDPA take its fastest path.
        """
        w = self._write
        assert w is not None
        base = self._base(layer)
        visible = base if w.visible is None else w.visible
        device = self._k_layers[layer].device
        key = (base, visible, device)
        if key in self._mask_cache:
            return self._mask_cache[key]
        t = w.num_new
        if t == 1 and visible == base and w.tree_mask is None:
            mask = None
        else:
            allowed = torch.zeros(t, base + t, dtype=torch.bool, device=device)
            allowed[:, :visible] = True
            block = (
                w.tree_mask
                if w.tree_mask is not None
                else torch.ones(t, t, dtype=torch.bool, device=device).tril()
            )
            allowed[:, base : base + t] = block.to(device, non_blocking=True)  # host mask: no wait
            mask = torch.zeros(t, base + t, dtype=self.dtype, device=device)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            mask = mask[None, None]
        self._mask_cache[key] = mask
        return mask

    # ------------------------------------------------------------------ state changes
    def rollback(self) -> None:
        """Drop every uncommitted (draft) slot in every layer."""
        self.lengths = [self.committed] * self.num_layers

    def keep_draft(self, num: int, layers: range) -> None:
        """Keep the first ``num`` draft slots of ``layers`` and drop every other uncommitted slot.

        Early-exit reuse: an early-exit draft ran blocks ``0..E-1`` unchanged, so its KV there
        *is* the target's for the drafted positions; verification keeps it
        (``layers = range(E)``) and computes only the rest. Nothing is copied.

        Raises:
            ValueError: a layer in ``layers`` holds fewer than ``num`` draft slots.
        """
        c = self.committed
        short = [i for i in layers if self.lengths[i] < c + num]
        if short:
            raise ValueError(f"cannot keep {num} draft slots: layers {short} hold fewer")
        keep = set(layers)
        self.lengths = [c + num if i in keep else c for i in range(self.num_layers)]

    def commit(
        self, num: int, keep: torch.Tensor | None = None, keep_host: Sequence[int] | None = None
    ) -> None:
        """Commit ``num`` verified positions written at ``[committed, committed + T)``.

        Args:
            num: positions to keep (m + 1 after a verification).
            keep: LongTensor (num,) of offsets within the verified block to keep, in order (tree
                verification); ``None`` keeps the first ``num``.
            keep_host: ``keep`` as Python ints when the caller has them (checked without a
                device read).

        Raises:
            ValueError: some layer does not hold ``num`` verified positions.
        """
        c = self.committed
        short = [i for i, n in enumerate(self.lengths) if n < c + num]
        if short:
            raise ValueError(
                f"cannot commit {num} positions: layers {short} hold only {min(self.lengths) - c}"
            )
        if keep is not None:
            keep = keep.to(self._k_shards[0].device)
            if keep.numel() != num:
                raise ValueError(f"keep has {keep.numel()} offsets, expected {num}")
            written = min(self.lengths) - c
            if keep_host is not None:
                lo, hi = (min(keep_host), max(keep_host)) if num else (0, 0)
            else:
                lo, hi = torch.stack(torch.aminmax(keep)).tolist() if num else (0, 0)  # one device read
            if lo < 0 or hi >= written:
                raise ValueError(
                    f"keep offsets must be in [0, {written}) (the verified block), got {keep.tolist()}"
                )
            idx = c + keep
            for buf in (*self._k_shards, *self._v_shards):
                at = idx.to(buf.device, non_blocking=True)
                buf[:, :, :, c : c + num] = buf.index_select(3, at)
        self.committed = c + num
        self.rollback()

    def committed_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed (B, H_kv, committed, D) keys and values of ``layer`` (views)."""
        return self._k_layers[layer][:, :, : self.committed], self._v_layers[layer][:, :, : self.committed]

    def release(self) -> None:
        """Say that this cache will not be used again (the decoders call it when a generation
        ends), so that buffers it was lent can serve the next cache. Idempotent."""
        if self._on_release is not None:
            self._on_release(self)
            self._on_release = None

    # HF attention code sometimes asks a cache these; answer like a static cache would.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    @property
    def is_compileable(self) -> bool:  # pragma: no cover - HF compatibility only
        return False
