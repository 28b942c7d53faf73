"""Where a model's blocks live: one device, or a split across devices (``--device-map``) for a
model larger than one GPU.

A `BlockPlacement` lists, for consecutive ranges of blocks (its shards), the device that holds
their weights and their KV cache. The embedding sits with the first shard, the final norm and the
LM head with the last. The executor (`framework.engine.adapter.ModelAdapter`) moves the residual
stream to the next shard's device at each boundary and gives every shard a KV buffer of its own
on its device; skip plans, early exits and every strategy work unchanged, and what a forward
returns (logits, hidden states) comes back on the input device.

``--device-map`` is ``auto`` (Hugging Face / accelerate's balanced placement over the visible
GPUs, then the CPU) or a list of shards, ``DEVICE[=BLOCKS],...``: ``cuda:0=20,cuda:1`` puts 20
blocks on ``cuda:0`` and the rest on ``cuda:1``; without counts the blocks are split evenly
(``cuda:0,cpu``). A device may appear twice (``cpu=2,cpu``): the split path then runs on one device,
which is how the tests check it on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Shard:
    """Consecutive blocks on one device, with one KV buffer.

    Attributes:
        device: where their weights and KV live.
        blocks: the block indices, a range.
    """

    device: torch.device
    blocks: range


@dataclass(frozen=True)
class BlockPlacement:
    """The shards of a model's blocks, in order (they cover ``0..L-1`` exactly once).

    Attributes:
        shards: the shards.
    """

    shards: tuple[Shard, ...]

    def __post_init__(self) -> None:
        covered = [i for s in self.shards for i in s.blocks]
        if not self.shards or covered != list(range(len(covered))):
            raise ValueError(
                f"shards must cover blocks 0..L-1 in order, got {[s.blocks for s in self.shards]}"
            )

    @property
    def num_layers(self) -> int:
        return self.shards[-1].blocks.stop

    @property
    def split(self) -> bool:
        """More than one shard (the residual stream crosses a boundary)."""
        return len(self.shards) > 1

    @property
    def input_device(self) -> torch.device:
        """The embedding's device (the first shard's): tokens, logits and hidden states live here."""
        return self.shards[0].device

    @property
    def output_device(self) -> torch.device:
        """The final norm's and LM head's device (the last shard's)."""
        return self.shards[-1].device

    def device_of(self, block: int) -> torch.device:
        return self.shards[self.shard_of(block)].device

    def shard_of(self, block: int) -> int:
        for k, s in enumerate(self.shards):
            if block in s.blocks:
                return k
        raise ValueError(f"block {block} is in no shard (the model has {self.num_layers} blocks)")

    def describe(self) -> str:
        return ", ".join(f"{s.device}: blocks {s.blocks.start}-{s.blocks.stop - 1}" for s in self.shards)

    # ---- building ----------------------------------------------------------------------------
    @classmethod
    def single(cls, num_layers: int, device: torch.device | str) -> BlockPlacement:
        return cls((Shard(torch.device(device), range(num_layers)),))

    @classmethod
    def of_blocks(cls, blocks: Sequence[nn.Module]) -> BlockPlacement:
        """The placement the blocks' weights have: one shard per run of blocks on one device."""
        shards: list[Shard] = []
        for i, blk in enumerate(blocks):
            dev = next(blk.parameters()).device
            if shards and shards[-1].device == dev:
                shards[-1] = Shard(dev, range(shards[-1].blocks.start, i + 1))
            else:
                shards.append(Shard(dev, range(i, i + 1)))
        return cls(tuple(shards))

    @classmethod
    def parse(cls, spec: str, num_layers: int) -> BlockPlacement:
        """A placement from ``DEVICE[=BLOCKS],...`` (see the module docstring).

        Raises:
            ValueError: an empty or malformed spec, a bad device, counts that do not add up to at
                most L (the last device without a count takes the rest), or a shard without blocks.
        """
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts:
            raise ValueError("a device map names at least one device: DEVICE[=BLOCKS],...")
        devices, counts = [], []
        for part in parts:
            name, _, count = part.partition("=")
            try:
                devices.append(torch.device(name.strip()))
            except RuntimeError:
                raise ValueError(f"{name.strip()!r} is not a device (cpu, cuda, cuda:N)") from None
            if count:
                if not count.strip().isdigit() or int(count) < 1:
                    raise ValueError(f"{part!r}: BLOCKS must be an integer >= 1")
                counts.append(int(count))
            else:
                counts.append(None)
        counts = _fill(counts, num_layers)
        shards, start = [], 0
        for dev, n in zip(devices, counts, strict=True):
            shards.append(Shard(dev, range(start, start + n)))
            start += n
        return cls(tuple(shards))


def _fill(counts: list[int | None], num_layers: int) -> list[int]:
    """Block counts for every shard: given ones as they are, the others sharing the rest evenly
    (earlier shards one more when it does not divide)."""
    given = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    if given > num_layers or (not free and given != num_layers):
        raise ValueError(f"the shards' blocks add up to {given}, the model has {num_layers}")
    rest = num_layers - given
    if free and rest < len(free):
        raise ValueError(f"{len(free)} devices without a count share only {rest} blocks")
    out = list(counts)
    for k, i in enumerate(free):
        out[i] = rest // len(free) + (1 if k < rest % len(free) else 0)
    return [int(c) for c in out]
