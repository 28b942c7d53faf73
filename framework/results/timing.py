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


#: A mismatch whose top-1/top-2 margin is below this many units in the last place (ulp) of the
#: top-1 logit, in the model's dtype, is reported as a near-tie (see `near_tie`).
NEAR_TIE_ULPS = 8


def ulp(value: float, dtype: Any) -> float:
    """One unit in the last place of ``value`` in the torch floating dtype ``dtype``."""
    import math

    import torch

    info = torch.finfo(dtype)
    mag = max(abs(float(value)), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(mag))


def near_tie(margin: float, top1: float, dtype: Any) -> bool:
    """A top-1/top-2 logit margin within the rounding noise of ``dtype``: below `NEAR_TIE_ULPS`
    ulps of the top-1 logit. Two decoders that compute the same logits in a different order (a
    verification over k + 1 tokens against one token at a time; another GPU kernel) can round a
    margin that small either way, so a greedy token flips without any bug. A margin far above it
    points at a bug (the decoders disagree on more than rounding)."""
    return margin < NEAR_TIE_ULPS * ulp(top1, dtype)


def mismatch_details(
    adapter: Any,
    encode: Callable[[list[dict[str, str]]], list[int]],
    user_turns: Sequence[str],
    want: Sequence[tuple[Sequence[int], str]],
    got: Sequence[Sequence[int]],
    mismatch: dict[str, int],
) -> dict[str, Any]:
    """The `first_mismatch` of ``got`` against the baseline ``want`` with the target's view of
    that position: one forward of the full model (through ``adapter``) over the baseline's
    context up to the mismatch, after the fact (lossless runs never pay for it).

    Args:
        adapter: the target's `ModelAdapter`.
        encode: chat messages -> prompt token ids (the experiment's chat template).
        user_turns: the prompt's user turns.
        want: the baseline's turns as ``(tokens, text)``; a turn's context holds the earlier
            answers, which are the same for both decoders up to the mismatching turn.
        got: the method's tokens per turn.
        mismatch: `first_mismatch`'s ``{"turn", "position"}``.

    Returns:
        ``mismatch`` plus ``vanilla_token`` and ``method_token`` (``None`` past the end of that
        turn: one stopped earlier), ``margin`` (top-1 minus top-2 logit of the target there),
        ``top1`` (its top-1 logit), ``dtype`` and ``near_tie`` (`near_tie`); the margin fields
        are ``None`` when the position has no context (a missing turn).
    """
    import torch

    turn, pos = mismatch["turn"], mismatch["position"]
    out: dict[str, Any] = dict(mismatch)
    w = list(want[turn][0]) if turn < len(want) else []
    g = list(got[turn]) if turn < len(got) else []
    out["vanilla_token"] = w[pos] if pos < len(w) else None
    out["method_token"] = g[pos] if pos < len(g) else None
    out.update(margin=None, top1=None, dtype=str(adapter.dtype).removeprefix("torch."), near_tie=None)
    if turn >= len(want) or turn >= len(user_turns):
        return out
    messages: list[dict[str, str]] = []
    for t in range(turn):
        messages += [{"role": "user", "content": user_turns[t]}, {"role": "assistant", "content": want[t][1]}]
    messages.append({"role": "user", "content": user_turns[turn]})
    ids = list(encode(messages)) + w[:pos]
    x = torch.tensor([ids], device=adapter.device)
    with torch.inference_mode():
        cache = adapter.new_cache(len(ids))
        positions = torch.arange(len(ids), device=adapter.device)[None]
        logits = adapter.forward(x, positions, cache, logits_at="last").logits[0, -1]
    top = torch.topk(logits, 2).values.tolist()  # in the model's dtype: the margin it rounds
    out["margin"] = top[0] - top[1]
    out["top1"] = top[0]
    out["near_tie"] = near_tie(out["margin"], top[0], adapter.dtype)
    return out


def mismatch_note(qid: str, where: dict[str, Any] | None) -> str:
    """``q3 (turn 0, pos 17, top-1/top-2 margin 0.0012 in bfloat16: a near-tie)``: where a prompt
    first differs from vanilla and the target's logit margin there. A near-tie (the margin within
    `NEAR_TIE_ULPS` ulps of the top-1 logit in the run's dtype) is a
    rounding flip, expected in reduced precision or on a GPU; a wide margin points at a bug."""
    if not where:
        return f"q{qid}"
    text = f"q{qid} (turn {where.get('turn')}, pos {where.get('position')}"
    margin = where.get("margin")
    if margin is not None:
        verdict = "a near-tie" if where.get("near_tie") else "not a near-tie: a bug?"
        text += f", top-1/top-2 margin {margin:.3g} in {where.get('dtype')}: {verdict}"
    return text + ")"
