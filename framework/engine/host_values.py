"""What the engine already knows on the host of this round's device values (issue 56).

A strategy reads device values through ``state.read`` and hands device tensors on (a draft's
confidences, a verification's committed tokens and kept offsets); it keeps no host copies of its
own. The engine remembers the host values of what it read, uploaded or picked step by step
(`HostValues.remember`), and finds them again for the same tensor or any view of it
(`HostValues.of`: a slice, a row, ``[None]``), so that the commit, the stop check and a second
``state.read`` of a value cost no device-to-host transfer.

Every tensor the engine hands a strategy is its own (a whole-forward graph's outputs are
copies of its static buffers, `framework.engine.execution.forward_graph`), so no later forward
writes what was read; the state forgets everything at the next round's first device work
(`clear`). A strategy must not modify in place a tensor it read.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from framework.utils import upload

#: The largest tensor whose host values are remembered (elements): rounds' values are small.
MAX_ELEMENTS = 4096

#: Device constants a model keeps (`constant`); past it they start anew.
MAX_CONSTANTS = 1024


def _offsets(t: torch.Tensor) -> list[int]:
    """The storage offset of every element of ``t``, in row-major order."""
    base = t.storage_offset()
    axes = [range(0, n * s, s) if n > 1 else (0,) for n, s in zip(t.shape, t.stride(), strict=True)]
    return [base + sum(ix) for ix in itertools.product(*axes)] if t.numel() else []


@dataclass
class _Entry:
    tensor: torch.Tensor  # held: its storage is not reused while remembered
    at: dict[int, Any]  # storage offset -> host value


class HostValues:
    """The host values of device tensors the engine read or made this round, by storage."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def remember(self, t: torch.Tensor, values: Sequence[Any]) -> None:
        """``t``'s elements are ``values`` (flat, row-major)."""
        if t.numel() != len(values) or t.numel() > MAX_ELEMENTS:
            return
        key = t.untyped_storage().data_ptr()
        old = self._entries.get(key)
        at = dict(zip(_offsets(t), values, strict=True))
        if old is not None and old.tensor.dtype == t.dtype:
            old.at.update(at)
            return
        self._entries[key] = _Entry(t, at)

    def of(self, t: torch.Tensor) -> list[Any] | None:
        """``t``'s elements (flat, row-major) when every one of them is known, else ``None``."""
        if not self._entries or t.numel() > MAX_ELEMENTS:
            return None
        entry = self._entries.get(t.untyped_storage().data_ptr())
        if entry is None or entry.tensor.dtype != t.dtype:
            return None
        at = entry.at
        try:
            return [at[o] for o in _offsets(t)]
        except KeyError:
            return None

    def clear(self) -> None:
        self._entries.clear()


def constant(
    store: dict[Hashable, torch.Tensor], device: torch.device, values: Any, dtype: torch.dtype, key: Hashable
) -> torch.Tensor:
    """``values`` (numbers, lists of them, a host tensor, or with a ``key`` a function making
    them) on ``device``, uploaded once into ``store`` (a model's: the executor's ``constants``)
    under ``key`` (``None``: the values themselves)."""
    name = (key if key is not None else _frozen(values), dtype)
    out = store.get(name)
    if out is None:
        if len(store) >= MAX_CONSTANTS:
            store.clear()
        made = values() if callable(values) else values
        if isinstance(made, torch.Tensor):
            out = made.to(device, dtype, non_blocking=True)
        else:
            out = upload(made, device, dtype)
        store[name] = out
    return out


def _frozen(values: Any) -> Hashable:
    """``values`` (numbers or nested lists of them) as a hashable key."""
    if isinstance(values, (list, tuple)):
        return tuple(_frozen(v) for v in values)
    return values
