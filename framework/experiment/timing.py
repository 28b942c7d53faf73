"""The interleaved timing protocol shared by the runner, the benchmark and the reproduction
script: warm up every method, then decode each prompt with every method in an order that rotates
by one method per prompt (so slow drift on a shared machine hits every method alike), and check
each method's tokens against the baseline's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """``items`` rotated left by ``turn`` (mod its length): the order of the ``turn``-th prompt.
    With two methods this alternates which goes first."""
    if not items:
        return []
    k = turn % len(items)
    return list(items[k:]) + list(items[:k])


def warm_up(methods: Iterable[T], decode: Callable[[T], Any], repeats: int = 1) -> None:
    """Decode once per method, ``repeats`` times (kernels compiled, caches sized, allocator warm)
    before anything is timed."""
    methods = list(methods)
    for _ in range(repeats):
        for m in methods:
            decode(m)


def decode_interleaved(methods: Sequence[T], decode: Callable[[T], R], turn: int) -> dict[T, R]:
    """Decode one prompt with every method in `rotated` order; returns ``{method: result}`` in
    that order."""
    return {m: decode(m) for m in rotated(methods, turn)}


def first_mismatch(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> dict[str, int] | None:
    """Where the turns ``got`` first differ from ``want`` (``{"turn", "position"}``), or ``None``
    when they are token-identical (the lossless check of greedy decoding)."""
    for turn, (g, w) in enumerate(zip(got, want, strict=False)):
        if list(g) != list(w):
            pos = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
            return {"turn": turn, "position": pos}
    if len(got) != len(want):
        return {"turn": min(len(got), len(want)), "position": 0}
    return None
