"""What the kernels need of the layers above them, declared here so that the kernels import nothing
of the engine (not even for type checking): the engine's `KVCache` and `ModelAdapter` satisfy these
protocols structurally.

- `CacheSlots`: the KV cache as a fused attention branch writes and reads it (one forward's slots
  of one layer, and whether its mask is plain causal);
- `BranchModel`: one architecture's blocks as the fused branches and the CUDA graphs call them (the
  model's own attention and MLP modules, its rotary embedding, its shapes).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from framework.types import DraftWeights, weights_key  # noqa: F401  (the API's: a draft's weights as strategies see them)

__all__ = ["DraftWeights", "weights_key"]


class CacheSlots(Protocol):
    """A KV cache during one forward (`framework.engine.kv_cache.KVCache` between ``begin`` and
    ``end``).

    Attributes:
        keys: FloatTensor (L, B, H_kv, capacity, D).
        values: FloatTensor (L, B, H_kv, capacity, D).
        committed: slots ``[0, committed)`` hold the committed prefix in every layer.
        lengths: per-layer end pointers.
    """

    keys: torch.Tensor
    values: torch.Tensor
    committed: int
    lengths: list[int]

    def begin(
        self,
        num_new: int,
        *,
        base: int | None = None,
        visible: int | None = None,
        tree_mask: torch.Tensor | None = None,
        persist: bool = True,
    ) -> None:
        """Start a forward of ``num_new`` tokens."""

    def end(self) -> None:
        """End the forward started by `begin`."""

    def claim(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(keys, values, first slot)`` of ``layer`` for the new tokens, marking them written."""

    def causal_only(self, layer: int) -> bool:
        """Whether the new tokens of ``layer`` attend causally to exactly the slots before them."""

    def attention_mask(self, layer: int) -> torch.Tensor | None:
        """The additive attention mask of ``layer`` for this forward (``None``: plain causal)."""

    def block_mask(self, layer: int) -> tuple[bool, torch.Tensor | None]:
        """``(whole prefix visible, tree mask or None)`` of ``layer`` for this forward."""

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> Any:
        """Hugging Face's cache call: write the new tokens' K/V of one layer."""


class BranchModel(Protocol):
    """A model's architecture as the kernels call it (`framework.engine.architecture.Architecture`,
    which the engine passes to them)."""

    config: Any

    @property
    def blocks(self) -> list[nn.Module]:
        """The decoder blocks in order."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
        """Position embeddings for the attention modules (RoPE cos/sin)."""

    def attention_branch(
        self, i: int, hidden: torch.Tensor, pos_emb: Any, mask: torch.Tensor | None, cache: Any
    ) -> torch.Tensor:
        """The residual update of block i's attention sub-layer (norm included); writes KV."""

    def mlp_branch(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """The residual update of block i's MLP sub-layer (norm included)."""

    def new_cache(self, capacity: int, batch: int = 1) -> CacheSlots:
        """A fresh KV cache of ``capacity`` slots."""
